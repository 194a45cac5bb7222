"""Running the app under uvicorn: in the foreground (``ninfer serve``) or on a thread (tests, embedding).

uvicorn picks uvloop when it is installed (``loop="auto"``) and its h11 HTTP/1.1 implementation.
"""

from __future__ import annotations

import contextlib
import threading
import time

import uvicorn
from fastapi import FastAPI

# seconds a stopping server lets open connections finish before it closes them
GRACEFUL_SHUTDOWN_S = 5
STARTUP_FAILURE = 3  # uvicorn's exit status when the server cannot start (e.g. the port is taken)


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    """The one uvicorn configuration both ways of serving use."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="auto",
        log_level=log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


def serve_forever(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve until interrupted (SIGINT/SIGTERM stop it gracefully; the app closes its Engine). Exits with
    uvicorn's startup-failure status (3) when the server could not start, as ``uvicorn.run`` does."""
    server = uvicorn.Server(uvicorn_config(app, host, port, log_level))
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        raise SystemExit(STARTUP_FAILURE)


class BackgroundServer:
    """uvicorn on a daemon thread. ``start()`` returns once the socket listens; port 0 picks a free one."""

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        self.server = uvicorn.Server(uvicorn_config(app, host, port, log_level))
        self.host = host
        self.port = port
        self._thread = threading.Thread(target=self.server.run, name="ninfer-serve-http", daemon=True)

    def start(self, timeout: float = 60.0) -> str:
        """Start serving; returns the base URL (``http://host:port``)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server thread exited during startup (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP server did not start within {timeout} s")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self.url

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
