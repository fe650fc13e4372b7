"""Record layouts and writers of the export formats (DESIGN section 7), kept apart from the
pipeline in ``_export`` so each format's bytes can be read in one place.

Everything that affects bytes is pinned here: JSON is orjson with sorted keys, one record
per line ending in ``\\n``; parquet has a fixed schema (cast from whatever types the fold
hands over, so state and re-fold give the same file) and fixed writer settings, with one
row group per export batch (batches are cut by a pure function of the rows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from typing import Any, BinaryIO

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from .events import COST_QUANTUM, COST_TYPE

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

Bodies = Mapping[str, Sequence[bytes | None]]
_CHUNK = 1 << 16
Flags = Mapping[str, Sequence[bool]]


def _cost(v: Any) -> str | None:
    # JSON has no exact decimal: money travels as a string with the stored 9 places.
    return None if v is None else str(Decimal(v).quantize(COST_QUANTUM))


def _usage(u: Mapping[str, Any] | None) -> dict[str, Any]:
    u = u or {}
    out = {k: u.get(k) for k in USAGE_FIELDS}
    out["cost_usd"] = _cost(out["cost_usd"])
    if out["latency_ms"] is not None:
        out["latency_ms"] = float(out["latency_ms"])
    return out


def _verdicts(vs: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    return [{"verifier": v["verifier"], "passed": v["passed"],
             "score": None if v["score"] is None else float(v["score"]),
             "snapshot_lsn": v["snapshot_lsn"]} for v in (vs or ())]


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def _text(body: bytes | None) -> str | None:
    return None if body is None else body.decode("utf-8", errors="replace")


def _write_json_text(w: Callable[[Any], Any], body: bytes | None) -> None:
    """Write a body as a JSON string: the bytes orjson writes for the whole text, made
    chunk by chunk because orjson reserves about 16x a string's size while it writes (an
    escape is one character, so chunks at character boundaries escape the same)."""
    if body is None:
        w(b"null")
        return
    text = body.decode("utf-8", errors="replace")
    w(b'"')
    for i in range(0, len(text), _CHUNK):
        w(memoryview(orjson.dumps(text[i:i + _CHUNK]))[1:-1])
    w(b'"')


def _text_array(bodies: Sequence[bytes | None]) -> pa.Array:
    """UTF-8 bodies as a string array without making Python strings (invalid bytes are
    replaced by U+FFFD, as in the JSON formats)."""
    try:
        return pa.array(bodies, pa.binary()).cast(pa.string())
    except pa.ArrowInvalid:
        return pa.array([_text(b) for b in bodies], pa.string())


class JsonlWriter:
    """Chat records: the prompt is the user turn, the output the assistant turn."""

    slots = ("prompt", "output")

    def __init__(self, sink: BinaryIO, export_lsn: int) -> None:
        self.sink, self.export_lsn = sink, export_lsn

    def write(self, batch: pa.RecordBatch, bodies: Bodies, reduced: Flags) -> None:
        for i, row in enumerate(batch.select(list(_ATTEMPT_META) + ["usage", "verdicts"])
                                .to_pylist()):
            meta = {k: row[k] for k in _ATTEMPT_META}
            meta["usage"] = _usage(row["usage"])
            meta["verdicts"] = _verdicts(row["verdicts"])
            meta["prompt_reduced"] = reduced["prompt"][i]
            meta["output_reduced"] = reduced["output"][i]
            meta["export_lsn"] = self.export_lsn
            w = self.sink.write
            w(b'{"messages":[{"content":')
            _write_json_text(w, bodies["prompt"][i])
            w(b',"role":"user"},{"content":')
            _write_json_text(w, bodies["output"][i])
            w(b',"role":"assistant"}],"metadata":')
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

    def write(self, batch: pa.RecordBatch, bodies: Bodies, reduced: Flags) -> None:
        for i, row in enumerate(batch.select(list(_PAIR_META) + ["verdicts"]).to_pylist()):
            meta = {k: row[k] for k in _PAIR_META}
            meta["verdicts"] = _verdicts(row["verdicts"])
            for s in self.slots:
                meta[f"{s}_reduced"] = reduced[s][i]
            meta["export_lsn"] = self.export_lsn
            w = self.sink.write
            w(b'{"chosen":')
            _write_json_text(w, bodies["chosen"][i])
            w(b',"metadata":')
            w(_dumps(meta))
            w(b',"prompt":')
            _write_json_text(w, bodies["prompt"][i])
            w(b',"rejected":')
            _write_json_text(w, bodies["rejected"][i])
            w(b"}\n")

    def close(self) -> None:
        pass


class ParquetWriter:
    """One flat row per attempt; each export batch is one row group."""

    slots = ("prompt", "output")

    def __init__(self, sink: BinaryIO, export_lsn: int) -> None:
        self.export_lsn = export_lsn
        self._w = pq.ParquetWriter(sink, PARQUET_SCHEMA, **PARQUET_OPTIONS)

    def write(self, batch: pa.RecordBatch, bodies: Bodies, reduced: Flags) -> None:
        n = batch.num_rows
        usage = batch.column("usage")
        if not isinstance(usage, pa.StructArray):
            usage = pa.array(usage.to_pylist(), batch.schema.field("usage").type)
        parts = dict(zip([f.name for f in usage.type], usage.flatten(), strict=True))
        cols: dict[str, pa.Array] = {k: batch.column(k) for k in _ATTEMPT_META}
        cols["prompt"] = _text_array(bodies["prompt"])
        cols["output"] = _text_array(bodies["output"])
        cols["prompt_reduced"] = pa.array(reduced["prompt"], pa.bool_())
        cols["output_reduced"] = pa.array(reduced["output"], pa.bool_())
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
