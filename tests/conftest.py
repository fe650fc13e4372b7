"""Shared fixtures: a fresh log root on each backend, and a moto S3 server on 127.0.0.1."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import poimen_data as pdm

BUCKET = "poimen-test"
# Never let botocore's credential chain probe the cloud instance-metadata address (children
# inherit this); every S3 client in the tests gets test credentials and a loopback endpoint.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"


#: Whole files of the slow tier: other processes, notebooks, the bench, Dask clusters,
#: thousands of commits.
SLOW_FILES = frozenset({
    "test_bench.py", "test_cli_pipelines.py", "test_grade_dask.py", "test_log_open.py",
    "test_log_processes.py", "test_maint_equivalence.py", "test_notebooks.py",
    "test_txn_background.py", "test_fold_bench.py", "test_grade_speed.py",
    "test_jobs_bounded.py",
})
#: Single slow tests (property tests over many histories, big pinned workloads).
SLOW_TESTS = frozenset({
    "test_any_split_and_materialize_points_give_the_bytes_of_one_cold_refold",
    "test_snapshots_built_in_bulk_equal_cold_episodes_at_each_verifying_lsn",
    "test_same_seed_same_log_other_seed_other_log",
    "test_pinned_digest_of_the_events",
    "test_one_planted_fault_is_found_by_both_paths",
    "test_views_from_state_and_tail_equal_the_cold_fold",
    "test_values_commit_and_read_back_exactly_or_are_refused",
    "test_64_threads_and_64_tasks_commit_in_order_and_fold_like_one_by_one",
})
#: The files holding the longest tests (measured: 3.5 to 4.5 minutes each on 2 cores), run
#: first. CI gives each xdist worker whole files in the order collected (``--dist
#: loadfile``): collected near the end, as its name sorts, test_state_layout.py could be
#: left running alone at the end while the other worker idled.
LONGEST_FIRST = ("test_state_layout.py", "test_bench.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast tier is ``pytest -m "not slow"``. Marked ``slow`` here: every test that
    reaches S3 (the ``s3`` fixture or a backend parameter "s3", also marked ``s3``), every
    test of several processes (the ``proc_root`` fixture), and the files and tests above.
    The files of ``LONGEST_FIRST`` are moved to the front, in that order (the others keep
    theirs)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        names = getattr(item, "fixturenames", ())
        if "s3" in names or "s3" in params.values():
            item.add_marker(pytest.mark.s3)
            item.add_marker(pytest.mark.slow)
        elif ("proc_root" in names or item.path.name in SLOW_FILES
              or item.originalname in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)


@dataclass(frozen=True)
class S3Endpoint:
    url: str

    @property
    def storage_options(self) -> dict[str, Any]:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.url, "region_name": "eu-west-1"},
        }


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Endpoint]:
    """A real S3 endpoint: moto's threaded server bound to loopback, one per session."""
    import boto3
    from moto.server import ThreadedMotoServer

    _make_moto_conditional_put_atomic()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client(
        "s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="eu-west-1",
    ).create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    yield S3Endpoint(url)
    server.stop()


_PUT_LOCK = threading.Lock()


@dataclass
class S3Faults:
    """Faults the moto server injects into its real HTTP answers (on 127.0.0.1): a rule
    matches a method and a key suffix and either answers ``unavailable`` (503 SlowDown,
    nothing done), ``forbidden`` (403 AccessDenied, nothing done: not retried) or
    ``lost-answer`` (the request takes effect, the answer is a 500).
    ``times`` limits how often a rule fires (None: always); ``requests`` counts what the
    server saw per method while any rule was installed."""

    rules: list[dict[str, Any]]
    requests: dict[str, int]

    def add(self, method: str, suffix: str, action: str, times: int | None = None) -> None:
        assert action in ("unavailable", "forbidden", "lost-answer")
        with _FAULT_LOCK:
            self.rules.append({"method": method, "suffix": suffix, "action": action,
                               "times": times, "fired": 0})

    def fired(self) -> int:
        return sum(r["fired"] for r in self.rules)

    def clear(self) -> None:
        with _FAULT_LOCK:
            self.rules.clear()

    def decide(self, method: str, path: str) -> str | None:
        with _FAULT_LOCK:
            if not self.rules:
                return None
            self.requests[method] = self.requests.get(method, 0) + 1
            for r in self.rules:
                if r["method"] == method and path.endswith(r["suffix"]) \
                        and (r["times"] is None or r["fired"] < r["times"]):
                    r["fired"] += 1
                    return str(r["action"])
        return None


_FAULT_LOCK = threading.Lock()
_FAULTS = S3Faults([], {})
_ERROR_XML = ('<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
              "<Message>injected by the test</Message></Error>")


def _install_fault_hook() -> None:
    """Wrap moto's key handler so the server answers as ``_FAULTS`` says."""
    from urllib.parse import urlparse

    from moto.s3.responses import S3Response

    if getattr(S3Response.key_response, "_poimen_faults", False):
        return
    original = S3Response.key_response

    def key_response(self: S3Response, request: Any, full_url: str, headers: Any) -> Any:
        action = _FAULTS.decide(request.method, urlparse(full_url).path)
        if action == "unavailable":
            return 503, {"Content-Type": "application/xml"}, _ERROR_XML.format(code="SlowDown")
        if action == "forbidden":
            return 403, {"Content-Type": "application/xml"}, \
                _ERROR_XML.format(code="AccessDenied")
        resp = original(self, request, full_url, headers)
        if action == "lost-answer" and resp[0] < 300:
            return 500, {"Content-Type": "application/xml"}, \
                _ERROR_XML.format(code="InternalError")
        return resp

    key_response._poimen_faults = True  # type: ignore[attr-defined]
    S3Response.key_response = key_response  # type: ignore[method-assign]


@pytest.fixture
def s3_faults(s3: S3Endpoint) -> Iterator[S3Faults]:
    """Fault rules for the session's moto server, removed after the test."""
    _install_fault_hook()
    _FAULTS.clear()
    _FAULTS.requests.clear()
    yield _FAULTS
    _FAULTS.clear()
    _FAULTS.requests.clear()


def _make_moto_conditional_put_atomic() -> None:
    """moto checks ``If-None-Match: *`` and then stores the key in two steps, with no
    lock between them, so two racing PUTs can both succeed; real S3 makes the
    conditional PUT atomic. Serializing moto's PUT handler gives the emulator S3's
    guarantee back (four writers racing on moto once lost a commit without it)."""
    from moto.s3.responses import S3Response

    if getattr(S3Response.put_object, "_poimen_atomic", False):
        return
    original = S3Response.put_object

    def put_object(self: S3Response) -> object:
        with _PUT_LOCK:
            return original(self)

    put_object._poimen_atomic = True  # type: ignore[attr-defined]
    S3Response.put_object = put_object  # type: ignore[method-assign]


@dataclass(frozen=True)
class Root:
    """A log root URL plus the storage options to open it with."""

    url: str
    storage_options: dict[str, Any] | None
    backend: str

    def open(self, **kw: Any) -> pdm.EventLog:
        return pdm.open_log(self.url, storage_options=self.storage_options, **kw)


@pytest.fixture(params=["local", "memory", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Any) -> Root:
    """The conformance suite: every test using this runs on each backend."""
    if request.param == "local":
        return Root(str(tmp_path / "log"), None, "local")
    if request.param == "memory":
        return Root(f"memory://poimen-{uuid.uuid4().hex}", None, "memory")
    s3 = request.getfixturevalue("s3")
    return Root(f"s3://{BUCKET}/{uuid.uuid4().hex}", s3.storage_options, "s3")


@pytest.fixture(params=["local", "s3"])
def proc_root(request: pytest.FixtureRequest, tmp_path: Any) -> Root:
    """Backends that several processes can share (memory:// is per process)."""
    if request.param == "local":
        return Root(str(tmp_path / "log"), None, "local")
    s3 = request.getfixturevalue("s3")
    return Root(f"s3://{BUCKET}/{uuid.uuid4().hex}", s3.storage_options, "s3")


def snapshot_files(log: pdm.EventLog) -> dict[str, bytes]:
    """Every file under the root with its bytes (to prove storage is unchanged), once the
    background promotions of this process are done."""
    log.flush()
    st = log.storage
    return {f: st.read(f) for f in sorted(st.walk_files(""))}
