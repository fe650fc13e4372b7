"""``poimen view``: a local web app to browse runs, episodes and attempts, and run SQL.

The face layer: it reads the log through the public API (``open_log``, ``connect``,
``episode``, ``log.blobs``) and never writes to it.
"""

from __future__ import annotations

from poimen_data.view._app import create_app
from poimen_data.view._server import Server, serve

__all__ = ["Server", "create_app", "serve"]
