"""The gateway context shared by all handlers, and ``EngineRun``: one submitted request as consumed here.

The gateway submits to the public Engine and reads the handle's async iterator on the server's event
loop. It never decides order, cache or lanes; it only maps events to the protocol and errors to HTTP.
A request whose client is gone is cancelled (``handle.cancel()``) and drained in the background, so
its metrics end when the Engine has released its lane.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio.to_thread

from ninfer.runtime.engine.engine import GenerationHandle
from ninfer.serve.convert import check_prompt_size, engine_param
from ninfer.serve.errors import ServeError, from_engine_error
from ninfer.serve.host import EngineHost
from ninfer.serve.images import ImageInput
from ninfer.serve.limits import RequestLimits
from ninfer.serve.metrics import RequestTracker, ServeMetrics
from ninfer.serve.observability import current_request_id, fields
from ninfer.types import (
    GenerationDelta,
    GenerationRequest,
    GenerationResult,
    GenerationStart,
    NInferError,
)

log = logging.getLogger("ninfer.serve")

COUNTED_ENDPOINTS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/reset_prefix_cache",
        "/flush_cache",
        "/version",
    }
)


@dataclass(frozen=True)
class ServeConfig:
    """Gateway settings (the Engine's own settings live in ``EngineConfig``).

    ``api_key`` ``None`` serves without authentication; an empty or blank key, or one with whitespace or
    control characters (which no ``Authorization`` header could carry), is a ValueError rather than a
    server nobody, or everybody, can use. ``public_metrics`` serves ``/metrics`` without the key.
    ``images``: where image_url parts may come from (default: ``data:`` URLs only) and their limits.
    """

    model_name: str
    api_key: str | None = None
    retry_after_s: int = 1
    owned_by: str = "ninfer"
    limits: RequestLimits = field(default_factory=RequestLimits)
    public_metrics: bool = False
    images: ImageInput = field(default_factory=ImageInput)  # image_url parts (ninfer.serve.images)
    model_aliases: tuple[str, ...] = ()  # more names clients may send as `model` (--served-model-name a b)
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call the API ("*": any)
    log_interval_s: float = 10.0  # seconds between two `load` log lines while busy

    def __post_init__(self) -> None:
        if self.api_key is not None:
            check_api_key(self.api_key)


def check_api_key(key: str) -> None:
    """ValueError unless ``key`` is a usable bearer token: non-empty, printable ASCII, no spaces."""
    if not key.strip():
        raise ValueError(
            "the API key is empty or blank; give a real key, or leave --api-key and $NINFER_API_KEY unset "
            "to serve without one"
        )
    bad = sorted({c for c in key if not 0x21 <= ord(c) <= 0x7E})
    if bad:
        raise ValueError(
            f"the API key contains {', '.join(repr(c) for c in bad[:4])}: a key must be printable ASCII "
            "without spaces, as clients send it in the header 'Authorization: Bearer <key>'"
        )


@dataclass
class Gateway:
    config: ServeConfig
    host: EngineHost
    metrics: ServeMetrics = field(default_factory=ServeMetrics)
    _drains: set[asyncio.Task[None]] = field(default_factory=set)

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is absent or the served name (OpenAI ``model_not_found``)."""
        if model is not None and model not in self.model_names:
            raise ServeError(
                404,
                f"model {model!r} does not exist here; this server serves {self.config.model_name!r} "
                "(GET /v1/models lists it)",
                code="model_not_found",
                param="model",
            )

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the served model answers to; the first is the one answers report."""
        return (self.config.model_name, *self.config.model_aliases)

    def count(self, endpoint: str, outcome: str) -> None:
        """Count a request that never reached the Engine. Unknown paths share one label, so clients
        cannot grow the metric's label set."""
        label = endpoint if endpoint in COUNTED_ENDPOINTS else "other"
        self.metrics.requests.labels(label, outcome).inc()
        log.debug("request %s", fields(id=current_request_id.get(), endpoint=endpoint, outcome=outcome))

    async def submit(self, request: GenerationRequest, endpoint: str, param: str) -> EngineRun:
        """Submit on a worker thread (the size bound is checked and the Frontend tokenizes and renders
        there, never on the event loop); map rejections. ``param`` names the request's input in errors
        (``messages``, ``prompt``, ``prompt[2]`` for a batch element, which also prefixes the message)."""
        engine = self.host.engine()
        tracker = self.metrics.track(endpoint)

        def prepare_and_submit() -> GenerationHandle:
            check_prompt_size(self.host.frontend, request, engine.max_context, param)
            return engine.submit(request)

        try:
            handle = await anyio.to_thread.run_sync(prepare_and_submit)
        except ServeError as error:
            tracker.finished(error.outcome)
            error.counted = True
            raise
        except NInferError as exc:
            error = self.engine_error(exc, param)
            tracker.finished(error.outcome)
            error.counted = True
            raise error from None
        tracker.queued()
        return EngineRun(handle, tracker, self, param)

    def engine_error(self, exc: NInferError, param: str) -> ServeError:
        """An Engine error as the HTTP answer, naming the field it is about (``engine_param``)."""
        error = from_engine_error(exc, self.config.retry_after_s, engine_param(exc, param))
        if "[" in param and error.param is not None:  # a batch element: say which
            error.message = f"{param}: {error.message}"
        return error

    def keep(self, task: asyncio.Task[None]) -> None:
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)


class EngineRun:
    """One submitted Engine request: wait for admission, iterate events, or abandon it."""

    def __init__(
        self, handle: GenerationHandle, tracker: RequestTracker, gateway: Gateway, param: str
    ) -> None:
        self.handle = handle
        self.tracker = tracker
        self._gateway = gateway
        self._param = param
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
            error = self._gateway.engine_error(result.error, self._param)
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
