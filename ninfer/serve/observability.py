"""Request ids and the server's log lines (``ninfer serve``).

Every HTTP request gets an id: the client's ``X-Request-Id`` when it is a usable one (1..128 characters
of ``A-Z a-z 0-9 . _ : @ / + = ~ -``), else a fresh one (32 hex digits). `RequestIdMiddleware`, the
outermost layer, echoes it as the ``X-Request-Id`` response header on every answer (errors, 401s, 413s
and streams included) and keeps it in a context variable for the request's life, from which error
bodies (``error.request_id``) and the request's log lines take it.

Log lines are ``event key=value ...`` on the ``ninfer.serve`` logger: the Engine's state changes while it
loads and the ``ready`` line at info; every ``interval_s`` while requests are in flight (or tokens moved
since the last line) one ``load`` line with throughput, queue and KV use at info; one ``request`` line
per finished request at debug, with its id.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import sys
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from ninfer.serve.host import EngineHost
    from ninfer.serve.metrics import ServeMetrics

log = logging.getLogger("ninfer.serve")

REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=~-]{1,128}")
current_request_id: ContextVar[str | None] = ContextVar("ninfer_request_id", default=None)
LOAD_INTERVAL_S = 10.0
STATE_POLL_S = 0.5


def request_id_of(header: str | None) -> str:
    """The client's id when it is usable as one, else a fresh one."""
    if header is not None and _REQUEST_ID.fullmatch(header):
        return header
    return secrets.token_hex(16)


class RequestIdMiddleware:
    """Give every HTTP request an id, echo it in the ``X-Request-Id`` response header and hold it in
    `current_request_id` while the request runs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(Headers(scope=scope).get(REQUEST_ID_HEADER))
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        token = current_request_id.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)


def fields(**values: Any) -> str:
    """``key=value`` pairs of a log line (floats to 3 significant digits, ``None`` left out)."""
    out = []
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, float):
            value = f"{value:.3g}"
        out.append(f"{key}={value}")
    return " ".join(out)


def configure_logging(level: str) -> None:
    """The ``ninfer`` loggers on stderr at ``level`` (``ninfer serve --log-level``), beside uvicorn's."""
    logger = logging.getLogger("ninfer")
    if not any(getattr(h, "_ninfer_serve", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler._ninfer_serve = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def kv_used(engine: Any) -> float | None:
    """The fraction of the Engine's KV pages in use (by requests or held by cached checkpoints), or
    ``None`` (no Engine loaded, a scoring Engine, a Program that does not count its pages)."""
    usage = getattr(engine, "kv_cache_usage", None)
    return usage() if usage is not None else None


class LoadLog:
    """The Engine's state changes (``engine state=...``), the ``ready`` line, then a ``load`` line every
    ``interval_s`` while the server is busy. Runs as a task on the server's loop (`run`)."""

    def __init__(
        self,
        host: EngineHost,
        metrics: ServeMetrics,
        describe: Callable[[], dict[str, Any]],
        interval_s: float = LOAD_INTERVAL_S,
    ) -> None:
        self.host = host
        self.metrics = metrics
        self.describe = describe
        self.interval_s = interval_s
        self.started = time.monotonic()
        self._state: str | None = None
        self._last = (time.monotonic(), 0.0, 0.0, 0.0)

    def _totals(self) -> tuple[float, float, float]:
        value = self.metrics.registry.get_sample_value
        finished = sum(
            s.value
            for family in self.metrics.requests.collect()
            for s in family.samples
            if s.name.endswith("_total")
        )
        return (
            value("ninfer_generation_tokens_total") or 0.0,
            value("ninfer_prompt_tokens_total") or 0.0,
            finished,
        )

    def state_changed(self) -> str:
        """Log the Engine's state when it changed (``ready`` with what is served); returns the state."""
        status = self.host.status()
        if status.state != self._state:
            self._state = status.state
            if status.ready:
                log.info("ready %s", fields(load_s=time.monotonic() - self.started, **self.describe()))
            elif status.state == "failed":
                log.error("engine %s", fields(state=status.state, reason=repr(status.reason)))
            else:
                log.info("engine %s", fields(state=status.state))
        return status.state

    def tick(self) -> str | None:
        """The ``load`` line since the previous tick, when the server was busy (else ``None``)."""
        now = time.monotonic()
        generated, prompt, finished = self._totals()
        then, generated0, prompt0, finished0 = self._last
        self._last = (now, generated, prompt, finished)
        value = self.metrics.registry.get_sample_value
        running = value("ninfer_active_lanes") or 0.0
        waiting = value("ninfer_queue_depth") or 0.0
        if not (running or waiting or generated > generated0 or finished > finished0):
            return None
        elapsed = max(now - then, 1e-9)
        line = fields(
            gen_tok_s=(generated - generated0) / elapsed,
            prompt_tok_s=(prompt - prompt0) / elapsed,
            running=int(running),
            waiting=int(waiting),
            finished=int(finished - finished0),
            kv_used=kv_used(self.host.loaded),
        )
        log.info("load %s", line)
        return line

    async def run(self) -> None:
        while (state := self.state_changed()) != "ready":
            if state in ("failed", "closed"):
                return
            await asyncio.sleep(STATE_POLL_S)
        self._last = (time.monotonic(), *self._totals())
        while True:
            await asyncio.sleep(self.interval_s)
            if self.state_changed() in ("failed", "closed"):
                return
            self.tick()
