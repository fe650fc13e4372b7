"""A seeded, realistic synthetic workload: what the demo, the tests and the benchmarks record.

Runs over several tenants and workflow versions retry failing steps (failure depends on the
step, the version and on context that was dropped), fork branches by rewinds (forks of
forks too), get cancelled while verifying, and leave attempts ``dispatched`` that a later
recovery sweep resolves. Runs are interleaved like concurrent work and committed one
transaction per engine transition (``batch`` groups several for speed). Everything,
timestamps included, is a function of the seed, so two generations give identical logs.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from poimen_data.model import _events as ev
from poimen_data.model._arrow import events_to_table

TENANTS = ("acme", "globex", "initech", "umbrella", "hooli")
VERSIONS = ("v1", "v2", "v3")
WORKFLOWS: dict[str, tuple[str, ...]] = {
    "triage": ("classify", "retrieve", "draft", "review"),
    "codefix": ("reproduce", "locate", "patch", "test", "review", "summarize"),
    "research": ("search", "read", "synthesize"),
}
#: Base failure probability of a first attempt per step; scaled by the version factor.
STEP_FAIL = {"classify": 0.06, "retrieve": 0.18, "draft": 0.14, "review": 0.10,
             "reproduce": 0.20, "locate": 0.16, "patch": 0.32, "test": 0.26,
             "summarize": 0.04, "search": 0.12, "read": 0.10, "synthesize": 0.22}
VERSION_FAIL = {"v1": 1.5, "v2": 1.0, "v3": 0.55}
VERSION_DROP = {"v1": 0.40, "v2": 0.25, "v3": 0.12}  # chance the key context is dropped
RETRIEVAL_STEPS = frozenset({"retrieve", "search", "read", "locate"})
STEP_TOOLS = {"classify": (), "retrieve": ("search_kb", "fetch_doc"), "draft": ("render",),
              "review": ("lint",), "reproduce": ("run_shell",), "locate": ("grep", "read_file"),
              "patch": ("read_file", "apply_patch"), "test": ("run_tests",), "summarize": (),
              "search": ("web_search",), "read": ("fetch_url",), "synthesize": ("cite",)}
MAX_ATTEMPTS = 3
MIN_BODY, MAX_BODY = 1024, 1 << 20
PRICE_IN, PRICE_OUT, PRICE_CACHE = Decimal(3), Decimal(15), Decimal("0.3")  # USD per 1M
ERRORS = ("tool call failed: rate limited (429)", "output failed schema validation",
          "model refused: policy", "assertion failed in generated test")
CANCEL_REASONS = ("operator cancelled while verifying", "superseded by a newer run",
                  "budget exceeded")
SUBJECTS = ("Refund not received for order", "Login loop on the Zürich portal",
            "Export to CSV drops accents (São Paulo)", "Invoice total off by one cent",
            "東京 office cannot reach VPN", "Webhook retries flood the queue",
            "Dashboard shows stale numbers", "Password reset mail never arrives",
            "Crash when uploading a 2 GB file", "Timezone wrong in weekly report")
#: What an attempt's prompt is assembled from. The log stores the *assembled* prompt only.
PROMPT_TEMPLATE = (
    "{preamble}\n\n## Tools\n{tool_docs}\n\n## Task\nYou are the '{step}' step of the "
    "{workflow} workflow ({version}) for tenant {tenant}.\nTicket {ticket}: {subject}\n"
    "{previous}\n## Context\n{context}\n"
)


@dataclass(frozen=True, slots=True)
class Unit:
    """One engine transition: the bodies and events it commits together."""

    bodies: tuple[tuple[str, bytes], ...]
    events: tuple[ev.Event, ...]


@dataclass(frozen=True)
class SynthSummary:
    """What ``generate`` recorded, counted from the events it wrote (not from a fold)."""

    runs: int
    events: int
    commits: int
    head: int
    seed: int
    runs_by_state: dict[str, int]
    attempts_by_outcome: dict[str, int]
    attempts: int
    retries: int
    forks: int
    forks_of_forks: int
    cancelled_while_verifying: int
    crashed: int
    recovered: int
    left_dispatched: int
    bodies: int
    body_bytes: int
    ref_bytes: int
    shared_bodies: int
    min_body: int
    max_body: int
    #: (workflow_version, step_id) -> (attempts, failed or timed_out)
    failure_by_step: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["failure_by_step"] = [
            {"workflow_version": v, "step_id": s, "attempts": a, "failed": f}
            for (v, s), (a, f) in sorted(self.failure_by_step.items())]
        return d


# --- text ----------------------------------------------------------------------------

_WORDS = ("the agent retried after the tool call returned a partial result so the context "
          "window was repacked with the missing runbook section and the verifier checked "
          "that every cited document exists in the knowledge base before the draft was "
          "accepted by review latency tokens budget cache branch rewind snapshot patch test "
          "customer invoice refund webhook queue deploy rollback config schema").split()
_FILLER: bytes | None = None


def _filler() -> bytes:
    """256 KiB of ASCII prose, the same in every process (so bodies are deterministic)."""
    global _FILLER
    if _FILLER is None:
        r = random.Random("poimen-filler")
        words: list[str] = []
        n = 0
        while n < 1 << 18:
            w = r.choice(_WORDS)
            words.append(w + ("\n" if r.random() < 0.08 else " "))
            n += len(words[-1])
        _FILLER = "".join(words).encode()[: 1 << 18]
    return _FILLER


def body(head: str, size: int) -> bytes:
    """``head`` followed by filler prose, exactly ``size`` bytes (at least the head)."""
    h = head.encode()
    need = size - len(h)
    if need <= 0:
        return h
    f = _filler()
    off = int.from_bytes(hashlib.sha256(h).digest()[:4], "big") % len(f)
    reps = (off + need) // len(f) + 1
    return h + (f * reps)[off: off + need]


def _lognormal(r: random.Random, median: float, sigma: float) -> int:
    return int(min(MAX_BODY, max(MIN_BODY, r.lognormvariate(math.log(median), sigma))))


@functools.lru_cache(maxsize=4096)
def _doc_size(doc_id: str) -> int:
    r = random.Random(f"doc:{doc_id}")
    return int(min(200_000, max(300, r.lognormvariate(math.log(1500), 1.1))))


@functools.lru_cache(maxsize=1024)
def _doc_text(doc_id: str) -> str:
    """A context document's text: the same for an id everywhere (it is shared context)."""
    return f"### {doc_id}\n" + body(doc_id, _doc_size(doc_id)).decode()


def render_prompt(**variables: str) -> str:
    """Assemble ``PROMPT_TEMPLATE``: the text a model sees and the log stores."""
    return PROMPT_TEMPLATE.format(**variables)


# --- one run ---------------------------------------------------------------------------


class _Run:
    """The engine's story of one run, told as a generator of ``Unit`` transitions."""

    def __init__(self, world: _World, index: int) -> None:
        self.w = world
        self.r = random.Random(f"{world.seed}:run:{index}")
        r = self.r
        self.tenant = r.choice(world.tenants)
        self.workflow = r.choice(sorted(WORKFLOWS))
        self.version = r.choices(world.versions, weights=range(len(world.versions), 0, -1))[0]
        self.wv = f"{self.workflow}@{self.version}"
        self.steps = WORKFLOWS[self.workflow]
        self.run_id = f"{world.prefix}-{index:06d}"
        self.ticket = min(int(r.paretovariate(1.1)), 25)  # a few hot tickets
        self.subject = SUBJECTS[(self.ticket * 7 + len(self.tenant)) % len(SUBJECTS)]
        self.labels = {"env": "prod" if r.random() < 0.8 else "staging",
                       "priority": f"p{r.choice((0, 1, 1, 2, 2, 2, 3))}",
                       "source": r.choice(("api", "email", "slack")),
                       "ticket": f"T-{self.ticket}"}
        self.last_output = b""

    def _ts(self) -> datetime:
        return self.w.now

    def _ref(self, bodies: list[tuple[str, bytes]], head: str, size: int) -> ev.BlobRef | None:
        if not self.w.with_bodies:
            return None
        data = body(head, size)
        bodies.append((self.tenant, data))
        return ev.BlobRef(self.tenant, hashlib.sha256(data).hexdigest(), len(data))

    def _context(self, step: str, attempt: int, improved: bool) -> tuple[ev.ContextPartition,
                                                                          bool]:
        # What is available depends on the ticket (so first prompts repeat across runs);
        # whether the key document survives packing is the luck of this attempt.
        p_drop = VERSION_DROP[self.version] * (0.3 if attempt > 1 or improved else 1.0)
        key_dropped = self.r.random() < p_drop
        r = random.Random(f"ctx:{self.tenant}:{self.ticket}:{step}:{attempt}:{improved}")
        ids = [f"kb/{self.ticket}-{i}" for i in range(1, 3)] + \
              [f"runbook/{step}", f"ticket/T-{self.ticket}"] + \
              [f"history/{r.randrange(40)}" for _ in range(r.randint(0, 4))]
        key = ids[0]
        others = ids[1:]
        dropped = [x for x in others if r.random() < 0.15]
        available = [x for x in others if x not in dropped and r.random() < 0.2]
        packed = [x for x in ids if x not in dropped and x not in available and x != key]
        if key_dropped:
            dropped.insert(0, key)
        else:
            packed.insert(0, key)
        return ev.ContextPartition(tuple(packed), tuple(available), tuple(dropped)), key_dropped

    def _prompt_text(self, step: str, attempt: int, ctx: ev.ContextPartition,
                     previous_error: str | None) -> tuple[str, int]:
        preamble = body(f"# System ({self.tenant})\nYou are a careful agent.\n", 1200)
        tool_docs = body(f"Tools for {step}: {', '.join(STEP_TOOLS[step]) or 'none'}\n", 900)
        context = "\n".join(_doc_text(d) for d in ctx.packed)
        prev = ""
        if self.last_output:
            prev = "Previous step said: " + self.last_output[:160].decode("ascii", "replace")
        if previous_error:
            prev += f"\nAttempt {attempt - 1} failed: {previous_error}\n"
        text = render_prompt(preamble=preamble.decode(), tool_docs=tool_docs.decode(),
                             step=step, workflow=self.workflow, version=self.version,
                             tenant=self.tenant, ticket=f"T-{self.ticket}",
                             subject=self.subject, previous=prev, context=context)
        return text[:MAX_BODY], (len(preamble) + len(tool_docs)) // 4

    def _attempt(self, branch: int, idx: int, attempt: int, improved: bool,
                 previous_error: str | None) -> Generator[Unit, None, Unit | None]:
        """Yield the dispatch; return the finish ``Unit`` (None when the worker died)."""
        r, step = self.r, self.steps[idx]
        ctx, key_dropped = self._context(step, attempt, improved)
        text, cached = self._prompt_text(step, attempt, ctx, previous_error)
        bodies: list[tuple[str, bytes]] = []
        prompt = None
        if self.w.with_bodies:
            data = text.encode()
            bodies.append((self.tenant, data))
            prompt = ev.BlobRef(self.tenant, hashlib.sha256(data).hexdigest(), len(data))
        first = [] if (branch or idx or attempt > 1) else [
            ev.RunStarted(self.tenant, self.run_id, self.wv, self.labels, ts=self._ts())]
        yield Unit(tuple(bodies), (*first, ev.AttemptDispatched(
            self.tenant, self.run_id, branch, step, idx, attempt, prompt=prompt, context=ctx,
            workflow_version=self.wv, ts=self._ts())))
        if r.random() < 0.035:  # the worker dies; the engine retries, recovery comes later
            self.w.crashed.append((self.tenant, self.run_id, branch, step, attempt))
            return None
        p_fail = STEP_FAIL[step] * VERSION_FAIL[self.version] * (0.6 if attempt > 1 else 1.0)
        failed = r.random() < min(0.9, p_fail + (0.35 if key_dropped else 0.0))
        state = ("timed_out" if r.random() < 0.2 else "failed") if failed else "succeeded"
        out_size = _lognormal(r, 2048, 1.2)
        if r.random() < 0.01:  # a log dump or a whole file: the long tail
            out_size = int(math.exp(r.uniform(math.log(100_000), math.log(MAX_BODY))))
        error, output, bodies = None, None, []
        if state == "succeeded" and step in RETRIEVAL_STEPS:  # same documents per ticket
            out_size = _doc_size(f"kb/{self.ticket}-1") + 1024
            output = self._ref(bodies, f"Documents for T-{self.ticket} ({self.tenant})\n",
                               out_size)
        elif state == "succeeded":
            head = f"{self.run_id}/{branch}/{step}#{attempt}\n"
            if idx == len(self.steps) - 1:  # the answer: what a body verifier looks for
                good = r.random() < {"v1": 0.6, "v2": 0.75, "v3": 0.9}[self.version]
                head += f"RESULT: {'resolved' if good else 'needs-human'}\n"
            output = self._ref(bodies, head, out_size)
        elif state == "failed":
            error = (f"missing context: {ctx.dropped[0]} was dropped" if key_dropped
                     else r.choice(ERRORS))
            out_size = 1500
            output = self._ref(bodies, f"Error transcript: {error}\n", out_size)  # shared
        else:
            error, out_size = "timed out after 120 s", 0
        in_tok, out_tok = len(text) // 4, out_size // 4
        cost = in_tok * PRICE_IN + out_tok * PRICE_OUT - cached * (PRICE_IN - PRICE_CACHE)
        usage = ev.Usage(in_tok, out_tok, cached, r.randrange(0, 2000) if idx % 2 else 0,
                         max(cost, Decimal(0)) / Decimal(1_000_000),
                         round(r.lognormvariate(math.log(1800), 0.6), 3))
        tools = ev.ToolInfo(tuple(t for t in STEP_TOOLS[step] if r.random() < 0.85))
        if state == "succeeded" and bodies:
            self.last_output = bodies[0][1]
        return Unit(tuple(bodies), (ev.AttemptFinished(
            self.tenant, self.run_id, branch, step, attempt, state, output=output,
            usage=usage, tools=tools, error=error, ts=self._ts()),))

    def _verifying(self) -> ev.VerifyingEntered:
        return ev.VerifyingEntered(self.tenant, self.run_id, ts=self._ts())

    def _branch(self, branch: int, start: int, improved: bool) -> Iterator[Unit]:
        """Run steps ``start..`` on ``branch`` with retries; the commit that makes every
        step terminal (or gives up on one) also enters ``verifying``."""
        self.exhausted_at: int | None = None
        for idx in range(start, len(self.steps)):
            attempt, error = 0, None
            while True:
                attempt += 1
                fin = yield from self._attempt(branch, idx, attempt, improved, error)
                give_up = attempt >= MAX_ATTEMPTS
                if fin is None:
                    error = "worker lost (dispatched, no result)"
                    if give_up:
                        self.exhausted_at = idx
                        yield Unit((), (self._verifying(),))
                        return
                    continue
                finish = fin.events[0]
                assert isinstance(finish, ev.AttemptFinished)
                done = finish.state == "succeeded"
                if (done and idx == len(self.steps) - 1) or (not done and give_up):
                    fin = Unit(fin.bodies, (*fin.events, self._verifying()))
                yield fin
                if done:
                    break
                if give_up:
                    self.exhausted_at = idx
                    return
                error = finish.error

    def units(self) -> Iterator[Unit]:
        r = self.r
        live, n_branches = 0, 1
        yield from self._branch(0, 0, False)
        while n_branches < 4:
            # an operator who rewound once is likely to iterate: forks of forks
            p_rewind = 0.6 if self.exhausted_at is not None else (0.12, 0.4)[n_branches > 1]
            if r.random() >= p_rewind:
                break
            if self.exhausted_at is not None:
                fork_at = r.randint(max(0, self.exhausted_at - 1), self.exhausted_at)
            else:
                fork_at = r.randrange(len(self.steps))
            parent = live if r.random() < 0.85 else r.randrange(n_branches)
            new = n_branches
            n_branches, live = n_branches + 1, new
            self.w.forks.append((self.run_id, new, parent))
            self.last_output = b""
            yield Unit((), (ev.BranchForked(self.tenant, self.run_id, new, parent, fork_at,
                                            ts=self._ts()),))
            yield from self._branch(new, fork_at, True)
        x = r.random()
        if x < 0.12:
            yield Unit((), (ev.RunCancelled(self.tenant, self.run_id, r.choice(CANCEL_REASONS),
                                            ts=self._ts()),))
        elif x < 0.45:  # the engine's own checks pass or fail the run
            failed = self.exhausted_at is not None or r.random() < 0.25
            outcome = "failed" if failed else "succeeded"
            yield Unit((), (ev.RunFinished(self.tenant, self.run_id, outcome, ts=self._ts()),))


# --- the world: interleaving, clock, recovery ------------------------------------------


class _World:
    def __init__(self, seed: int, tenants: int, versions: int, prefix: str,
                 with_bodies: bool) -> None:
        self.seed = seed
        self.tenants = TENANTS[: max(1, min(tenants, len(TENANTS)))]
        self.versions = VERSIONS[: max(1, min(versions, len(VERSIONS)))]
        self.prefix = prefix
        self.with_bodies = with_bodies
        self.r = random.Random(f"{seed}:world")
        self.now = datetime(2025, 1, 6, 8, tzinfo=UTC) + timedelta(hours=seed % 1000)
        self.crashed: list[tuple[str, str, int, str, int]] = []
        self.forks: list[tuple[str, int, int]] = []

    def recovery(self) -> Unit:
        """The engine restarts: resolve every attempt a dead worker left ``dispatched``."""
        evs = []
        # A recovered attempt has no output body, even when it is resolved as succeeded
        # (the engine saw the step's effect, e.g. the tool's result, but the model's
        # response died with the worker): realistic, so chat exports leave them out.
        for tenant, run_id, branch, step, attempt in self.crashed:
            state = self.r.choices(("timed_out", "failed", "succeeded"), (7, 2, 1))[0]
            evs.append(ev.AttemptRecovered(tenant, run_id, branch, step, attempt, state,
                                           error=None if state == "succeeded"
                                           else "recovered after worker loss", ts=self.now))
        self.crashed = []
        return Unit((), tuple(evs))


def units(runs: int, *, seed: int = 0, tenants: int = 3, versions: int = 3,
          concurrency: int = 6, recovery_every: int = 40, prefix: str = "run",
          with_bodies: bool = True) -> Iterator[Unit]:
    """Every transition of the workload in commit order (``generate`` commits these)."""
    w = _World(seed, tenants, versions, prefix, with_bodies)
    pending = iter(range(runs))
    active: list[Iterator[Unit]] = []
    n = started = 0
    while True:
        while len(active) < concurrency:
            i = next(pending, None)
            if i is None:
                break
            active.append(_Run(w, i).units())
            started += 1
        if not active:
            return
        k = w.r.randrange(len(active))
        w.now += timedelta(milliseconds=int(w.r.expovariate(1 / 1500)) + 1)
        u = next(active[k], None)
        if u is None:
            active.pop(k)
            continue
        yield u
        n += 1
        # The engine restarts now and then, but not since the last few runs started: the
        # attempts its workers lost since then are still ``dispatched`` at the end.
        if n % recovery_every == 0 and w.crashed and runs - started >= 2 * concurrency:
            yield w.recovery()


# --- recording -------------------------------------------------------------------------


class _Tally:
    """Counts what was written, by replaying the events the way the fold would."""

    def __init__(self) -> None:
        self.run_state: dict[str, str] = {}
        self.attempt: dict[tuple[str, int, str, int], tuple[str, str]] = {}
        self.wv: dict[str, str] = {}
        self.body_runs: dict[tuple[str, str], tuple[str, bool]] = {}
        self.body_size: dict[tuple[str, str], int] = {}
        self.events = self.forks = self.forks_of_forks = self.cancel_verifying = 0
        self.crashed = self.recovered = self.ref_bytes = 0

    def add(self, u: Unit) -> None:
        for e in u.events:
            self.events += 1
            run = getattr(e, "run_id", "")
            if isinstance(e, ev.RunStarted):
                self.wv[run] = e.workflow_version
                self.run_state[run] = "running"
            elif isinstance(e, ev.AttemptDispatched):
                self.attempt[(run, e.branch_id, e.step_id, e.attempt_no)] = (
                    "dispatched", e.workflow_version or self.wv[run])
            elif isinstance(e, ev.AttemptFinished | ev.AttemptRecovered):
                key = (run, e.branch_id, e.step_id, e.attempt_no)
                self.attempt[key] = (e.state, self.attempt[key][1])
                self.recovered += isinstance(e, ev.AttemptRecovered)
            elif isinstance(e, ev.BranchForked):
                self.forks += 1
                self.forks_of_forks += e.parent_branch_id > 0
                self.run_state[run] = "running"
            elif isinstance(e, ev.VerifyingEntered):
                self.run_state[run] = "verifying"
            elif isinstance(e, ev.RunFinished):
                self.run_state[run] = e.outcome
            elif isinstance(e, ev.RunCancelled):
                self.cancel_verifying += self.run_state[run] == "verifying"
                self.run_state[run] = "cancelled"
            for _name, ref in ev.event_refs(e):
                body = (ref.tenant, ref.sha256)
                self.ref_bytes += ref.size
                self.body_size[body] = ref.size
                first = self.body_runs.get(body)
                if first is None:
                    self.body_runs[body] = (run, False)
                elif not first[1] and first[0] != run:
                    self.body_runs[body] = (first[0], True)

    def summary(self, *, runs: int, commits: int, head: int, seed: int,
                crashed: int) -> SynthSummary:
        by_step: dict[tuple[str, str], tuple[int, int]] = {}
        for (_run, _b, step, _a), (state, wv) in sorted(self.attempt.items()):
            a, f = by_step.get((wv, step), (0, 0))
            by_step[(wv, step)] = (a + 1, f + (state in ("failed", "timed_out")))
        outcomes = Counter(s for s, _ in self.attempt.values())
        sizes = self.body_size.values()
        return SynthSummary(
            runs=runs, events=self.events, commits=commits, head=head, seed=seed,
            runs_by_state=dict(sorted(Counter(self.run_state.values()).items())),
            attempts_by_outcome=dict(sorted(outcomes.items())),
            attempts=len(self.attempt),
            retries=sum(1 for k in self.attempt if k[3] > 1),
            forks=self.forks, forks_of_forks=self.forks_of_forks,
            cancelled_while_verifying=self.cancel_verifying,
            crashed=crashed, recovered=self.recovered,
            left_dispatched=outcomes.get("dispatched", 0),
            bodies=len(self.body_size), body_bytes=sum(sizes), ref_bytes=self.ref_bytes,
            shared_bodies=sum(1 for _r, shared in self.body_runs.values() if shared),
            min_body=min(sizes, default=0), max_body=max(sizes, default=0),
            failure_by_step=dict(sorted(by_step.items())))


def generate(log: Any, *, runs: int = 300, seed: int = 0, tenants: int = 3,
             versions: int = 3, batch: int = 1, concurrency: int = 6,
             prefix: str = "run",
             progress: Callable[[int, int], None] | None = None) -> SynthSummary:
    """Record the workload into ``log`` (an ``EventLog`` or a root URL).

    ``batch=1`` commits each engine transition on its own, with its bodies, as an engine
    would; ``batch=N`` groups N transitions per transaction (same events, fewer commits).
    ``progress(done, total)`` is called after each commit with transitions done so far.
    Run ids are ``<prefix>-<index>``: use another prefix to add runs to a log that has some.
    """
    from poimen_data.log._log import open_log

    log = open_log(log)
    tally = _Tally()
    commits = dispatched = finished = 0
    group: list[Unit] = []
    stream = units(runs, seed=seed, tenants=tenants, versions=versions,
                   concurrency=concurrency, prefix=prefix)
    for u in stream:
        group.append(u)
        if len(group) < max(1, batch):
            continue
        _commit(log, group, tally)
        commits += 1
        group = []
        if progress is not None:
            progress(len(tally.run_state), runs)
    if group:
        _commit(log, group, tally)
        commits += 1
    if progress is not None:
        progress(runs, runs)
    dispatched = sum(1 for _ in tally.attempt)
    finished = sum(1 for s, _ in tally.attempt.values() if s != "dispatched")
    return tally.summary(runs=runs, commits=commits, head=log.head, seed=seed,
                         crashed=dispatched - finished + tally.recovered)


def _commit(log: Any, group: list[Unit], tally: _Tally) -> None:
    with log.transaction() as tx:
        for u in group:
            for tenant, data in u.bodies:
                tx.put_blob(tenant, data)
            tx.extend(u.events)
    for u in group:
        tally.add(u)


def events_table(n_events: int, *, seed: int = 0, tenants: int = 3,
                 versions: int = 3) -> pa.Table:
    """``n_events`` valid events (``EVENT_SCHEMA``, refs null) for the bulk path
    ``tx.extend(table)``: a block of generated runs, tiled with renamed run ids and
    shifted timestamps until there are enough rows (the last run may be cut short)."""
    n_runs = max(1, min(500, n_events // 15 + 1))
    evs = [e for u in units(n_runs, seed=seed, tenants=tenants, versions=versions,
                            with_bodies=False) for e in u.events]
    block = events_to_table(evs, [e.ts for e in evs if e.ts is not None])
    last, first = evs[-1].ts, evs[0].ts
    assert last is not None and first is not None  # units() stamps every event
    span = last - first + timedelta(seconds=1)
    parts, have, copy = [], 0, 0
    while have < n_events:
        t = block
        if copy:
            run_id = pc.binary_join_element_wise(t.column("run_id"), f"-x{copy}", "")
            ts = pc.add(t.column("ts"), pa.scalar(span * copy, pa.duration("us")))
            t = t.set_column(t.schema.get_field_index("run_id"), "run_id", run_id)
            t = t.set_column(0, ev.EVENT_SCHEMA.field("ts"), ts.cast(ev.EVENT_SCHEMA.field(
                "ts").type))
        parts.append(t)
        have += t.num_rows
        copy += 1
    return pa.concat_tables(parts).slice(0, n_events).combine_chunks()


__all__ = [
    "body",
    "CANCEL_REASONS",
    "ERRORS",
    "events_table",
    "generate",
    "MAX_ATTEMPTS",
    "MAX_BODY",
    "MIN_BODY",
    "PROMPT_TEMPLATE",
    "render_prompt",
    "RETRIEVAL_STEPS",
    "STEP_FAIL",
    "STEP_TOOLS",
    "SUBJECTS",
    "SynthSummary",
    "TENANTS",
    "Unit",
    "units",
    "VERSION_DROP",
    "VERSION_FAIL",
    "VERSIONS",
    "WORKFLOWS",
]
