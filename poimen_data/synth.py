"""The seeded synthetic workload (public path; it lives in ``poimen_data.workload.synth``)."""

from __future__ import annotations

from poimen_data.workload.synth import *  # noqa: F403 - this module is its public path
from poimen_data.workload.synth import __all__ as __all__
