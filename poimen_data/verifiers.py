"""Example verifiers (public path; they live in ``poimen_data.jobs.verifiers``)."""

from __future__ import annotations

from poimen_data.jobs.verifiers import (
    OutputMentions,
    exit_code,
    last_attempts,
    live_trajectory,
    output_mentions,
)

__all__ = [
    "exit_code",
    "last_attempts",
    "live_trajectory",
    "output_mentions",
    "OutputMentions",
]
