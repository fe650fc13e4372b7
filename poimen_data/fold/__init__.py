"""The fold layer: the fold as SQL text (views), DuckDB connections over the log,
materialized parquet state, and episode views.

Imports ``model``, ``storage`` and ``log``; ``jobs`` and the face build on it.
"""

from __future__ import annotations

from poimen_data.fold._check import CheckReport, check
from poimen_data.fold._connect import connect
from poimen_data.fold._fold import FOLD_VERSION, VIEW_SQL, VIEWS, Source, view_sql
from poimen_data.fold._query import AttemptView, BranchView, EpisodeView, episode
from poimen_data.fold._state import MaterializeReport, materialize

__all__ = [
    "FOLD_VERSION",
    "VIEWS",
    "VIEW_SQL",
    "AttemptView",
    "BranchView",
    "CheckReport",
    "EpisodeView",
    "MaterializeReport",
    "Source",
    "check",
    "connect",
    "episode",
    "materialize",
    "view_sql",
]
