"""The gateway context shared by all handlers, and ``EngineRun``: one submitted request as consumed here.

The gateway submits to the public Engine and reads the handle's async iterator on the server's event
loop. It never decides order, cache or lanes; it only maps events to the protocol and errors to HTTP.
A request whose client is gone is cancelled (``handle.cancel()``) and drained in the background, so
its metrics end when the Engine has released its lane.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio.to_thread

from ninfer.runtime.engine.engine import GenerationHandle
from ninfer.serve.errors import ServeError, from_engine_error
from ninfer.serve.host import EngineHost
from ninfer.serve.metrics import RequestTracker, ServeMetrics
from ninfer.types import (
    GenerationDelta,
    GenerationRequest,
    GenerationResult,
    GenerationStart,
    NInferError,
)

COUNTED_ENDPOINTS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/tokenizer_info"}
)


@dataclass(frozen=True)
class ServeConfig:
    """Gateway settings (the Engine's own settings live in ``EngineConfig``)."""

    model_name: str
    api_key: str | None = None
    retry_after_s: int = 1
    owned_by: str = "ninfer"


@dataclass
class Gateway:
    config: ServeConfig
    host: EngineHost
    metrics: ServeMetrics = field(default_factory=ServeMetrics)
    _drains: set[asyncio.Task[None]] = field(default_factory=set)

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is absent or the served name (OpenAI ``model_not_found``)."""
        if model is not None and model != self.config.model_name:
            raise ServeError(
                404,
                f"model {model!r} does not exist here; this server serves {self.config.model_name!r} "
                "(GET /v1/models lists it)",
                code="model_not_found",
                param="model",
            )

    def count(self, endpoint: str, outcome: str) -> None:
        """Count a request that never reached the Engine. Unknown paths share one label, so clients
        cannot grow the metric's label set."""
        label = endpoint if endpoint in COUNTED_ENDPOINTS else "other"
        self.metrics.requests.labels(label, outcome).inc()

    async def submit(self, request: GenerationRequest, endpoint: str) -> EngineRun:
        """Submit on a worker thread (the Frontend tokenizes and renders there); map rejections."""
        engine = self.host.engine()
        tracker = self.metrics.track(endpoint)
        try:
            handle = await anyio.to_thread.run_sync(engine.submit, request)
        except NInferError as exc:
            error = from_engine_error(exc, self.config.retry_after_s)
            tracker.finished(error.outcome)
            error.counted = True
            raise error from None
        tracker.queued()
        return EngineRun(handle, tracker, self)

    def keep(self, task: asyncio.Task[None]) -> None:
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)


class EngineRun:
    """One submitted Engine request: wait for admission, iterate events, or abandon it."""

    def __init__(self, handle: GenerationHandle, tracker: RequestTracker, gateway: Gateway) -> None:
        self.handle = handle
        self.tracker = tracker
        self._gateway = gateway
        self.start: GenerationStart | None = None
        self.result: GenerationResult | None = None
        self._closed = False

    async def wait_start(self) -> GenerationStart:
        """Wait for admission (``GenerationStart``); a terminal result instead raises its ServeError."""
        if self.start is not None:
            return self.start
        event = await self.handle.__anext__()
        if isinstance(event, GenerationStart):
            self.start = event
            self.tracker.started(event.prompt_tokens, event.reused_prefix_tokens)
            return event
        if isinstance(event, GenerationResult):
            self._end(event)
            raise self.error_of(event)
        raise RuntimeError(f"the Engine published {type(event).__name__} before GenerationStart")

    async def events(self) -> AsyncIterator[GenerationDelta | GenerationResult]:
        """Deltas, then the terminal result (after ``wait_start``)."""
        await self.wait_start()
        async for event in self.handle:
            if isinstance(event, GenerationDelta):
                self.tracker.tokens(len(event.token_ids))
                yield event
            elif isinstance(event, GenerationResult):
                self._end(event)
                yield event
                return

    async def collect(self) -> GenerationResult:
        """The terminal result of a request that is answered in one piece; errors raise."""
        async for event in self.events():
            if isinstance(event, GenerationResult):
                if event.error is not None or event.finish_reason in ("error", "cancelled"):
                    raise self.error_of(event)
                return event
        raise RuntimeError("the Engine ended a request without a result")

    def error_of(self, result: GenerationResult) -> ServeError:
        if result.error is not None:
            error = from_engine_error(result.error, self._gateway.config.retry_after_s)
        else:  # cancelled without our asking: the Engine is closing
            error = ServeError(
                503, "the server is shutting down; retry against another instance", code="engine_unavailable"
            )
        error.counted = True
        return error

    def _end(self, result: GenerationResult) -> None:
        self.result = result
        outcome = result.finish_reason
        if result.error is not None:
            outcome = from_engine_error(result.error, 0).outcome
        self.tracker.finished(outcome, result.usage)

    def close(self) -> None:
        """Abandon the request if it has not ended: cancel it at the Engine's next worker boundary and
        drain the rest in the background (the lane is free once the terminal result arrives)."""
        if self._closed:
            return
        self._closed = True
        if self.result is not None:
            self.handle.close()
            return
        self.handle.cancel()
        try:
            task = asyncio.get_running_loop().create_task(self._drain())
        except RuntimeError:  # no loop (shutdown): dropping the handle cancels and releases it
            self.handle.close()
            return
        self._gateway.keep(task)

    async def _drain(self) -> None:
        try:
            async for event in self.handle:
                if isinstance(event, GenerationStart):
                    self.tracker.started(event.prompt_tokens, event.reused_prefix_tokens)
                elif isinstance(event, GenerationResult):
                    self._end(event)
                    break
        finally:
            self.handle.close()
