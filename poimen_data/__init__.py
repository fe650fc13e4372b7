"""poimen_data: the data layer of poimen.

Record agent-workflow runs as an append-only event log (Arrow IPC segments, a
content-addressed blob store, manifest commits on any fsspec storage), fold it into
episode tables with DuckDB, grade frozen snapshots, and export training data.
The layers, bottom up: ``model`` → ``storage`` → ``log`` → ``fold`` → ``jobs`` →
``workload`` → this face and ``bench``, which may import everything
(``docs/DESIGN.md``, "Layers").
"""

from __future__ import annotations

from poimen_data.errors import (
    CommitConflict,
    CommitUnknown,
    CorruptionError,
    LeaseHeld,
    NotFound,
    PoimenError,
    StateChanged,
    StorageError,
    TenantMismatch,
    ValidationError,
    WritersActive,
)
from poimen_data.fold import (
    AttemptView,
    BranchView,
    CheckReport,
    EpisodeView,
    MaterializeReport,
    Source,
    check,
    connect,
    episode,
    materialize,
)
from poimen_data.jobs import (
    CompactReport,
    ExportFormat,
    ExportProgress,
    ExportReport,
    GradeReport,
    ImportReport,
    ReduceReport,
    VacuumReport,
    Verdict,
    VerifierCtx,
    break_lease,
    compact,
    export_live,
    grade,
    import_atif,
    reduce,
    vacuum,
)
from poimen_data.log import (
    BlobStore,
    CommitInfo,
    EventLog,
    FsBlobStore,
    Recorder,
    Transaction,
    open_log,
)
from poimen_data.model import BlobRef, ContextPartition, ToolInfo, Usage

__all__ = [
    "AttemptView",
    "BlobRef",
    "BlobStore",
    "BranchView",
    "CheckReport",
    "CommitConflict",
    "CommitInfo",
    "CommitUnknown",
    "CompactReport",
    "ContextPartition",
    "CorruptionError",
    "EpisodeView",
    "EventLog",
    "ExportFormat",
    "ExportProgress",
    "ExportReport",
    "FsBlobStore",
    "GradeReport",
    "ImportReport",
    "LeaseHeld",
    "MaterializeReport",
    "NotFound",
    "PoimenError",
    "Recorder",
    "ReduceReport",
    "Source",
    "StateChanged",
    "StorageError",
    "TenantMismatch",
    "ToolInfo",
    "Transaction",
    "Usage",
    "VacuumReport",
    "ValidationError",
    "Verdict",
    "VerifierCtx",
    "WritersActive",
    "break_lease",
    "check",
    "compact",
    "connect",
    "episode",
    "export_live",
    "grade",
    "import_atif",
    "materialize",
    "open_log",
    "reduce",
    "vacuum",
]
