"""A read-only handle that follows a live log (the viewer, a notebook) forgets the
manifests the pointer's checkpoint covers, as a writer does after its own checkpoint:
it held every manifest it read since it opened, about 1.5 KB a commit, for ever."""

from __future__ import annotations

from conftest import Root

import poimen_data as pdm
from poimen_data import events as E


def test_a_read_only_handle_forgets_what_a_checkpoint_covers(root: Root) -> None:
    writer = root.open(checkpoint_interval=10)
    reader = root.open(read_only=True)
    bodies = {}
    held = []
    for i in range(95):
        with writer.transaction() as tx:
            ref = tx.put_blob("acme", f"body {i}".encode())
            tx.append(E.RunStarted("acme", f"r{i:03d}", "wf"))
            tx.append(E.AttemptDispatched("acme", f"r{i:03d}", 0, "s", 0, 1, prompt=ref))
        bodies[ref] = f"body {i}".encode()
        if i == 40:  # a body reduced, then committed again: it stays in staging
            first = next(iter(bodies))
            pdm.reduce(writer, [first], lambda body: b"summary")
            with writer.transaction() as tx:
                assert tx.put_blob("acme", bodies[first]) == first
                tx.append(E.RunStarted("acme", "again", "wf"))
        if i % 3 == 0:
            reader.refresh()  # follows the log, as a viewer does
            held.append(len(reader._state.manifests_since_checkpoint))
    writer.flush()
    reader.refresh()
    assert max(held) <= 2 * 10 + 3, held  # 97 on a handle that never forgets
    assert reader.head == writer.head
    assert reader.read_events().equals(root.open(read_only=True).read_events())
    for ref, data in bodies.items():  # every body found, the recommitted one in staging
        assert reader.blobs.get(ref) == data, ref
    assert pdm.episode(reader, "r000").branches[0].attempts[0].prompt in bodies
