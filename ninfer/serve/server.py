"""Running the app under uvicorn: in the foreground (``ninfer serve``) or on a thread (tests, embedding).

uvicorn picks uvloop when it is installed (``loop="auto"``); HTTP/1.1 is uvicorn's h11 protocol with a
header deadline added (``guarded_h11``). The connection cap is uvicorn's ``limit_concurrency``: a request
on a connection beyond it gets uvicorn's plain 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from ninfer.serve.limits import RequestLimits

# seconds a stopping server lets open connections finish before it closes them
GRACEFUL_SHUTDOWN_S = 5
STARTUP_FAILURE = 3  # uvicorn's exit status when the server cannot start (e.g. the port is taken)


def guarded_h11(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose next request's headers are not complete within
    ``header_timeout_s``: from the connection's start, and again after each response (uvicorn's keep-alive
    timer stops at the first byte, so a client sending headers byte by byte would hold the connection
    forever). While a request is being answered no deadline runs."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.our_state is h11.SEND_RESPONSE:  # the headers are in: the app has the request
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # a pipelined request may have started already; otherwise the next headers are due
            if not self.transport.is_closing() and self.conn.our_state is not h11.SEND_RESPONSE:
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


def uvicorn_config(
    app: FastAPI, host: str, port: int, log_level: str, limits: RequestLimits | None = None
) -> uvicorn.Config:
    """The one uvicorn configuration both ways of serving use; ``limits`` defaults to the app's own
    (``create_app``'s ``ServeConfig.limits``)."""
    if limits is None:
        gateway = getattr(app.state, "gateway", None)
        limits = gateway.config.limits if gateway is not None else RequestLimits()
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="auto",
        http=guarded_h11(limits.header_timeout_s),
        limit_concurrency=limits.max_connections,
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
