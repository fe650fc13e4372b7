"""The log layer: layout and manifests, the commit protocol (transactions, publish,
recovery, checkpoints), the blob store and the fault points of the crash tests.

Imports ``model`` and ``storage``; everything above reads the log through ``EventLog``.
"""

from __future__ import annotations

from poimen_data.log._blobs import BlobStore, FsBlobStore
from poimen_data.log._lease import LEASE, LEASE_TTL_S, Lease, lease, lease_holder
from poimen_data.log._log import EventLog, LogLike, as_log, commit_events, open_log
from poimen_data.log._manifest import BlobEntry, Manifest, SegmentInfo
from poimen_data.log._recorder import Recorder
from poimen_data.log._txn import CommitInfo, Transaction

__all__ = [
    "LEASE",
    "LEASE_TTL_S",
    "Lease",
    "BlobEntry",
    "BlobStore",
    "CommitInfo",
    "EventLog",
    "FsBlobStore",
    "LogLike",
    "Manifest",
    "Recorder",
    "SegmentInfo",
    "Transaction",
    "as_log",
    "commit_events",
    "lease",
    "lease_holder",
    "open_log",
]
