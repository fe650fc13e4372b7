"""The ``poimen`` command: a thin, friendly layer over the library (docs/DESIGN.md, "Command line").

Every command opens the root from ``--root``, else ``$POIMEN_ROOT``, else
``./poimen-data`` (any fsspec URL), prints tables (``--json`` for scripts), and turns bad
input into one line on stderr with a non-zero exit: 1 error, 2 usage.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any, NoReturn, cast

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

import poimen_data as pdm
from poimen_data.errors import one_line, raised_in_scan
from poimen_data.jobs import chain as st
from poimen_data.jobs.chain import titled

app = typer.Typer(
    name="poimen", no_args_is_help=True, add_completion=False, rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    help="Query, grade and export the runs of the poimen agent-workflow engine.\n\n"
         "Start with [bold]poimen demo[/], then [bold]poimen sql[/]. The log root comes "
         "from --root, else $POIMEN_ROOT, else ./poimen-data (a path or any fsspec URL). "
         "Exit status: 0 ok, 1 error, 2 usage.")
out = Console(soft_wrap=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)

Root = Annotated[str, typer.Option("--root", envvar="POIMEN_ROOT", show_envvar=True,
                                   help="Log root: a path or fsspec URL.")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
AtLsn = Annotated[int | None, typer.Option("--at-lsn", help="Read the log as of this LSN.")]
DEFAULT_ROOT = "./poimen-data"


class CliError(Exception):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def fail(message: str, code: int = 1) -> NoReturn:
    raise CliError(message, code)


def _check_memory(value: str | None) -> None:
    """``--memory-limit`` checked before the root is opened, its error naming the option
    (the library's names the ``memory_limit`` argument)."""
    if value is not None:
        from poimen_data.fold._fold import memory_bytes

        memory_bytes(value, "--memory-limit")


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Catch what bad input raises and print it as one line, never a traceback."""
    import duckdb

    from poimen_data.errors import PoimenError

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CliError as exc:
            err.print(f"error: {exc}", markup=False)
            raise typer.Exit(exc.code) from None
        except PoimenError as exc:
            err.print(f"error: {one_line(exc)}", markup=False)
            raise typer.Exit(1) from None
        except duckdb.Error as exc:
            err.print(_sql_error(exc), markup=False)
            raise typer.Exit(1) from None
        except (OSError, ValueError, ArithmeticError) as exc:  # Overflow: a value written
            # before the limits were checked (a year-0 timestamp) that Python cannot hold
            err.print(f"error: {type(exc).__name__}: {one_line(exc)}", markup=False)
            raise typer.Exit(1) from None
        except Exception as exc:
            if not _is_storage_error(exc):
                raise
            err.print(f"error: storage: {type(exc).__name__}: {one_line(exc)}", markup=False)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None
    return wrapper


def _sql_error(exc: BaseException) -> str:
    """The line a DuckDB error prints: the error of ours a scan raised inside it (a damaged
    segment DuckDB was reading), else DuckDB's own, as SQL's."""
    ours = raised_in_scan(exc)
    return f"error: {one_line(ours)}" if ours is not None else f"error: SQL: {one_line(exc)}"


def _is_storage_error(exc: BaseException) -> bool:
    """An error of the S3 client stack (no credentials, a bad bucket name, access denied):
    the user's environment, told in one line. Judged by module, so botocore need not be
    imported (nor installed) to run the CLI."""
    return any(c.__module__.split(".")[0] in ("botocore", "aiobotocore", "s3fs", "boto3")
               for c in type(exc).__mro__)


def check_url(url: str, what: str) -> str:
    """A root or destination that names a place: ``s3://`` alone names no bucket."""
    import fsspec.core

    protocol, path = fsspec.core.split_protocol(url)
    if not url.strip() or (protocol and not path.strip("/")):
        fail(f"{what} {url!r} names no path (e.g. {protocol or 's3'}://bucket/prefix)")
    return url


def command(name: str, example: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a guarded command whose --help ends with a runnable example."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        app.command(name, epilog=f"[bold]Example:[/]  {example}")(_guarded(fn))
        return fn
    return deco


def open_root(root: str, *, read_only: bool = False) -> Any:
    """Open an existing log; a missing one is an error that says how to make one."""
    check_url(root, "--root")
    try:
        return pdm.open_log(root, create=False, read_only=read_only)
    except pdm.NotFound:
        fail(f"no poimen log at {root} (make one with `poimen demo --root {root}`, or "
             "pass --root / set POIMEN_ROOT)")


def emit_json(value: Any) -> None:
    print(json.dumps(st.jsonable(value), indent=2, ensure_ascii=False, allow_nan=False))


def kv_table(title: str, value: Any) -> Table:
    """A report dataclass as a two-column table (nested tuples summarized)."""
    t = titled(title, show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value", overflow="fold")
    for k, v in st.jsonable(value).items():
        if isinstance(v, list) and v and isinstance(v[0], dict):
            v = f"{len(v)} items"
        t.add_row(Text(k), Text(str(v)))  # a lease's owner, a path: never rich markup
    return t


def cell(v: Any) -> str:
    """One value as table text: refs short, structs compact, None empty."""
    if v is None:
        return ""
    if isinstance(v, dict) and set(v) == {"tenant", "sha256", "size"}:
        return f"{v['sha256'][:10]}… {v['size']:,} B"
    if isinstance(v, dict):
        return ", ".join(f"{k}={cell(x)}" for k, x in v.items() if x not in (None, [], ()))
    if isinstance(v, list | tuple):
        return "[" + ", ".join(cell(x) for x in v) + "]"
    return str(v)


# --- demo --------------------------------------------------------------------------


@command("demo", "poimen demo --runs 300 --seed 0 --root ./poimen-data")
def demo(runs: Annotated[int, typer.Option(min=1, help="How many runs to record.")] = 300,
         seed: Annotated[int, typer.Option(help="Seed of the workload.")] = 0,
         batch: Annotated[int, typer.Option(min=1, help="Engine transitions per commit "
                                                    "(1 = one commit each).")] = 16,
         root: Root = DEFAULT_ROOT, as_json: Json = False) -> None:
    """Record a realistic synthetic workload, then run the nightly chain on it (compact,
    grade, materialize, check, export) and print what it did and where to look. Replaces
    the root if it holds a log."""
    from poimen_data.workload import demo as demo_mod

    try:
        facts = demo_mod.run(root, runs=runs, seed=seed, batch=batch, console=out,
                             quiet=as_json)
    except demo_mod.DemoRootError as exc:
        fail(str(exc))
    if as_json:
        emit_json(facts)
    if any(s["status"] == "failed" for s in facts["stages"]):
        raise typer.Exit(1)


# --- sql -------------------------------------------------------------------------------


def _refused(query: str) -> str | None:
    """Why a locked-down ``poimen sql`` refuses ``query`` (None: DuckDB may run it)."""
    from poimen_data.fold._connect import outside_statement

    kind = outside_statement(query)
    return None if kind is None else (
        f"{kind} statements reach outside the log; rerun with --allow-external")


def _print_query(con: Any, query: str, as_json: bool, max_rows: int) -> None:
    rel = con.sql(query)
    if rel is None:
        out.print("ok")
        return
    reader = rel.to_arrow_reader(1024)
    if as_json:
        _stream_json(reader)
        return
    rows: list[dict[str, Any]] = []
    n = 0
    for batch in reader:
        n += batch.num_rows
        if len(rows) < max_rows:
            rows.extend(batch.to_pylist())
    t = Table(show_lines=False)
    for c in rel.columns:  # Text: a value is shown as it is, never read as rich markup
        t.add_column(Text(c), overflow="fold")
    for r in rows[:max_rows]:
        t.add_row(*(Text(cell(r[c])) for c in rel.columns))
    out.print(t)
    more = f"; showing {max_rows} (--max-rows)" if n > max_rows else ""
    out.print(f"({n} row{'s' if n != 1 else ''}{more})", highlight=False)


def _stream_json(reader: Any) -> None:
    """The rows as one JSON array, the bytes ``emit_json`` of the whole list would print,
    written a row at a time as DuckDB hands them over: memory holds a batch, whatever
    the result's size (the whole list and its text were held: about 9 KB a row of
    ``events``). An error past the first batch cuts the array short (exit status 1)."""
    opened = False
    for batch in reader:
        for row in batch.to_pylist():
            text = json.dumps(st.jsonable(row), indent=2, ensure_ascii=False,
                              allow_nan=False)
            sys.stdout.write(("[\n  " if not opened else ",\n  ")
                             + text.replace("\n", "\n  "))  # the list's own indent
            opened = True
    sys.stdout.write("\n]\n" if opened else "[]\n")
    sys.stdout.flush()


def _view_sql(name: str) -> str:
    from poimen_data.fold._fold import VIEW_SQL, view_sql

    if name not in VIEW_SQL:
        fail(f"no view {name!r}; views are {', '.join(sorted(VIEW_SQL))}")
    return view_sql(name)


def _repl(con: Any, max_rows: int, *, locked: bool) -> None:
    """Read queries until EOF: a prompt with history on a terminal, lines from a pipe."""
    import duckdb

    if sys.stdin.isatty():
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory

        hist = os.environ.get("POIMEN_SQL_HISTORY",
                              os.path.expanduser("~/.poimen_sql_history"))
        session: Any = PromptSession(history=FileHistory(hist))
        out.print("SQL over events, runs, branches, attempts, trajectories, verdicts, "
                  "reductions, anomalies. End with Ctrl-D.")

        def read() -> str:
            return str(session.prompt("poimen> "))
    else:
        def read() -> str:
            line = sys.stdin.readline()
            if not line:
                raise EOFError
            return line
    while True:
        try:
            q = read().strip().rstrip(";").strip()
        except (EOFError, KeyboardInterrupt):
            return
        if not q:
            continue
        if q in ("\\q", "exit", "quit"):
            return
        why = _refused(q) if locked else None
        if why is not None:
            err.print(f"error: SQL: {why}", markup=False)
            continue
        try:
            _print_query(con, q, False, max_rows)
        except duckdb.Error as exc:
            err.print(_sql_error(exc), markup=False)


@command("sql", "poimen sql \"select state, count(*) from runs group by state\"")
def sql(query: Annotated[str | None, typer.Argument(help="SQL; omit for a prompt.")] = None,
        explain: Annotated[str | None, typer.Option(
            "--explain", metavar="VIEW", help="Print the SQL that defines a view.")] = None,
        max_rows: Annotated[int, typer.Option(min=1, help="Rows to print.")] = 40,
        allow_external: Annotated[bool, typer.Option(
            "--allow-external", "--unsafe",
            help="Let SQL read and write any file or URL (read_csv, COPY ... TO, ATTACH, "
                 "INSTALL/LOAD); off by default.")] = False,
        source: Annotated[str, typer.Option(
            help="auto (state + a fold of later commits) | state | log (fold it all)")]
        = "auto",
        memory_limit: Annotated[str | None, typer.Option(
            help="DuckDB memory cap, e.g. 2GB (default $POIMEN_MEMORY_LIMIT, else a "
                 "quarter of the machine).")] = None,
        at_lsn: AtLsn = None, root: Root = DEFAULT_ROOT, as_json: Json = False) -> None:
    """Run SQL over the views (events, runs, branches, attempts, trajectories, verdicts,
    reductions, anomalies); blob_text(ref) reads a body. No QUERY opens a prompt.
    Read-only towards the outside unless --allow-external."""
    if explain is not None:
        out.print(_view_sql(explain), highlight=False, markup=False)
        return
    _check_memory(memory_limit)
    log = open_root(root, read_only=True)
    con = pdm.connect(log, at_lsn=at_lsn, source=source,  # type: ignore[arg-type]
                      memory_limit=memory_limit)
    if not allow_external:
        from poimen_data.fold._connect import lock_down

        lock_down(con)
    if query is None:
        _repl(con, max_rows, locked=not allow_external)
        return
    why = None if allow_external else _refused(query)
    if why is not None:
        fail(f"SQL: {why}")
    _print_query(con, query, as_json, max_rows)


# --- show ------------------------------------------------------------------------------

STATE_STYLE = {"succeeded": "green", "failed": "red", "timed_out": "red",
               "cancelled": "magenta", "dispatched": "yellow", "verifying": "cyan",
               "running": "yellow"}


def _styled(state: str | None) -> str:
    return f"[{STATE_STYLE.get(state or '', 'white')}]{escape(str(state))}[/]"


@command("show", "poimen show run-000007 --all-branches")
def show(run: Annotated[str, typer.Argument(help="The run_id.")],
         all_branches: Annotated[bool, typer.Option(
             "--all-branches", help="Every branch, not only the live one.")] = False,
         at_lsn: AtLsn = None, root: Root = DEFAULT_ROOT, as_json: Json = False) -> None:
    """One episode: its branches and attempts with states, refs, usage and errors
    (bodies are never read; use `poimen sql` with blob_text for those)."""
    from poimen_data.fold._query import EPISODE_TABLES, one_episode, resolve_lsn, run_tables
    from poimen_data.model._events import check_run_id

    check_run_id(run, "show")
    log = open_root(root, read_only=True)
    lsn = resolve_lsn(log, at_lsn)
    # the run's own rows, read as episode() reads them (run and attempt verdicts too)
    tables = run_tables(log, run, at_lsn=lsn, names=(*EPISODE_TABLES, "verdicts"))
    view = one_episode(tables, run, at_lsn=lsn, all_branches=all_branches)
    fields = ("verifier", "snapshot_lsn", "branch_id", "step_id", "attempt_no", "passed",
              "score", "detail", "lsn")
    verdicts = tables["verdicts"].sort_by("lsn").select(list(fields)).to_pylist()
    if as_json:
        emit_json({**st.jsonable(view), "verdicts": verdicts})
        return
    out.print(f"[bold]{escape(view.run_id)}[/] tenant {escape(view.tenant)}, "
              f"{escape(view.workflow_version or '')}, "
              f"state {_styled(view.state)}, live branch {view.live_branch}, "
              f"read at LSN {view.at_lsn}")
    for b in view.branches:
        fork = "" if b.parent_branch_id is None else \
            f", forked from {b.parent_branch_id} at step {b.fork_step_index}"
        t = titled(f"branch {b.branch_id}{' (live)' if b.is_live else ''}{fork}",
                  title_justify="left")
        for c in ("#", "step", "try", "state", "lsn", "prompt", "output", "tokens in/out",
                  "cost $", "dropped", "error"):
            t.add_column(c, overflow="fold")
        for a in b.attempts:
            u = a.usage
            d = st.jsonable(a)
            t.add_row(str(a.step_index), Text(a.step), str(a.attempt), _styled(a.state),
                      f"{a.first_lsn}-{a.last_lsn}", cell(d["prompt"]), cell(d["output"]),
                      f"{u.input_tokens}/{u.output_tokens}" if u else "",
                      str(u.cost_usd) if u and u.cost_usd is not None else "",
                      Text(", ".join(a.context.dropped) if a.context else ""),
                      Text(a.error or ""))
        out.print(t)
    if verdicts:
        t = titled("verdicts", title_justify="left")
        for c in ("verifier", "snapshot", "judged", "passed", "score", "detail"):
            t.add_column(c, overflow="fold")
        for v in verdicts:
            branch, step = v["branch_id"], v["step_id"]
            judged = f"run (branch {branch})" if step is None else \
                f"{branch}/{step}#{v['attempt_no']}"
            t.add_row(escape(v["verifier"]), str(v["snapshot_lsn"]), escape(judged),
                      f"[{STATE_STYLE['succeeded' if v['passed'] else 'failed']}]"
                      f"{'yes' if v['passed'] else 'no'}[/]",
                      "" if v["score"] is None else f"{v['score']:g}",
                      escape(v["detail"] or ""))
        out.print(t)


# --- batch commands --------------------------------------------------------------------


@command("materialize", "poimen materialize --root ./poimen-data")
def materialize(full: Annotated[bool, typer.Option(
                    "--full", help="Rebuild every file (e.g. after a damaged state file).")]
                = False,
                memory_limit: Annotated[str | None, typer.Option(
                    "--memory-limit", help="What the fold may hold, e.g. 2GB (default: a "
                    "quarter of the machine, at most 1.5GiB; DuckDB spills the rest).")] = None,
                root: Root = DEFAULT_ROOT, as_json: Json = False) -> None:
    """Refresh the materialized state (incremental: folds only the new commits)."""
    _check_memory(memory_limit)
    log = open_root(root)
    r = pdm.materialize(log, full=full, memory_limit=memory_limit)
    if as_json:
        emit_json(r)
    else:
        out.print(str(r))


@command("check", "poimen check --root ./poimen-data")
def check(root: Root = DEFAULT_ROOT, as_json: Json = False) -> None:
    """Prove that the materialized state equals a cold re-fold of the log; exit 1 if not."""
    log = open_root(root, read_only=True)
    r = st.check(log)
    if as_json:
        emit_json(r)
    elif r.status == "ok":
        out.print(r.detail)
    if r.status != "ok":
        fail(r.detail)


def load_verifier(spec: str) -> Any:
    """``MODULE:NAME`` or ``path/to/file.py:NAME`` (dotted NAME allowed)."""
    import importlib
    import importlib.util

    mod_name, _, attr = spec.rpartition(":")
    if not mod_name or not attr:
        fail(f"--verifier {spec!r} must be MODULE:NAME (e.g. poimen_data.verifiers:exit_code)")
    if mod_name.startswith("."):
        fail(f"--verifier {spec!r}: a relative module name; give the full dotted name or a "
             "file.py path")
    try:
        if mod_name.endswith(".py"):
            loc = importlib.util.spec_from_file_location("_poimen_verifier", mod_name)
            if loc is None or loc.loader is None or not os.path.exists(mod_name):
                fail(f"--verifier {spec!r}: no such file {mod_name}")
            obj: Any = importlib.util.module_from_spec(loc)
            loc.loader.exec_module(obj)
        else:
            obj = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except ImportError as exc:
        fail(f"--verifier {spec!r}: cannot import {mod_name}: {one_line(exc)}")
    except AttributeError:
        fail(f"--verifier {spec!r}: {mod_name} has no {attr}")
    except SyntaxError as exc:
        fail(f"--verifier {spec!r}: syntax error in {exc.filename or mod_name} line "
             f"{exc.lineno}: {exc.msg}")
    except Exception as exc:  # the module's own code raised while it was imported
        fail(f"--verifier {spec!r}: importing {mod_name} raised {type(exc).__name__}: "
             f"{one_line(exc)}")
    if not callable(obj):
        fail(f"--verifier {spec!r} is not callable")
    return obj


@command("grade", "poimen grade --verifier poimen_data.verifiers:exit_code")
def grade(verifier: Annotated[list[str] | None, typer.Option(
              "--verifier", "-v", help="MODULE:NAME or file.py:NAME, repeatable "
                                       "(default: the example verifiers).")] = None,
          run: Annotated[list[str] | None, typer.Option(
              "--run", help="Grade only these runs (repeatable).")] = None,
          force: Annotated[bool, typer.Option(help="Grade again even if graded.")] = False,
          scheduler: Annotated[str | None, typer.Option(
              help="A Dask scheduler address to grade on.")] = None,
          root: Root = DEFAULT_ROOT, as_json: Json = False) -> None:
    """Grade the runs in verifying (each at its snapshot LSN) and record verdicts."""
    from rich.progress import Progress

    vs = [load_verifier(s) for s in verifier] if verifier else st.default_verifiers()
    log = open_root(root)
    executor = None
    if scheduler:
        from distributed import Client

        executor = Client(scheduler)
    with Progress(console=err, transient=True, disable=as_json or not err.is_terminal) as p:
        task = p.add_task("grading", total=None)
        r = pdm.grade(log, vs, runs=run or None, executor=executor, force=force,
               progress=lambda done, total: p.update(task, completed=done, total=total))
    if as_json:
        emit_json(r)
        return
    out.print(f"graded {r.runs_graded} runs ({r.runs_passed} passed, {r.runs_failed} failed, "
              f"{r.runs_errored} errored), {r.runs_skipped} skipped; "
              f"{r.verdicts_recorded} verdicts in {r.commits} commits, {r.wall_s:.2f} s",
              markup=False)
    t = titled("per verifier")
    for c in ("verifier", "graded", "skipped", "passed", "failed", "errored"):
        t.add_column(c)
    for v in r.per_verifier:
        t.add_row(Text(v.verifier), *(str(getattr(v, c)) for c in
                                ("graded", "skipped", "passed", "failed", "errored")))
    out.print(t)


@command("export", "poimen export --format jsonl --out ./live.jsonl")
def export(fmt: Annotated[str, typer.Option("--format",
                                            help="jsonl | parquet | pairs | atif")]
           = "jsonl",
           dest: Annotated[str, typer.Option("--out", help="Destination file (path or URL).")]
           = "./live.jsonl",
           source: Annotated[str, typer.Option(help="auto | state | log")] = "auto",
           run: Annotated[list[str] | None, typer.Option("--run", help="Only these runs.")]
           = None,
           only_succeeded: Annotated[bool, typer.Option(
               "--only-succeeded", help="Drop failed, timed-out and cancelled attempts.")]
           = False,
           keep_unanswered: Annotated[bool, typer.Option(
               "--keep-unanswered",
               help="jsonl: keep attempts with no output as a user turn alone.")] = False,
           at_lsn: AtLsn = None, root: Root = DEFAULT_ROOT, as_json: Json = False) -> None:
    """Export the live-branch trajectory of every run (failed attempts kept) for training."""
    from rich.filesize import decimal
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    check_url(dest, "--out")
    log = open_root(root, read_only=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("runs, {task.fields[written]} written"), console=err,
                  transient=True, disable=as_json or not err.is_terminal) as p:
        task = p.add_task("exporting", total=None, written=decimal(0))
        r = pdm.export_live(log, dest, format=cast(pdm.ExportFormat, fmt),  # export_live checks
               source=cast(pdm.Source, source), at_lsn=at_lsn, runs=run or None,
               only_succeeded=only_succeeded, keep_unanswered=keep_unanswered,
               progress=lambda pr: p.update(task, completed=pr.runs_done, total=pr.runs_total,
                                            written=decimal(pr.bytes)))
    if as_json:
        emit_json(r)
    else:
        out.print(f"wrote {r.path}: {r.records} records of {r.runs} runs, {r.bytes:,} bytes, "
                  f"{r.format} from {r.source} at LSN {r.export_lsn}, sha256 {r.sha256}",
              markup=False)
        if r.skipped_no_output or r.skipped_no_prompt:
            out.print(f"left out {r.skipped_no_output} attempts with no output and "
                      f"{r.skipped_no_prompt} with no prompt (--keep-unanswered keeps the "
                      "first)", markup=False)


import_app = typer.Typer(name="import", no_args_is_help=True,
                         help="Record trajectories from other tools as runs.",
                         epilog="[bold]Example:[/]  poimen import atif session.json")
app.add_typer(import_app)


@import_app.command("atif", epilog="[bold]Example:[/]  poimen import atif session.json")
@_guarded
def import_atif(paths: Annotated[list[str], typer.Argument(
                    help="ATIF files: one trajectory per JSON file, or JSON lines.")],
                tenant: Annotated[str, typer.Option(help="Tenant of the new runs.")]
                = "default",
                root: Root = DEFAULT_ROOT, as_json: Json = False) -> None:
    """Record ATIF trajectories as runs: an attempt per agent turn, bodies in the blob
    store, metrics as usage. Importing the same trajectory twice adds nothing; a bad file
    imports nothing and names the file and the step."""
    log = open_root(root)
    r = pdm.import_atif(log, paths, tenant=tenant)
    if as_json:
        emit_json(r)
    else:
        out.print(f"imported {len(r.runs)} runs ({r.attempts} attempts), "
                  f"{len(r.skipped)} already in the log"
                  + (f", head LSN {r.lsn}" if r.lsn is not None else ""), markup=False)


# --- maintenance -----------------------------------------------------------------------


@command("compact", "poimen compact --root ./poimen-data")
def compact(target_rows: Annotated[int | None, typer.Option(
                help="Rows per rewritten segment.")] = None,
            root: Root = DEFAULT_ROOT, as_json: Json = False) -> None:
    """Rewrite runs of small segments into large ones (same events, same LSNs)."""
    log = open_root(root)
    r = pdm.compact(log) if target_rows is None else pdm.compact(log, target_rows=target_rows)
    emit_json(r) if as_json else out.print(kv_table("compact", r))


@command("vacuum", "poimen vacuum --grace 3600")
def vacuum(grace: Annotated[float | None, typer.Option(
               help="Seconds an unreferenced file must be old before removal "
                    "(0: now; only when no writer is active).")] = None,
           force: Annotated[bool, typer.Option(
               help="With a grace under 10 s, remove files of writers that look active "
                    "(only when every writer is known dead).")] = False,
           root: Root = DEFAULT_ROOT, as_json: Json = False) -> None:
    """Remove uncommitted staging, unreferenced bodies and superseded segments."""
    log = open_root(root)
    r = pdm.vacuum(log, force=force) if grace is None else \
        pdm.vacuum(log, grace=grace, force=force)
    emit_json(r) if as_json else out.print(kv_table("vacuum", r))


@command("lease", "poimen lease --break")
def lease(break_: Annotated[bool, typer.Option(
              "--break", help="Remove the lease whoever holds it (only when its holder "
                              "is known dead).")] = False,
          root: Root = DEFAULT_ROOT, as_json: Json = False) -> None:
    """Show who holds the maintenance lease (vacuum, reduce, compact), or break it."""
    import time

    from poimen_data.jobs._maint import lease_holder

    log = open_root(root)
    held = pdm.break_lease(log) if break_ else lease_holder(log)
    if break_ and held is not None:
        err.print("warning: breaking the maintenance lease; if its holder is still running, "
                  "it stops at its next check, but a step under way finishes and may "
                  "overlap the next maintenance job", markup=False)
    expires = (held or {}).get("expires")
    doc = {"held": held is not None and not break_,
           "owner": (held or {}).get("owner"),
           "expires_in_s": round(expires - time.time(), 1)
           if isinstance(expires, int | float) else None,
           "broken": bool(break_ and held is not None)}
    emit_json(doc) if as_json else out.print(kv_table("lease", doc))


def _summarize(keep: int) -> Callable[[bytes], bytes]:
    def summarize(body: bytes) -> bytes:
        head = body[:keep].decode("utf-8", "ignore")
        return f"{head}\n[reduced by poimen: {len(body):,} bytes originally]\n".encode()
    return summarize


@command("reduce", "poimen reduce --larger-than 100000 --keep 2048")
def reduce(larger_than: Annotated[int | None, typer.Option(
               help="Reduce every prompt/output body larger than this many bytes.")] = None,
           ref: Annotated[list[str] | None, typer.Option(
               "--ref", help="TENANT/SHA256/SIZE of one body (repeatable).")] = None,
           keep: Annotated[int, typer.Option(help="Bytes of the body the summary keeps.")]
           = 1024,
           dry_run: Annotated[bool, typer.Option(help="List, change nothing.")] = False,
           root: Root = DEFAULT_ROOT, as_json: Json = False) -> None:
    """Replace large bodies by short summaries (a blob_reduced event each); readers then
    see the summary, and the original bytes are deleted."""
    from poimen_data.model._events import BlobRef, check_ref

    if larger_than is None and not ref:
        fail("say what to reduce: --larger-than BYTES or --ref TENANT/SHA256/SIZE")
    log = open_root(root)
    refs: dict[tuple[str, str], BlobRef] = {}
    for s in ref or []:
        parts = s.split("/")
        if len(parts) != 3 or not parts[2].isdigit():
            fail(f"--ref {s!r} must be TENANT/SHA256/SIZE")
        r = check_ref(BlobRef(parts[0], parts[1], int(parts[2])), "--ref")
        refs[(r.tenant, r.sha256)] = r
    if larger_than is not None:  # one segment at a time, never the whole log
        from poimen_data.jobs._maint import bodies_larger_than

        refs.update(((r.tenant, r.sha256), r) for r in bodies_larger_than(log, larger_than))
    todo = [refs[k] for k in sorted(refs)]
    if dry_run or not todo:
        data = {"would_reduce": len(todo), "bytes": sum(r.size for r in todo)}
        emit_json(data) if as_json else out.print(
            f"{'would reduce' if dry_run else 'nothing to reduce:'} {len(todo)} bodies, "
            f"{data['bytes']:,} bytes")
        return
    report = pdm.reduce(log, todo, _summarize(keep))
    if as_json:
        emit_json(report)
    else:
        out.print(f"reduced {len(report.reduced)} bodies ({len(report.skipped)} already "
                  f"reduced), freed {report.bytes_freed:,} bytes, at LSN {report.lsn}",
              markup=False)


@command("log", "poimen log --limit 20")
def log_(limit: Annotated[int, typer.Option(min=1, help="Show the last N commits.")] = 30,
         root: Root = DEFAULT_ROOT, as_json: Json = False) -> None:
    """List commits: seq, LSN range, kind, events, bytes written, time."""
    log = open_root(root, read_only=True)
    total, shown = commit_rows(log, limit)
    for (tenant, sha), seq in sorted(log.lost_bodies().items()):
        err.print(f"warning: body {tenant}/{sha} committed at seq {seq} is lost (missing "
                  "from staging and blobs/); reading it fails", markup=False)
    if as_json:
        emit_json(shown)
        return
    t = titled(f"{log.root}: {total} commits, head LSN {log.head}")
    for c in ("seq", "lsn", "kind", "events", "new blobs", "bytes", "time (UTC)"):
        t.add_column(c, justify="right" if c in ("seq", "events", "new blobs", "bytes")
                     else "left")
    for r in shown:
        lsn = f"{r['first_lsn']}-{r['last_lsn']}" if r["events"] else "-"
        t.add_row(str(r["seq"]), lsn, r["kind"], str(r["events"]), str(r["blobs"]),
                  f"{r['bytes']:,}", r["ts"][:23].replace("T", " "))
    out.print(t)
    if total > limit:
        out.print(f"({total - limit} older commits not shown; --limit)")


def commit_rows(log: Any, limit: int) -> tuple[int, list[dict[str, Any]]]:
    """(commits in all, the last ``limit`` of them as rows) for ``poimen log``: seqs are
    gapless from 1 and manifests immutable, so only those ``limit`` manifests are read,
    however long the log (it read every one, a GET each on S3, to show the last 30)."""
    total = log.head_seq
    rows = []
    for m in log.manifests(since_seq=max(0, total - limit)):
        if m.seq > total:  # published since the look at the head
            break
        seg = sum(s.size for s in m.segments)
        blobs = [b for b in m.blobs if b.staged is not None]
        rows.append({"seq": m.seq, "first_lsn": m.first_lsn if m.n_events else None,
                     "last_lsn": m.last_lsn if m.n_events else None, "kind": m.kind,
                     "events": m.n_events, "blobs": len(blobs),
                     "bytes": seg + sum(b.size for b in blobs), "ts": m.ts})
    return total, rows


@command("bench", "poimen bench --quick --json bench.json")
def bench(quick: Annotated[bool, typer.Option(help="Small sizes: about two minutes.")] = False,
          json_path: Annotated[str | None, typer.Option("--json", help="Write JSON here.")]
          = None,
          only: Annotated[str | None, typer.Option(help="Run one scenario.")] = None,
          work_dir: Annotated[str | None, typer.Option(
              help="Make the scratch directory here (the disk to measure).")] = None) -> None:
    """Measure every speed goal against a reference timed in the same run (ratios)."""
    from poimen_data.bench import _runner as _bench

    if only is not None:
        try:
            _bench.select(only)
        except KeyError as exc:
            fail(str(exc.args[0]), code=2)
    raise typer.Exit(_bench.run_cli(quick, json_path, only, work_dir))


@command("view", "poimen view --port 8000 --no-open")
def view(host: Annotated[str, typer.Option(
             help="Address to listen on (loopback unless you say otherwise).")] = "127.0.0.1",
         port: Annotated[int, typer.Option(min=0, max=65535,
                                           help="Port (0 picks a free one).")] = 0,
         no_open: Annotated[bool, typer.Option(
             "--no-open", help="Do not open a browser.")] = False,
         root: Root = DEFAULT_ROOT) -> None:
    """Browse runs, episodes and attempts in a local web page, and run read-only SQL.
    Prints its URL; never writes to the log. Ctrl-C stops it."""
    import webbrowser

    from poimen_data.view import create_app, serve
    from poimen_data.view._app import LOOPBACK_HOSTS as hosts

    log = open_root(root, read_only=True)
    app = create_app(log, allowed_hosts=hosts if host in hosts else ("*",))

    def ready(url: str) -> None:
        if not url:
            return  # uvicorn has printed why it could not listen
        print(f"poimen view: {url}  (root {log.root}; Ctrl-C stops)", flush=True)
        if host not in hosts:
            err.print(f"warning: listening on {host}: anyone who can reach this address can "
                      "read the log", markup=False)
        if not no_open:
            webbrowser.open(url)

    try:
        serve(app, host=host, port=port, on_ready=ready)
    except SystemExit as exc:  # uvicorn's 3 when it cannot listen (it printed why): our 1
        if exc.code not in (0, None):
            raise typer.Exit(1) from None
        raise


def main() -> None:
    """Console-script entry point (``poimen``)."""
    app()


if __name__ == "__main__":
    main()
