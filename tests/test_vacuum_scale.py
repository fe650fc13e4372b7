"""Vacuum over what it finds under ``blobs/``, and its memory at a recorder's log size.

Vacuum reads every manifest and lists every body file: it held both whole (each manifest
object, each path, a (tenant, sha256) key per body), about 0.7 KB a body. It now reads
the manifests one at a time and holds the listing as digests under their tenant.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import BUCKET, Root

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.log._manifest import blob_path


def _under_blobs(log: pdm.EventLog) -> list[str]:
    return sorted(f for f in log.storage.walk_files("blobs"))


def test_vacuum_sorts_what_it_finds_under_blobs(root: Root) -> None:
    """A committed body stays; a copy of a reduced one goes at once; a body no manifest
    names, a file out of its body's place (another ``aa``, a name that is no sha256)
    go once older than grace; files deeper or shallower than a body's are not a body's
    and stay."""
    log = root.open()
    with log.transaction() as tx:
        a = tx.put_blob("acme", b"the kept body")
        b = tx.put_blob("acme", b"the reduced body")
        tx.append(E.RunStarted("acme", "r1", "wf"))
        tx.append(E.AttemptDispatched("acme", "r1", 0, "s", 0, 1, prompt=a))
        tx.append(E.AttemptFinished("acme", "r1", 0, "s", 1, "succeeded", output=b))
    report = pdm.reduce(log, [b], lambda body: b"summary")
    ((_, summary),) = report.reduced
    log.flush()
    st = log.storage
    never = hashlib.sha256(b"never committed").hexdigest()
    other = hashlib.sha256(b"another tenant's").hexdigest()
    planted = {
        blob_path("acme", b.sha256): b"the reduced body",  # a stale copy: reduced last
        blob_path("acme", never): b"never committed",  # named by no manifest
        f"blobs/acme/zz/{a.sha256}": b"the kept body",  # out of its place
        "blobs/acme/ab/not-a-digest": b"junk",
        blob_path("other", other): b"another tenant's",
        "blobs/acme/ab/cd/deeper": b"not a body's place",
        "blobs/acme/loose": b"not a body's place",
    }
    for rel, data in planted.items():
        st.write(rel, data)
    kept = sorted({blob_path("acme", a.sha256), blob_path("acme", summary.sha256),
                   "blobs/acme/ab/cd/deeper", "blobs/acme/loose"})
    young = sorted(kept + [blob_path("acme", never), f"blobs/acme/zz/{a.sha256}",
                           "blobs/acme/ab/not-a-digest", blob_path("other", other)])
    assert _under_blobs(log) == sorted(young + [blob_path("acme", b.sha256)])

    first = pdm.vacuum(log, grace=3600)
    assert (first.bodies_removed, first.kept_young) == (1, 4)
    assert first.bytes_removed == len(b"the reduced body")
    assert _under_blobs(log) == young

    second = pdm.vacuum(log, grace=0)
    assert (second.bodies_removed, second.kept_young) == (4, 0)
    assert second.bytes_removed == sum(len(planted[p]) for p in young if p not in kept)
    assert _under_blobs(log) == kept
    again = root.open()
    assert again.blobs.get(a) == b"the kept body"
    assert again.blobs.get(summary) == b"summary"
    assert again.blobs.get(b) is None


def test_a_walk_asks_the_store_even_with_s3fs_listings_cache_on(s3: Any) -> None:
    """Vacuum lists, then reads the manifests: a listing served from s3fs's cache (a
    caller may turn it on) would miss a file written since and name one deleted."""
    import boto3

    from poimen_data.storage._open import open_storage

    prefix = f"walk-{uuid.uuid4().hex}"
    st = open_storage(f"s3://{BUCKET}/{prefix}",
                      {**s3.storage_options, "use_listings_cache": True})
    c = boto3.client("s3", endpoint_url=s3.url, region_name="eu-west-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing")
    c.put_object(Bucket=BUCKET, Key=f"{prefix}/state/pending/tok/a.parquet", Body=b"a")
    assert sorted(st.walk_files("state")) == ["state/pending/tok/a.parquet"]
    # another process writes a file and removes the first
    c.put_object(Bucket=BUCKET, Key=f"{prefix}/state/pending/tok/b.parquet", Body=b"b")
    c.delete_object(Bucket=BUCKET, Key=f"{prefix}/state/pending/tok/a.parquet")
    assert sorted(st.walk_files("state")) == ["state/pending/tok/b.parquet"]


BUILD = """
import sys
import poimen_data as pdm
from poimen_data import events as E
root, commits, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
log = pdm.open_log(root, durable=False)
k = 0
for c in range(commits):  # a recorder's windows: many bodies a commit
    with log.transaction() as tx:
        for i in range(per):
            k += 1
            ref = tx.put_blob("acme", b"body %d " % k + b"x" * 200)
            tx.append(E.RunStarted("acme", f"run-{k:08d}", "wf"))
            tx.append(E.AttemptDispatched("acme", f"run-{k:08d}", 0, "s", 0, 1, prompt=ref))
log.flush()
"""
PEAK = ("int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"
        " * 1024")
VACUUM = f"""
import json, sys
import poimen_data as pdm
r = pdm.vacuum(sys.argv[1], grace=0)
print(json.dumps({{"bodies_removed": r.bodies_removed, "rss": {PEAK}}}))
"""


@pytest.mark.slow
def test_vacuum_holds_about_a_tenth_of_a_kilobyte_per_body(tmp_path: Path) -> None:
    """64,000 bodies in 1,000 commits (a recorder's windows of 64): vacuum's peak RSS over
    the bare interpreter's stays under 300 bytes a body (measured: about 140, where
    holding every manifest, path and key took about 700)."""
    root = tmp_path / "log"
    commits, per = 1_000, 64
    subprocess.run([sys.executable, "-c", BUILD, str(root), str(commits), str(per)],
                   check=True, timeout=600)
    orphan = hashlib.sha256(b"orphan").hexdigest()
    (root / "blobs" / "acme" / orphan[:2]).mkdir(parents=True, exist_ok=True)
    (root / "blobs" / "acme" / orphan[:2] / orphan).write_bytes(b"orphan")
    base = subprocess.run([sys.executable, "-c", "import duckdb, pyarrow.parquet, "
                           f"poimen_data; print({PEAK})"],
                          capture_output=True, text=True, check=True)
    out = subprocess.run([sys.executable, "-c", VACUUM, str(root)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["bodies_removed"] == 1  # the orphan, and nothing committed
    bodies = commits * per
    assert sum(1 for _ in (root / "blobs").rglob("*") if _.is_file()) == bodies
    over = got["rss"] - int(base.stdout)
    print(f"vacuum: {over >> 10} KiB over the interpreter, {over / bodies:.0f} B a body")
    assert over < 300 * bodies, (over, bodies)
