"""The synthetic workload: deterministic per seed, and it has every shape it promises.

Counts are checked twice: against pinned numbers (the generator must not drift silently)
and against an independent count from the committed log (the summary must not lie).
"""

from __future__ import annotations

import hashlib
import uuid
from collections import Counter, defaultdict
from decimal import Decimal

import pyarrow as pa
import pytest

from poimen_data import events as ev
from poimen_data import open_log, synth

RUNS, SEED = 120, 3


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory):
    root = str(tmp_path_factory.mktemp("synth") / "log")
    summary = synth.generate(root, runs=RUNS, seed=SEED, batch=8)
    log = open_log(root, create=False)
    return summary, log, log.read_events().to_pylist()


def _digest(rows: list[dict]) -> str:
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def test_same_seed_same_log_other_seed_other_log() -> None:
    digests = []
    for seed in (SEED, SEED, SEED + 1):
        root = f"memory://synth-{uuid.uuid4().hex}"
        synth.generate(root, runs=30, seed=seed, batch=4)
        digests.append(_digest(open_log(root).read_events().to_pylist()))
    assert digests[0] == digests[1]
    assert digests[0] != digests[2]


def test_pinned_digest_of_the_events(recorded) -> None:
    _summary, _log, rows = recorded
    assert _digest(rows) == PINNED_DIGEST


PINNED_DIGEST = "30fdd3d17840ee032d2ceb889a32d926960200d64eccf64d81139af95f8b9284"


def test_summary_pinned(recorded) -> None:
    s, log, rows = recorded
    assert (s.runs, s.events, s.commits, s.head) == (RUNS, len(rows), PIN["commits"], len(rows))
    assert s.runs_by_state == PIN["runs_by_state"]
    assert s.attempts_by_outcome == PIN["attempts_by_outcome"]
    got = {k: getattr(s, k) for k in ("retries", "forks", "forks_of_forks",
                                      "cancelled_while_verifying", "crashed", "recovered",
                                      "left_dispatched", "bodies", "shared_bodies")}
    assert got == PIN["shapes"]


PIN: dict = {
    "commits": 211,
    "runs_by_state": {"cancelled": 10, "failed": 13, "succeeded": 26, "verifying": 71},
    "attempts_by_outcome": {"dispatched": 1, "failed": 178, "succeeded": 570, "timed_out": 58},
    "shapes": {"retries": 229, "forks": 30, "forks_of_forks": 11,
               "cancelled_while_verifying": 10, "crashed": 26, "recovered": 25,
               "left_dispatched": 1, "bodies": 1161, "shared_bodies": 91},
}


def _run_states(rows: list[dict]) -> dict[str, str]:
    effect = {"run_started": "running", "branch_forked": "running",
              "verifying_entered": "verifying", "run_cancelled": "cancelled"}
    state: dict[str, str] = {}
    for r in rows:
        if r["kind"] in effect:
            state[r["run_id"]] = effect[r["kind"]]
        elif r["kind"] == "run_finished":
            state[r["run_id"]] = r["outcome"]
    return state


def test_summary_matches_the_log(recorded) -> None:
    s, _log, rows = recorded
    kinds = Counter(r["kind"] for r in rows)
    assert kinds["run_started"] == RUNS
    assert kinds["branch_forked"] == s.forks
    assert sum(r["kind"] == "branch_forked" and r["parent_branch_id"] > 0
               for r in rows) == s.forks_of_forks
    assert kinds["attempt_recovered"] == s.recovered
    assert dict(sorted(Counter(_run_states(rows).values()).items())) == s.runs_by_state
    attempts: dict[tuple, str] = {}
    for r in rows:
        if r["kind"].startswith("attempt_"):
            key = (r["run_id"], r["branch_id"], r["step_id"], r["attempt_no"])
            attempts[key] = r["state"] or "dispatched"
    assert dict(sorted(Counter(attempts.values()).items())) == s.attempts_by_outcome
    assert sum(k[3] > 1 for k in attempts) == s.retries
    assert kinds["attempt_dispatched"] - kinds["attempt_finished"] == s.crashed
    assert s.crashed == s.recovered + s.left_dispatched


def test_every_run_reaches_verifying_and_cancels_come_from_verifying(recorded) -> None:
    _s, _log, rows = recorded
    verifying = {r["run_id"] for r in rows if r["kind"] == "verifying_entered"}
    assert len(verifying) == RUNS
    last_run_event: dict[str, str] = {}
    for r in rows:
        if r["kind"] == "run_cancelled":
            assert last_run_event[r["run_id"]] == "verifying_entered"
        if r["kind"] in ("run_started", "branch_forked", "verifying_entered",
                         "run_finished", "run_cancelled"):
            last_run_event[r["run_id"]] = r["kind"]


def test_recovery_resolves_attempts_left_dispatched(recorded) -> None:
    s, _log, rows = recorded
    finished = {(r["run_id"], r["branch_id"], r["step_id"], r["attempt_no"])
                for r in rows if r["kind"] == "attempt_finished"}
    lsn_of_dispatch = {(r["run_id"], r["branch_id"], r["step_id"], r["attempt_no"]): r["lsn"]
                       for r in rows if r["kind"] == "attempt_dispatched"}
    recovered = [r for r in rows if r["kind"] == "attempt_recovered"]
    assert recovered and s.left_dispatched > 0
    for r in recovered:
        key = (r["run_id"], r["branch_id"], r["step_id"], r["attempt_no"])
        assert key not in finished and lsn_of_dispatch[key] < r["lsn"]
    # some recoveries land after their run entered verifying: a snapshot holds them open
    verifying_lsn = {r["run_id"]: r["lsn"] for r in rows if r["kind"] == "verifying_entered"}
    assert any(r["lsn"] > verifying_lsn[r["run_id"]] for r in recovered)


def test_bodies_sizes_and_sharing(recorded) -> None:
    s, log, rows = recorded
    runs_of: dict[tuple[str, str], set[str]] = defaultdict(set)
    sizes = []
    for r in rows:
        for col in ("prompt", "output"):
            ref = r[col]
            if ref is not None:
                assert ref["tenant"] == r["tenant"]
                runs_of[(ref["tenant"], ref["sha256"])].add(r["run_id"])
                sizes.append(ref["size"])
    assert len(runs_of) == s.bodies
    assert sum(len(v) > 1 for v in runs_of.values()) == s.shared_bodies
    assert s.shared_bodies >= 50
    assert min(sizes) >= synth.MIN_BODY and max(sizes) <= synth.MAX_BODY
    sizes.sort()
    assert sizes[len(sizes) // 2] < 16_000  # most are small
    assert sizes[-1] > 100_000  # and a long tail
    assert s.ref_bytes == sum(sizes) and s.body_bytes < s.ref_bytes
    some = next(r["output"] for r in rows if r["output"] is not None)
    data = log.blobs.get(ev.BlobRef(**some))
    assert hashlib.sha256(data).hexdigest() == some["sha256"]


def test_the_assembled_prompt_is_stored_not_the_template(recorded) -> None:
    _s, log, rows = recorded
    r = next(r for r in rows if r["kind"] == "attempt_dispatched" and r["step_index"] == 1)
    text = log.blobs.get(ev.BlobRef(**r["prompt"])).decode()
    for name in ("{preamble}", "{tool_docs}", "{ticket}", "{subject}", "{context}", "{step}"):
        assert name in synth.PROMPT_TEMPLATE and name not in text
    assert f"You are the '{r['step_id']}' step of the" in text
    assert f"for tenant {r['tenant']}.\nTicket T-" in text
    assert text.startswith(f"# System ({r['tenant']})")
    for doc in r["context"]["packed"]:
        assert f"### {doc}\n" in text
    for doc in r["context"]["dropped"]:
        assert f"### {doc}\n" not in text


def test_failures_vary_by_version_and_follow_dropped_context(recorded) -> None:
    s, _log, rows = recorded
    by_version: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for (wv, _step), (a, f) in s.failure_by_step.items():
        by_version[wv.split("@")[1]][0] += a
        by_version[wv.split("@")[1]][1] += f
    rate = {v: f / a for v, (a, f) in by_version.items()}
    assert rate["v1"] > rate["v2"] > rate["v3"]
    dropped_key: dict[tuple, bool] = {}
    for r in rows:
        key = (r["run_id"], r["branch_id"], r["step_id"], r["attempt_no"])
        if r["kind"] == "attempt_dispatched":
            dropped_key[key] = any(d.startswith("kb/") and d.endswith("-1")
                                   for d in r["context"]["dropped"])
    fails = {True: [0, 0], False: [0, 0]}
    for r in rows:
        if r["kind"] == "attempt_finished":
            key = (r["run_id"], r["branch_id"], r["step_id"], r["attempt_no"])
            fails[dropped_key[key]][0] += 1
            fails[dropped_key[key]][1] += r["state"] != "succeeded"
    assert fails[True][1] / fails[True][0] > 2 * fails[False][1] / fails[False][0]
    failed = [r for r in rows if r["kind"] == "attempt_finished" and r["state"] == "failed"]
    assert any(r["error"].startswith("missing context: kb/") for r in failed)


def test_usage_cost_is_exact_and_labels_are_set(recorded) -> None:
    _s, _log, rows = recorded
    usage = [r["usage"] for r in rows if r["kind"] == "attempt_finished"]
    assert all(isinstance(u["cost_usd"], Decimal) for u in usage)
    assert all(u["input_tokens"] > 0 and u["cost_usd"] > 0 for u in usage)
    assert all(r["labels"] for r in rows if r["kind"] == "run_started")
    assert any(r["tools"]["calls"] for r in rows if r["kind"] == "attempt_finished")


def test_one_commit_per_engine_transition_when_not_batched() -> None:
    root = f"memory://synth-{uuid.uuid4().hex}"
    s = synth.generate(root, runs=6, seed=1)
    rows = open_log(root).read_events().to_pylist()
    by_seq: dict[int, list[str]] = defaultdict(list)
    for r in rows:
        by_seq[r["seq"]].append(r["kind"])
    assert s.commits == len(by_seq)
    for kinds in by_seq.values():
        assert kinds.count("attempt_dispatched") + kinds.count("attempt_finished") <= 1 \
            or set(kinds) == {"attempt_recovered"}
    ts = [r["ts"] for r in rows]
    assert ts == sorted(ts)


def test_events_table_is_valid_bulk_input() -> None:
    t = synth.events_table(50_000, seed=2)
    assert t.num_rows == 50_000 and t.schema == ev.EVENT_SCHEMA
    assert t.equals(synth.events_table(50_000, seed=2))
    assert ev.validate_table(t).num_rows == 50_000
    assert t.column("prompt").null_count == 50_000
    log = open_log(f"memory://synth-{uuid.uuid4().hex}")
    with log.transaction() as tx:
        tx.extend(t)
    assert log.head == 50_000
    kinds = Counter(t.column("kind").to_pylist())
    assert kinds["attempt_finished"] > 0 and kinds["branch_forked"] > 0
    assert isinstance(t, pa.Table)
