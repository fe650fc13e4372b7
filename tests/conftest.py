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
