"""Example verifiers (public path; they live in ``poimen_data.jobs.verifiers``)."""

from __future__ import annotations

from poimen_data.jobs.verifiers import (
    OutputIsJson,
    OutputMentions,
    exit_code,
    judged_attempt,
    last_attempts,
    last_attempts_branches,
    live_trajectory,
    live_trajectory_branches,
    output_is_json,
    output_mentions,
)

__all__ = [
    "exit_code",
    "judged_attempt",
    "last_attempts",
    "last_attempts_branches",
    "live_trajectory",
    "live_trajectory_branches",
    "output_is_json",
    "output_mentions",
    "OutputIsJson",
    "OutputMentions",
]
