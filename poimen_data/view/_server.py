"""Serving the viewer with Uvicorn: in the foreground for ``poimen view``, or on a thread
for tests and notebooks (``Server``), with the bound URL known once it listens (port 0
picks a free port)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import uvicorn


class _Uvicorn(uvicorn.Server):
    """A uvicorn server that reports once it listens (a rendezvous, never a sleep)."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[str], None]) -> None:
        super().__init__(config)
        self._on_ready = on_ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        url = ""
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            host = f"[{host}]" if ":" in host else host
            url = f"http://{host}:{port}/"
        self._on_ready(url)


def _config(app: Any, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                          access_log=False, server_header=False)


class Server:
    """The viewer served on a daemon thread: ``start()`` returns its URL once it listens;
    ``stop()`` shuts it down and waits for the thread."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._ready = threading.Event()
        self.url = ""

        def ready(url: str) -> None:
            self.url = url
            self._ready.set()

        self._server = _Uvicorn(_config(app, host, port), ready)
        self._thread = threading.Thread(target=self._server.run, name="poimen-view",
                                        daemon=True)

    def start(self, timeout: float = 60.0) -> str:
        self._thread.start()
        if not self._ready.wait(timeout) or not self.url:
            self.stop()
            raise RuntimeError("the viewer did not start listening")
        return self.url

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(30)

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(app: Any, *, host: str = "127.0.0.1", port: int = 0,
          on_ready: Callable[[str], None] | None = None) -> None:
    """Serve in the foreground until Ctrl-C; ``on_ready(url)`` runs once it listens
    (with an empty URL when it could not bind)."""
    _Uvicorn(_config(app, host, port), on_ready or (lambda url: None)).run()
