"""ATIF (Agent Trajectory Interchange Format, v1.8) out and in: the export writer that turns
each run's live trajectory into one ATIF trajectory, and ``import_atif``, which records
ATIF trajectories as runs, one attempt per agent turn.

The mapping both ways. An attempt is two ATIF steps: the steps that led to it (for an
attempt recorded by the engine, one ``user`` step holding the assembled prompt) and one
``agent`` step (its output as the message, ``tools.calls`` as tool calls, ``usage`` as
metrics). An imported agent turn keeps the conversation up to it as its prompt body
(``{"atif": "context", "steps": [...]}``) and its own step as its output body
(``{"atif": "agent_step", "step": {...}}``), so exporting it gives the original steps back.
poimen's identity (run, branch, step, attempt, state, verdicts) rides in ``extra.poimen``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, BinaryIO

import orjson
import pyarrow as pa

from poimen_data.errors import ValidationError
from poimen_data.jobs._export_formats import Bodies, body_text, cost_text, verdict_records
from poimen_data.log._log import LogLike, as_log
from poimen_data.model import _events as ev

SCHEMA_VERSION = "ATIF-v1.8"
AGENT_NAME = "poimen"
_CONTEXT = b'{"atif":"context"'
_AGENT_STEP = b'{"atif":"agent_step"'
_ROW = ("run_id", "tenant", "branch_id", "step_id", "step_index", "attempt_no", "state",
        "workflow_version", "usage", "tools", "error", "live_branch", "verdicts",
        "run_verdicts")


# --- out ---------------------------------------------------------------------------------


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _metrics(usage: dict[str, Any] | None, base: dict[str, Any] | None) -> dict[str, Any] | None:
    """ATIF metrics from ``usage``; fields usage has no place for (token ids, logprobs,
    extras of an imported step) are kept from ``base``. Cost is a float in ATIF, so the
    exact decimal also goes in ``extra.cost_usd`` as a string."""
    u = usage or {}
    out = dict(base or {})
    extra = dict(out.get("extra") or {})
    for k, v in (("prompt_tokens", u.get("input_tokens")),
                 ("completion_tokens", u.get("output_tokens")),
                 ("cached_tokens", u.get("cache_read_input_tokens"))):
        if v is not None:
            out[k] = v
    if u.get("cost_usd") is not None:
        out["cost_usd"] = float(u["cost_usd"])
        extra["cost_usd"] = cost_text(u["cost_usd"])
    for k in ("reasoning_tokens", "latency_ms"):
        if u.get(k) is not None:
            extra[k] = u[k]
    if extra:
        out["extra"] = extra
    return out or None


def _loads_tagged(body: bytes | None, tag: bytes) -> dict[str, Any] | None:
    if body is None or not body.startswith(tag):
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def _atif_steps(steps: Any) -> bool:
    """Whether ``steps`` are ATIF steps (the ``atif`` package's ``Step``, numbered here):
    what a tagged body must carry to be taken as an imported trajectory's structure. Any
    other body starting with the tag (a user's or a model's text) goes out as text."""
    import atif
    import pydantic

    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        return False
    try:
        for n, step in enumerate(steps, start=1):
            atif.Step.model_validate({**step, "step_id": n})
    except (pydantic.ValidationError, TypeError, ValueError):
        return False
    return True


def _atif_header(header: Any) -> bool:
    """Whether an imported trajectory's header (agent, ids, notes, extra, the steps after
    its last agent step) makes a valid trajectory."""
    import atif
    import pydantic

    if not isinstance(header, dict) or not _atif_steps(header.get("tail_steps") or []):
        return False
    doc = _drop_none({
        "schema_version": SCHEMA_VERSION, "session_id": header.get("session_id", "s"),
        "trajectory_id": header.get("trajectory_id"),
        "agent": header.get("agent") or {"name": AGENT_NAME, "version": "v"},
        "notes": header.get("notes"), "extra": header.get("extra"),
        "steps": [{"step_id": 1, "source": "agent", "message": ""}]})
    try:
        atif.Trajectory.model_validate(doc)
    except (pydantic.ValidationError, TypeError, ValueError):
        return False
    return True


class AtifWriter:
    """One ATIF trajectory per line (a run's live trajectory), runs in ``run_id`` order.
    A run's steps are held until its last attempt is written (one run in memory)."""

    slots = ("prompt", "output")

    def __init__(self, sink: BinaryIO, export_lsn: int) -> None:
        self.sink, self.export_lsn = sink, export_lsn
        self._run: dict[str, Any] | None = None
        self._steps: list[dict[str, Any]] = []
        self._header: dict[str, Any] | None = None

    def write(self, batch: pa.RecordBatch, bodies: Bodies) -> None:
        for i, row in enumerate(batch.select(list(_ROW)).to_pylist()):
            if self._run is not None and self._run["run_id"] != row["run_id"]:
                self._flush()
            if self._run is None:
                self._run = row
            prompt, prompt_reduced = bodies.get("prompt", i)
            output, output_reduced = bodies.get("output", i)
            self._attempt(row, prompt, prompt_reduced, output, output_reduced)

    def _attempt(self, row: dict[str, Any], prompt: bytes | None, prompt_reduced: bool,
                 output: bytes | None, output_reduced: bool) -> None:
        ctx = _loads_tagged(prompt, _CONTEXT) if not prompt_reduced else None
        if ctx is not None and (not _atif_steps(ctx.get("steps") or []) or (
                "trajectory" in ctx and not _atif_header(ctx["trajectory"]))):
            ctx = None  # the tag, but not an import's steps and header: the body's text
        if ctx is not None:
            if self._header is None and "trajectory" in ctx:
                self._header = ctx["trajectory"]
            steps = ctx.get("steps") or []
            last_agent = max((j for j, s in enumerate(steps) if s.get("source") == "agent"),
                             default=-1)
            self._steps.extend(dict(s) for s in steps[last_agent + 1:])
        elif prompt is not None:
            self._steps.append({"source": "user", "message": body_text(prompt)})
        got = _loads_tagged(output, _AGENT_STEP) if not output_reduced else None
        step: dict[str, Any] = dict(got["step"]) if got and isinstance(got.get("step"), dict) \
            and _atif_steps([{**got["step"], "source": "agent"}]) else {}
        if not step:
            step["message"] = body_text(output) if output is not None else ""
            calls = (row["tools"] or {}).get("calls") or []
            if calls:
                step["tool_calls"] = [
                    {"tool_call_id": f"{row['step_id']}.{row['attempt_no']}.{k}",
                     "function_name": name, "arguments": {}}
                    for k, name in enumerate(calls)]
        step["source"] = "agent"
        metrics = _metrics(row["usage"], step.get("metrics"))
        step.pop("metrics", None)
        if metrics:
            step["metrics"] = metrics
        extra = dict(step.get("extra") or {})
        extra["poimen"] = _drop_none({
            "branch_id": row["branch_id"], "step_id": row["step_id"],
            "step_index": row["step_index"], "attempt_no": row["attempt_no"],
            "state": row["state"], "workflow_version": row["workflow_version"],
            "error": row["error"], "prompt_reduced": prompt_reduced,
            "output_reduced": output_reduced, "output_captured": output is not None,
            # this attempt's own verdicts (the run's ride on the trajectory)
            "verdicts": verdict_records(row["verdicts"][row["run_verdicts"]:]) or None})
        step["extra"] = extra
        self._steps.append(step)

    def _flush(self) -> None:
        run, steps, header = self._run, self._steps, self._header or {}
        assert run is not None
        steps.extend(dict(s) for s in header.get("tail_steps") or ())
        for n, s in enumerate(steps, start=1):
            s["step_id"] = n
        extra = dict(header.get("extra") or {})
        extra["poimen"] = {
            "run_id": run["run_id"], "tenant": run["tenant"],
            "live_branch": run["live_branch"], "workflow_version": run["workflow_version"],
            "verdicts": verdict_records(run["verdicts"][:run["run_verdicts"]]),
            "export_lsn": self.export_lsn}
        agent = header.get("agent") or {"name": AGENT_NAME,
                                        "version": run["workflow_version"] or "unknown"}
        doc = _drop_none({
            "schema_version": SCHEMA_VERSION,
            "session_id": header.get("session_id", run["run_id"]),
            "trajectory_id": header.get("trajectory_id"),
            "agent": agent, "steps": steps, "notes": header.get("notes"),
            "final_metrics": _final_metrics(steps, run["run_id"]), "extra": extra})
        self.sink.write(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS
                                     | orjson.OPT_APPEND_NEWLINE))
        self._run, self._steps, self._header = None, [], None

    def close(self) -> None:
        if self._run is not None:
            self._flush()


#: the largest int orjson writes: a run's token sums past it are refused
UINT64_MAX = 2**64 - 1


def _final_metrics(steps: Sequence[dict[str, Any]], run_id: str) -> dict[str, Any]:
    tot: dict[str, Any] = {}
    cost = Decimal(0)
    has_cost = False
    for s in steps:
        m = s.get("metrics") or {}
        for k, name in (("prompt_tokens", "total_prompt_tokens"),
                        ("completion_tokens", "total_completion_tokens"),
                        ("cached_tokens", "total_cached_tokens")):
            if m.get(k) is not None:
                tot[name] = tot.get(name, 0) + m[k]
                if tot[name] > UINT64_MAX:  # each count fits; orjson takes no bigger sum
                    raise ValidationError(f"export atif: run {run_id!r}: its {name} add up "
                                          "past 2**64 - 1, more than its JSON can hold")
        exact = (m.get("extra") or {}).get("cost_usd")
        if exact is not None:
            cost += Decimal(exact)
            has_cost = True
    if has_cost:  # summed exactly, then one float
        tot["total_cost_usd"] = float(cost)
        tot["extra"] = {"total_cost_usd": cost_text(cost)}
    tot["total_steps"] = len(steps)
    return tot


# --- in ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportReport:
    """What ``import_atif`` recorded: ``runs`` new run ids, ``skipped`` those already in
    the log (the same trajectory imported before), ``attempts`` agent turns recorded."""

    runs: tuple[str, ...]
    skipped: tuple[str, ...]
    attempts: int
    lsn: int | None


def _read_docs(path: str, data: bytes) -> list[tuple[str, Any]]:
    """(where, document) of each trajectory in a file: one JSON document, or JSON lines."""
    try:
        return [(path, orjson.loads(data))]
    except orjson.JSONDecodeError:
        pass
    out = []
    for n, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            out.append((f"{path} line {n}", orjson.loads(line)))
        except orjson.JSONDecodeError as exc:
            raise ValidationError(f"{path} line {n}: not valid JSON ({exc})") from None
    if not out:
        raise ValidationError(f"{path}: no trajectory in the file")
    return out


def _validate(where: str, doc: Any) -> dict[str, Any]:
    """The document checked by the ``atif`` package's own models; the error names the step."""
    import atif
    import pydantic

    try:
        model = atif.Trajectory.model_validate(doc)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        loc = list(err["loc"])
        place = ""
        if len(loc) >= 2 and loc[0] == "steps" and isinstance(loc[1], int):
            steps = doc.get("steps") if isinstance(doc, dict) else None
            sid = steps[loc[1]].get("step_id") if isinstance(steps, list) and isinstance(
                steps[loc[1]], dict) else None
            place = f" step {loc[1] + 1} (step_id {sid!r})"
            loc = loc[2:]
        field = ".".join(str(x) for x in loc)
        raise ValidationError(f"{where}:{place} {field + ': ' if field else ''}"
                              f"{err['msg']}") from None
    out: dict[str, Any] = model.to_json_dict(exclude_none=True)
    if not any(s["source"] == "agent" for s in out["steps"]):
        raise ValidationError(f"{where}: no agent step, nothing to record as an attempt")
    for j, s in enumerate(out["steps"]):  # metrics poimen cannot record fail here, not later
        if s["source"] == "agent":
            at = f"{where}: step {j + 1} (step_id {s['step_id']}) metrics"
            usage = _usage(at, s.get("metrics"))
            ev.validate_event(ev.AttemptFinished("t", "r", 0, "s", 1, "succeeded",
                                                 usage=usage), at)
    return out


def _usage(where: str, m: dict[str, Any] | None) -> ev.Usage | None:
    if not m:
        return None
    extra = m.get("extra") or {}
    cost = extra.get("cost_usd", m.get("cost_usd"))
    try:
        exact = None if cost is None else Decimal(str(cost)).quantize(ev.COST_QUANTUM)
    except InvalidOperation:
        raise ValidationError(f"{where}: metrics cost_usd {cost!r} is not a number") from None
    reasoning = extra.get("reasoning_tokens")
    latency = extra.get("latency_ms")
    return ev.Usage(m.get("prompt_tokens"), m.get("completion_tokens"), m.get("cached_tokens"),
                    reasoning if isinstance(reasoning, int) else None, exact,
                    float(latency) if isinstance(latency, int | float) else None)


def _canonical(doc: Any) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)


def import_atif(log: LogLike, paths: Iterable[str | os.PathLike[str]], *,
                tenant: str = "default",
                storage_options: dict[str, Any] | None = None) -> ImportReport:
    """Record the ATIF trajectories in ``paths`` (each a JSON file of one trajectory, or
    JSON lines of several, as ``export_live(format="atif")`` writes) as runs of ``tenant``.

    Each agent step is one attempt (step ``turn-<n>``, attempt 1, ``succeeded``): its
    prompt is the conversation before it, its output the step itself, its metrics the
    attempt's ``usage``; the run then enters ``verifying``, ready to grade. The run id is
    ``atif-`` and a digest of the trajectory, so importing it again adds nothing. Every
    file is read and validated before the one commit: a bad file raises
    ``ValidationError`` naming the file and the step, and nothing is recorded.
    """
    log = as_log(log, storage_options=storage_options)
    ev.check_tenant(tenant, "import_atif")
    docs: list[tuple[str, dict[str, Any]]] = []
    for p in paths:
        path = os.fspath(p)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ValidationError(f"{path}: cannot read ({exc.strerror or exc})") from None
        docs.extend((w, _validate(w, d)) for w, d in _read_docs(path, data))
    ids = ["atif-" + hashlib.sha256(_canonical(doc)).hexdigest()[:32] for _, doc in docs]
    have = _existing_runs(log, ids)
    todo: dict[str, tuple[str, dict[str, Any]]] = {}
    skipped: list[str] = []
    for run_id, (where, doc) in zip(ids, docs, strict=True):
        if run_id in have or run_id in todo:
            skipped.append(run_id)
        else:
            todo[run_id] = (where, doc)
    if not todo:
        return ImportReport((), tuple(skipped), 0, None)
    attempts = 0
    with log.transaction() as tx:
        for run_id, (where, doc) in todo.items():
            attempts += _record(tx, tenant, run_id, where, doc)
    info = tx.commit_info
    return ImportReport(tuple(todo), tuple(skipped), attempts,
                        info.last_lsn if info is not None else None)


def _existing_runs(log: Any, run_ids: Sequence[str]) -> set[str]:
    """Which of ``run_ids`` the log has started: a scan of two columns, one segment at a
    time, keeping those runs' rows only (never the whole log in memory)."""
    import pyarrow.compute as pc

    have: set[str] = set()
    if not run_ids:
        return have
    for batch in log.scan(columns=["kind", "run_id"], run_ids=sorted(set(run_ids))):
        started = batch.filter(pc.equal(batch.column("kind"), "run_started"))
        have.update(started.column("run_id").to_pylist())
    return have


def _record(tx: Any, tenant: str, run_id: str, where: str, doc: dict[str, Any]) -> int:
    steps = doc["steps"]
    agent = doc["agent"]
    version = f"{agent['name']}@{agent['version']}"[:256]
    labels = {"source": "atif"}
    if doc.get("session_id"):
        labels["atif.session_id"] = str(doc["session_id"])
    tx.append(ev.RunStarted(tenant, run_id, version, labels))
    last_agent = max(j for j, s in enumerate(steps) if s["source"] == "agent")
    header = _drop_none({
        "session_id": doc.get("session_id"), "trajectory_id": doc.get("trajectory_id"),
        "agent": agent, "notes": doc.get("notes"), "extra": doc.get("extra"),
        "tail_steps": [_strip(s) for s in steps[last_agent + 1:]] or None})
    turn = 0
    for j, s in enumerate(steps):
        if s["source"] != "agent":
            continue
        ctx: dict[str, Any] = {"atif": "context", "steps": [_strip(x) for x in steps[:j]]}
        if turn == 0:
            ctx["trajectory"] = header
        step = _strip(s)
        step.get("extra", {}).pop("poimen", None)
        if step.get("extra") == {}:
            del step["extra"]
        p = tx.put_blob(tenant, _canonical(ctx))
        o = tx.put_blob(tenant, _canonical({"atif": "agent_step", "step": step}))
        calls = tuple(c["function_name"] for c in s.get("tool_calls") or ())
        step_id = f"turn-{turn + 1}"
        tx.append(ev.AttemptDispatched(tenant, run_id, 0, step_id, turn, 1, prompt=p,
                                       workflow_version=version))
        tx.append(ev.AttemptFinished(tenant, run_id, 0, step_id, 1, "succeeded", output=o,
                                     usage=_usage(f"{where} step {j + 1}", s.get("metrics")),
                                     tools=ev.ToolInfo(calls) if calls else None))
        turn += 1
    tx.append(ev.VerifyingEntered(tenant, run_id))
    return turn


def _strip(step: dict[str, Any]) -> dict[str, Any]:
    """A step without its ``step_id`` (renumbered on export)."""
    out = {k: v for k, v in step.items() if k != "step_id"}
    if "extra" in out:
        out["extra"] = dict(out["extra"])
    return out
