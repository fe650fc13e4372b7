"""Record layouts and writers of the export formats (docs/DESIGN.md, "Export"), kept apart from the
pipeline in ``_export`` so each format's bytes can be read in one place.

Everything that affects bytes is pinned here: JSON is orjson with sorted keys, one record
per line ending in ``\\n``; parquet has a fixed schema (cast from whatever types the fold
hands over, so state and re-fold give the same file) and fixed writer settings, with one
row group per export batch (batches are cut by a pure function of the rows).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from decimal import Decimal
from typing import Any, BinaryIO

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from poimen_data.errors import ValidationError
from poimen_data.model._events import COST_QUANTUM, COST_TYPE
from poimen_data.storage import AtomicWriter, open_storage

USAGE_FIELDS = ("input_tokens", "output_tokens", "cache_read_input_tokens",
                "reasoning_tokens", "cost_usd", "latency_ms")
VERDICT_TYPE = pa.struct([("verifier", pa.string()), ("passed", pa.bool_()),
                          ("score", pa.float64()), ("snapshot_lsn", pa.int64())])

#: One flat row per attempt; usage is one column per field, money stays DECIMAL.
PARQUET_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("tenant", pa.string()), ("branch_id", pa.int64()),
    ("step_id", pa.string()), ("step_index", pa.int64()), ("attempt_no", pa.int64()),
    ("state", pa.string()), ("workflow_version", pa.string()),
    ("prompt", pa.string()), ("output", pa.string()),
    ("prompt_reduced", pa.bool_()), ("output_reduced", pa.bool_()),
    ("input_tokens", pa.int64()), ("output_tokens", pa.int64()),
    ("cache_read_input_tokens", pa.int64()), ("reasoning_tokens", pa.int64()),
    ("cost_usd", COST_TYPE), ("latency_ms", pa.float64()),
    ("verdicts", pa.list_(VERDICT_TYPE)), ("export_lsn", pa.int64()),
])

#: Writer settings pinned so the same rows always give the same bytes (``created_by``
#: names the pyarrow version, so compare files written by the same environment).
PARQUET_OPTIONS: dict[str, Any] = {
    "version": "2.6",
    "compression": "zstd",
    "compression_level": 1,
    # bodies are large and mostly unique: dictionary-encoding or min/max over them costs
    # time for nothing, so only the metadata columns get either
    "use_dictionary": ["run_id", "tenant", "step_id", "state", "workflow_version"],
    "write_statistics": [f.name for f in PARQUET_SCHEMA if f.name not in ("prompt", "output")],
    "data_page_version": "1.0",
    "store_schema": True,
    "write_page_index": False,
    "write_page_checksum": False,
    "use_content_defined_chunking": False,
    "use_compliant_nested_type": True,
}

_ATTEMPT_META = ("run_id", "tenant", "branch_id", "step_id", "step_index", "attempt_no",
                 "state", "workflow_version")
_PAIR_META = ("run_id", "tenant", "step_id", "step_index", "chosen_branch_id",
              "chosen_attempt_no", "chosen_workflow_version", "rejected_branch_id",
              "rejected_attempt_no", "rejected_state", "rejected_workflow_version")

#: Records whose bodies total at most this are encoded by one orjson call; larger
#: texts are escaped in chunks of ``_CHUNK`` characters (memory stays bounded).
_ONE_CALL = 1 << 18
_CHUNK = 1 << 16


class Bodies:
    """The bodies of one batch by slot and row, resolved as the fetch pool delivers its
    groups, so a writer can emit row i while a later group is still being read."""

    def __init__(self, cells: Mapping[str, Sequence[tuple[Future[list[tuple[bytes, bool]]],
                                                         int] | None]],
                 reduced: Mapping[str, Sequence[bool]]) -> None:
        self._cells, self._reduced = cells, reduced
        self._got: dict[Future[list[tuple[bytes, bool]]], list[tuple[bytes, bool]]] = {}

    def get(self, slot: str, i: int) -> tuple[bytes | None, bool]:
        """(body or None, exported as a summary?) of row ``i``; waits for the fetch."""
        cell = self._cells[slot][i]
        if cell is None:
            return None, bool(self._reduced[slot][i])
        got = self._got.get(cell[0])  # a dict lookup, not a lock per cell
        if got is None:
            got = self._got[cell[0]] = cell[0].result()
        data, late = got[cell[1]]
        return data, bool(self._reduced[slot][i]) or late

    def column(self, slot: str) -> tuple[list[bytes | None], list[bool]]:
        got = [self.get(slot, i) for i in range(len(self._cells[slot]))]
        return [g[0] for g in got], [g[1] for g in got]

    def reduced_count(self) -> int:
        return sum(self.get(s, i)[1] for s in self._cells for i in range(len(self._cells[s])))


def cost_text(v: Any) -> str | None:
    # JSON has no exact decimal: money travels as a string with the stored 9 places.
    # format "f": never the exponent form str() takes under 1e-6 ("0E-9" for zero)
    return None if v is None else format(Decimal(v).quantize(COST_QUANTUM), "f")


def _usage(u: Mapping[str, Any] | None) -> dict[str, Any]:
    u = u or {}
    out = {k: u.get(k) for k in USAGE_FIELDS}
    out["cost_usd"] = cost_text(out["cost_usd"])
    if out["latency_ms"] is not None:
        out["latency_ms"] = float(out["latency_ms"])
    return out


def verdict_records(vs: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    return [{"verifier": v["verifier"], "passed": v["passed"],
             "score": None if v["score"] is None else float(v["score"]),
             "snapshot_lsn": v["snapshot_lsn"]} for v in (vs or ())]


_LINE = orjson.OPT_SORT_KEYS | orjson.OPT_APPEND_NEWLINE


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def body_text(body: bytes | None) -> str | None:
    return None if body is None else body.decode("utf-8", errors="replace")


def _small(*bodies: bytes | None) -> bool:
    """Whether a record's bodies are small enough to encode in one orjson call (which
    reserves about 8x a string's UTF-8 size while it writes)."""
    return sum(0 if b is None else len(b) for b in bodies) <= _ONE_CALL


def _write_json_text(w: Callable[[Any], Any], text: str | None) -> None:
    """Write a large text as a JSON string, the bytes ``orjson.dumps(text)`` gives, in
    chunks: JSON escapes characters one by one, so escaped chunks join into the escaped
    whole, and orjson's transient reservation is bounded by the chunk, not the text."""
    if text is None:
        w(b"null")
        return
    w(b'"')
    for i in range(0, len(text), _CHUNK):
        w(orjson.dumps(text[i:i + _CHUNK])[1:-1])  # a compact copy, not the reservation
    w(b'"')


def _text_array(bodies: Sequence[bytes | None]) -> pa.Array:
    """UTF-8 bodies as one string array, built from a single joined buffer and checked by
    Arrow (invalid bytes are replaced by U+FFFD, as in the JSON formats)."""
    lengths = [0 if b is None else len(b) for b in bodies]
    offsets = pa.array([0, *itertools.accumulate(lengths)], pa.int64())
    valid = pa.array([b is not None for b in bodies], pa.bool_())
    data = pa.py_buffer(b"".join(b for b in bodies if b is not None))
    arr = pa.LargeStringArray.from_buffers(len(bodies), offsets.buffers()[1], data,
                                           valid.buffers()[1])
    try:
        arr.validate(full=True)
    except pa.ArrowInvalid:
        return pa.array([body_text(b) for b in bodies], pa.string())
    return arr.cast(pa.string())


class JsonlWriter:
    """Chat records: the prompt is the user turn, the output the assistant turn. The rows
    never lack a prompt, and lack an output only when the caller kept unanswered attempts:
    those get no assistant turn (never a null one)."""

    slots = ("prompt", "output")

    def __init__(self, sink: BinaryIO, export_lsn: int) -> None:
        self.sink, self.export_lsn = sink, export_lsn

    def write(self, batch: pa.RecordBatch, bodies: Bodies) -> None:
        w = self.sink.write
        for i, row in enumerate(batch.select(list(_ATTEMPT_META) + ["usage", "verdicts"])
                                .to_pylist()):
            prompt, prompt_reduced = bodies.get("prompt", i)
            output, output_reduced = bodies.get("output", i)
            meta = {k: row[k] for k in _ATTEMPT_META}
            meta["usage"] = _usage(row["usage"])
            meta["verdicts"] = verdict_records(row["verdicts"])
            meta["prompt_reduced"] = prompt_reduced
            meta["output_reduced"] = output_reduced
            meta["export_lsn"] = self.export_lsn
            if _small(prompt, output):  # the common case: one call, one write
                messages = [{"content": body_text(prompt), "role": "user"}]
                if output is not None:
                    messages.append({"content": body_text(output), "role": "assistant"})
                w(orjson.dumps({"messages": messages, "metadata": meta}, option=_LINE))
                continue
            w(b'{"messages":[{"content":')
            _write_json_text(w, body_text(prompt))
            del prompt
            if output is not None:
                w(b',"role":"user"},{"content":')
                _write_json_text(w, body_text(output))
                del output
                w(b',"role":"assistant"}],"metadata":')
            else:
                w(b',"role":"user"}],"metadata":')
            w(_dumps(meta))
            w(b"}\n")

    def close(self) -> None:
        pass


class PairsWriter:
    """Preference pairs as ``{"prompt", "chosen", "rejected", "metadata"}`` lines (the
    standard string form DPO trainers read)."""

    slots = ("prompt", "chosen", "rejected")

    def __init__(self, sink: BinaryIO, export_lsn: int) -> None:
        self.sink, self.export_lsn = sink, export_lsn

    def write(self, batch: pa.RecordBatch, bodies: Bodies) -> None:
        w = self.sink.write
        for i, row in enumerate(batch.select(list(_PAIR_META) + ["verdicts"]).to_pylist()):
            got = {s: bodies.get(s, i) for s in self.slots}
            meta = {k: row[k] for k in _PAIR_META}
            meta["verdicts"] = verdict_records(row["verdicts"])
            for s in self.slots:
                meta[f"{s}_reduced"] = got[s][1]
            meta["export_lsn"] = self.export_lsn
            if _small(*(g[0] for g in got.values())):
                w(orjson.dumps({"chosen": body_text(got["chosen"][0]), "metadata": meta,
                                "prompt": body_text(got["prompt"][0]),
                                "rejected": body_text(got["rejected"][0])}, option=_LINE))
                continue
            w(b'{"chosen":')
            _write_json_text(w, body_text(got["chosen"][0]))
            w(b',"metadata":')
            w(_dumps(meta))
            w(b',"prompt":')
            _write_json_text(w, body_text(got["prompt"][0]))
            w(b',"rejected":')
            _write_json_text(w, body_text(got["rejected"][0]))
            w(b"}\n")

    def close(self) -> None:
        pass


class ParquetWriter:
    """One flat row per attempt; each export batch is one row group."""

    slots = ("prompt", "output")

    def __init__(self, sink: BinaryIO, export_lsn: int) -> None:
        self.export_lsn = export_lsn
        self._w = pq.ParquetWriter(sink, PARQUET_SCHEMA, **PARQUET_OPTIONS)

    def write(self, batch: pa.RecordBatch, bodies: Bodies) -> None:
        n = batch.num_rows
        prompt, prompt_reduced = bodies.column("prompt")
        output, output_reduced = bodies.column("output")
        usage = batch.column("usage")
        if not isinstance(usage, pa.StructArray):
            usage = pa.array(usage.to_pylist(), batch.schema.field("usage").type)
        parts = dict(zip([f.name for f in usage.type], usage.flatten(), strict=True))
        cols: dict[str, pa.Array] = {k: batch.column(k) for k in _ATTEMPT_META}
        cols["prompt"] = _text_array(prompt)
        cols["output"] = _text_array(output)
        cols["prompt_reduced"] = pa.array(prompt_reduced, pa.bool_())
        cols["output_reduced"] = pa.array(output_reduced, pa.bool_())
        del prompt, output
        for k in USAGE_FIELDS:
            cols[k] = parts[k] if k in parts else pa.nulls(n)
        cols["verdicts"] = batch.column("verdicts")
        cols["export_lsn"] = pa.array([self.export_lsn] * n, pa.int64())
        arrays = [_cast(cols[f.name], f.type) for f in PARQUET_SCHEMA]
        table = pa.Table.from_arrays(arrays, schema=PARQUET_SCHEMA)
        self._w.write_table(table, row_group_size=max(n, 1))

    def close(self) -> None:
        self._w.close()


def _cast(a: pa.Array, t: pa.DataType) -> pa.Array:
    return a if a.type == t else a.cast(t)


WRITERS: dict[str, Callable[[BinaryIO, int], Any]] = {
    "jsonl": JsonlWriter,
    "parquet": ParquetWriter,
    "pairs": PairsWriter,
}
SLOTS: dict[str, tuple[str, ...]] = {k: w.slots for k, w in (
    ("jsonl", JsonlWriter), ("parquet", ParquetWriter), ("pairs", PairsWriter))}


# --- where the bytes go ------------------------------------------------------------------

def dest_parts(dest: str) -> tuple[str, str, str]:
    """(protocol, folder, name) of a destination: ``""`` and an absolute folder for a
    local path, else the URL's protocol and the path after it, split at its last ``/``."""
    if "://" in dest:
        proto, _, path = dest.partition("://")
        parent, _, name = path.rstrip("/").rpartition("/")
        return proto, parent, name
    folder, name = os.path.split(os.path.abspath(dest))
    return "", folder, name


def Sink(dest: str, storage_options: dict[str, Any] | None) -> AtomicWriter:  # noqa: N802
    """The writer of an export: a file at a temporary name next to ``dest`` (any fsspec
    URL), moved onto ``dest`` only when the ``with`` block exits cleanly, so a failed
    export leaves nothing there. It is the storage layer's streamed hashing writer,
    opened on the destination's folder (the only fsspec user is ``storage``). A chained
    URL (``simplecache::file://...``) is refused: the file system under the chain is not
    the one checked, so a local symlink, FIFO or directory there would be replaced."""
    if "::" in dest.partition("://")[0] and "://" in dest:  # fsspec's chain, not a name
        raise ValidationError(f"export: {dest!r} is a chained URL; name the destination "
                              "itself (a path, file://, s3://, ...)")
    proto, parent, name = dest_parts(dest)
    folder = parent if proto == "" else f"{proto}://{parent}"
    if not name:
        raise ValidationError(f"export: {dest!r} names no file")
    return open_storage(folder, storage_options).open_atomic(name)
