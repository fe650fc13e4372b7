"""S3 (through s3fs's client): put-if-absent is one conditional PUT (``If-None-Match: *``),
answered 412 when the key exists. Single-key operations are one request each, sent on
s3fs's client with no retry of its own (s3fs ``retries=1``, botocore one attempt): the
retry layer of ``Storage`` owns retries, so a failing S3 costs one request per round.
"""

from __future__ import annotations

import asyncio
from typing import Any

import fsspec.asyn
from botocore.exceptions import ClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from s3fs.core import S3_RETRYABLE_ERRORS

from poimen_data.errors import StorageError
from poimen_data.storage._base import Storage

# Error codes S3 answers when a retry may pass.
_TRANSIENT_CODES = frozenset({
    "InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "Throttling",
    "ThrottlingException", "RequestTimeTooSkewed", "ConditionalRequestConflict",
    "OperationAborted",
})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
# dropped connections and timeouts, as botocore, aiohttp or s3fs raise them
_RETRYABLE = (*S3_RETRYABLE_ERRORS, BotoConnectionError, TimeoutError, asyncio.TimeoutError)


def s3_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    """The caller's options with the layers below ours told not to retry (each key only
    when the caller did not set it)."""
    opts = dict(storage_options)
    # Another process's new keys must never hide behind a cached listing.
    opts.setdefault("use_listings_cache", False)
    config = dict(opts.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    config.setdefault("connect_timeout", 5)
    config.setdefault("read_timeout", 30)
    opts["config_kwargs"] = config
    return opts


def _status(exc: ClientError) -> tuple[str, int]:
    err = exc.response.get("Error", {}) or {}
    meta = exc.response.get("ResponseMetadata", {}) or {}
    return str(err.get("Code", "")), int(meta.get("HTTPStatusCode") or 0)


class S3Storage(Storage):
    kind = "s3"
    listing_consistent = True  # S3 lists are strongly consistent; s3fs's cache is off
    has_directories = False
    ambiguous_errors = True

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        # s3fs's own loop (listing, exports' uploads): one attempt; ours retries. The
        # instance is fsspec's cached one for these options, which include our botocore
        # config, so a caller's own s3fs instances keep their default.
        self.fs.retries = 1

    def transient(self, exc: BaseException) -> bool:
        """5xx, throttling and dropped connections; never a missing key, a refused
        condition, missing credentials or a bad request."""
        answer = exc if isinstance(exc, ClientError) else exc.__cause__  # s3fs translates
        if isinstance(answer, ClientError):
            code, status = _status(answer)
            return status >= 500 or status == 429 or code in _TRANSIENT_CODES
        if isinstance(exc, _RETRYABLE):
            return True
        # s3fs's translation of an answer it has no better type for
        return type(exc) is OSError

    def _call(self, op: str, path: str, **kw: Any) -> Any:
        """One request for one key; a missing key is ``FileNotFoundError``, a refused
        condition ``FileExistsError`` (typed by the answer's status, not its message)."""
        fs = self.fs
        bucket, key, _ = fs.split_path(path)

        async def call() -> Any:
            await fs.set_session()
            client = await fs.get_s3(bucket)
            try:
                resp = await getattr(client, op)(Bucket=bucket, Key=key, **fs.req_kw, **kw)
            except ClientError as exc:
                code, status = _status(exc)
                if status == 404 or code in _NOT_FOUND_CODES:
                    raise FileNotFoundError(path) from None
                if status == 412 or code == "PreconditionFailed":
                    raise FileExistsError(path) from None
                if status in (401, 403):  # refused, not failing: no retry helps
                    raise StorageError(f"s3://{bucket}/{key}: {op} refused: {code} "
                                       f"(HTTP {status}); check the credentials and the "
                                       "bucket's policy") from None
                raise
            if op != "get_object":
                return resp
            body = resp["Body"]
            try:
                return await body.read()
            finally:
                body.close()

        return fsspec.asyn.sync(fs.loop, call)

    def _read(self, path: str) -> bytes:
        return bytes(self._call("get_object", path))

    def _read_range(self, path: str, offset: int, size: int) -> bytes:
        if size == 0:
            return super()._read_range(path, offset, size)
        return bytes(self._call("get_object", path,
                                Range=f"bytes={offset}-{offset + size - 1}"))

    def exists(self, rel: str) -> bool:
        return self.size(rel) is not None

    def _size(self, path: str) -> int:
        return int(self._call("head_object", path)["ContentLength"])

    def mtime(self, rel: str) -> float | None:
        try:
            head = self._retrying(f"head {rel}",
                                  lambda: self._call("head_object", self.full(rel)))
        except FileNotFoundError:
            return None
        return float(head["LastModified"].timestamp())

    def write(self, rel: str, data: bytes, *, durable: bool | None = None) -> None:
        path = self.full(rel)
        body = bytes(data)
        self._retrying(f"write {rel}", lambda: self._call("put_object", path, Body=body))

    def put_if_absent(self, rel: str, data: bytes) -> bool:
        path = self.full(rel)
        body = bytes(data)
        try:
            self._retrying(f"create {rel}", lambda: self._call(
                "put_object", path, Body=body, IfNoneMatch="*"))
        except FileExistsError:
            return False
        return True

    def delete(self, rel: str, *, check: bool = True) -> bool:
        if check and not self.exists(rel):
            return False
        path = self.full(rel)
        self._retrying(f"delete {rel}", lambda: self._call("delete_object", path))
        return True

    def _copy(self, src: str, dst: str) -> None:
        """One server-side COPY (s3fs's copy lists and HEADs first)."""
        bucket, key, _ = self.fs.split_path(src)
        self._call("copy_object", dst, CopySource={"Bucket": bucket, "Key": key})
