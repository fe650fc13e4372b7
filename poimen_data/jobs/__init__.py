"""The jobs layer: batch work over a log — grading (verifiers over frozen snapshots),
export for the learning loop, maintenance (reduce, vacuum, compact under one lease), and
the chain a team schedules (``jobs.chain``).

Imports every layer below it (``model``, ``storage``, ``log``, ``fold``).
"""

from __future__ import annotations

from poimen_data.jobs._atif import ImportReport, import_atif
from poimen_data.jobs._export import ExportFormat, ExportProgress, ExportReport, export_live
from poimen_data.jobs._grade import grade
from poimen_data.jobs._grade_types import (
    GradeFailure,
    GradeReport,
    Verdict,
    VerifierCounts,
    VerifierCtx,
)
from poimen_data.jobs._maint import (
    CompactReport,
    ReduceReport,
    VacuumReport,
    break_lease,
    compact,
    reduce,
    vacuum,
)

__all__ = [
    "CompactReport",
    "ExportFormat",
    "ExportProgress",
    "ExportReport",
    "GradeFailure",
    "GradeReport",
    "ImportReport",
    "ReduceReport",
    "VacuumReport",
    "Verdict",
    "VerifierCounts",
    "VerifierCtx",
    "break_lease",
    "compact",
    "export_live",
    "grade",
    "import_atif",
    "reduce",
    "vacuum",
]
