"""Example verifiers, and the live-trajectory helpers they use.

``exit_code`` grades from attempt states alone and never reads a body: the cheap,
always-available signal. ``output_mentions`` reads output text through ``ctx.blobs`` and
shows how a body verifier treats a reduced body (``get`` -> None) as a normal answer.
``output_is_json`` is attempt-scoped: one verdict per attempt, on the attempt it judged.
A verifier is any callable ``(VerifierCtx) -> Verdict`` with ``name``/``version``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from poimen_data.jobs._grade_types import Verdict, VerifierCtx

if TYPE_CHECKING:
    from poimen_data.fold._query import AttemptView, EpisodeView


def live_trajectory(episode: EpisodeView) -> tuple[AttemptView, ...]:
    """The attempts along the live branch's trajectory (docs/DESIGN.md, "Domain"), in order.

    A snapshot's ``BranchView`` holds only the attempts its branch recorded, so the
    trajectory is rebuilt from the parents: the parent's trajectory restricted to
    ``step_index < fork_step_index``, then the branch's own attempts. Needs an episode
    read with ``all_branches=True`` when the live branch is a fork (grading always is).
    """
    return tuple(a for _b, a in live_trajectory_branches(episode))


def live_trajectory_branches(episode: EpisodeView) -> tuple[tuple[int, AttemptView], ...]:
    """``live_trajectory`` with the branch that recorded each attempt:
    (branch_id, attempt) pairs, in trajectory order."""
    by_id = {b.branch_id: b for b in episode.branches}

    def walk(branch_id: int, depth: int) -> tuple[Any, ...]:
        b = by_id.get(branch_id)
        if b is None or depth > len(by_id):
            return ()
        own = tuple((b.branch_id, a) for a in b.attempts)
        if b.parent_branch_id is None or b.fork_step_index is None:
            return own
        inherited = tuple((pb, a) for pb, a in walk(b.parent_branch_id, depth + 1)
                          if a.step_index is not None and a.step_index < b.fork_step_index)
        return inherited + own

    return walk(episode.live_branch, 0)


def last_attempts(episode: EpisodeView) -> tuple[AttemptView, ...]:
    """The last attempt of every step on the live trajectory, in trajectory order."""
    return tuple(a for _b, a in last_attempts_branches(episode))


def last_attempts_branches(episode: EpisodeView) -> tuple[tuple[int, AttemptView], ...]:
    """``last_attempts`` with the branch that recorded each: (branch_id, attempt) pairs."""
    last: dict[str, Any] = {}
    for b, a in live_trajectory_branches(episode):
        last.pop(a.step, None)
        last[a.step] = (b, a)
    return tuple(last.values())


def judged_attempt(ctx: VerifierCtx) -> AttemptView:
    """The attempt an attempt-scoped verifier was called for (``ctx.branch``,
    ``ctx.step``, ``ctx.attempt``), from the frozen snapshot."""
    if ctx.step is None or ctx.attempt is None or ctx.branch is None:
        raise ValueError(f"run {ctx.run}: this call grades the run, not one attempt")
    for b in ctx.episode.branches:
        if b.branch_id == ctx.branch:
            for a in b.attempts:
                if a.step == ctx.step and a.attempt == ctx.attempt:
                    return a
    raise LookupError(f"run {ctx.run}: no attempt {ctx.step}#{ctx.attempt} on branch "
                      f"{ctx.branch} in the snapshot")


def exit_code(ctx: VerifierCtx) -> Verdict:
    """Pass when the last attempt of every step on the live trajectory succeeded.

    Reads attempt states only (never ``ctx.blobs``); failed earlier attempts are retries
    and do not count against the run, but their number is in ``detail``.
    """
    traj = live_trajectory(ctx.episode)
    last = last_attempts(ctx.episode)
    if not last:
        return Verdict(False, 0.0, "no attempts on the live trajectory")
    bad = [f"{a.step}={a.state}" for a in last if a.state != "succeeded"]
    retried = sum(1 for a in traj if a.state in ("failed", "timed_out"))
    score = (len(last) - len(bad)) / len(last)
    if bad:
        return Verdict(False, score, "not succeeded: " + ", ".join(bad))
    return Verdict(True, score, f"{len(last)} steps succeeded; {retried} failed attempts")


exit_code.name = "exit_code"  # type: ignore[attr-defined]
exit_code.version = "1"  # type: ignore[attr-defined]


class OutputMentions:
    """Pass when the output of the last attempt of each step (or of the last
    ``last_steps`` steps) on the live trajectory mentions ``needle``.

    Reads one body per such attempt that has an output ref, and nothing else. A body
    that was reduced (``get`` -> None) cannot be judged: it is listed in ``detail`` and
    left out, and the verdict rests on the bodies still there (none left: not passed).
    """

    version = "1"

    def __init__(self, needle: str, *, last_steps: int | None = None,
                 name: str = "output_mentions") -> None:
        self.needle = needle
        self.last_steps = last_steps
        self.name = name

    def __repr__(self) -> str:
        return f"OutputMentions({self.needle!r}, last_steps={self.last_steps})"

    def __call__(self, ctx: VerifierCtx) -> Verdict:
        last = last_attempts(ctx.episode)
        if self.last_steps is not None:
            last = last[-self.last_steps:] if self.last_steps > 0 else ()
        read, hits, reduced = 0, 0, []
        for a in last:
            if a.output is None:
                continue
            body = ctx.blobs.get(a.output)
            if body is None:
                reduced.append(a.step)
                continue
            read += 1
            hits += self.needle in body.decode("utf-8", errors="replace")
        notes = f"; reduced: {', '.join(reduced)}" if reduced else ""
        if read == 0:
            return Verdict(False, None, f"no output body to read{notes}")
        return Verdict(hits == read, hits / read,
                       f"{hits}/{read} outputs mention {self.needle!r}{notes}")


def output_mentions(needle: str, *, last_steps: int | None = None,
                    name: str = "output_mentions") -> OutputMentions:
    """A text verifier for ``needle`` (see ``OutputMentions``)."""
    return OutputMentions(needle, last_steps=last_steps, name=name)


class OutputIsJson:
    """An attempt-scoped verifier: pass when the attempt's output parses as JSON (a
    JSON object holding ``keys``, when given): the structured answer the step promised.

    Called once per attempt it applies to (``steps``; every step when None), it reads
    that attempt's output body and nothing else. No output ref, or a body that was
    reduced (``get`` -> None), cannot be judged as JSON: not passed, said in ``detail``.
    """

    scope = "attempt"
    version = "1"

    def __init__(self, *, keys: tuple[str, ...] = (), steps: tuple[str, ...] | None = None,
                 attempts: str = "all", name: str = "output_is_json") -> None:
        self.keys = tuple(keys)
        if steps is not None:
            self.steps = tuple(steps)
        self.attempts = attempts
        self.name = name

    def __repr__(self) -> str:
        return (f"OutputIsJson(keys={self.keys!r}, steps={getattr(self, 'steps', None)!r}, "
                f"attempts={self.attempts!r})")

    def __call__(self, ctx: VerifierCtx) -> Verdict:
        import json

        a = judged_attempt(ctx)
        if a.output is None:
            return Verdict(False, None, f"{a.step}#{a.attempt} ({a.state}): no output")
        body = ctx.blobs.get(a.output)
        if body is None:
            return Verdict(False, None, f"{a.step}#{a.attempt}: output reduced; cannot judge")
        try:
            doc = json.loads(body)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
            return Verdict(False, 0.0, f"{a.step}#{a.attempt}: not JSON: {exc}")
        if not self.keys:
            return Verdict(True, 1.0, f"{a.step}#{a.attempt}: parses as JSON")
        if not isinstance(doc, dict):
            return Verdict(False, 0.0, f"{a.step}#{a.attempt}: JSON {type(doc).__name__}, "
                                       "not an object")
        missing = [k for k in self.keys if k not in doc]
        score = (len(self.keys) - len(missing)) / len(self.keys)
        if missing:
            return Verdict(False, score, f"{a.step}#{a.attempt}: missing keys "
                                         f"{', '.join(missing)}")
        return Verdict(True, 1.0, f"{a.step}#{a.attempt}: a JSON object with "
                                  f"{', '.join(self.keys)}")


#: Ready for ``poimen grade --verifier poimen_data.verifiers:output_is_json``: every
#: terminal attempt's output must parse as JSON.
output_is_json = OutputIsJson()


__all__ = ["OutputIsJson", "OutputMentions", "exit_code", "judged_attempt", "last_attempts",
           "last_attempts_branches", "live_trajectory", "live_trajectory_branches",
           "output_is_json", "output_mentions"]
