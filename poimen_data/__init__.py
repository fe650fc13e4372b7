"""poimen_data: the data layer of poimen.

Record agent-workflow runs as an append-only event log (Arrow IPC segments, a
content-addressed blob store, manifest commits on any fsspec storage), fold it into
episode tables with DuckDB, grade frozen snapshots, and export training data.
"""

from __future__ import annotations

from poimen_data.errors import (
    CommitConflict,
    CorruptionError,
    LeaseHeld,
    NotFound,
    PoimenError,
    TenantMismatch,
    ValidationError,
)
from poimen_data.fold._fold import connect
from poimen_data.fold._query import AttemptView, BranchView, EpisodeView, check, episode
from poimen_data.fold._state import materialize
from poimen_data.jobs._export import ExportProgress, ExportReport, export_live
from poimen_data.jobs._grade import GradeReport, Verdict, VerifierCtx, grade
from poimen_data.jobs._maint import compact, reduce, vacuum
from poimen_data.log._blobs import BlobStore, FsBlobStore
from poimen_data.log._log import CommitInfo, EventLog, Transaction, open_log
from poimen_data.log._recorder import Recorder
from poimen_data.model._events import BlobRef, ContextPartition, ToolInfo, Usage

__all__ = [
    "AttemptView",
    "BlobRef",
    "BlobStore",
    "BranchView",
    "CommitConflict",
    "CommitInfo",
    "ContextPartition",
    "CorruptionError",
    "EpisodeView",
    "EventLog",
    "ExportProgress",
    "ExportReport",
    "FsBlobStore",
    "GradeReport",
    "LeaseHeld",
    "NotFound",
    "PoimenError",
    "Recorder",
    "TenantMismatch",
    "ToolInfo",
    "Transaction",
    "Usage",
    "ValidationError",
    "Verdict",
    "VerifierCtx",
    "check",
    "compact",
    "connect",
    "episode",
    "export_live",
    "grade",
    "materialize",
    "open_log",
    "reduce",
    "vacuum",
]
