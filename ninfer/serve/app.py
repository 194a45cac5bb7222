"""The FastAPI app factory: routes, API-key check, error shapes, metrics and the Engine's lifetime.

``create_app(engine_or_loader, config, frontend=...)`` builds an app around one Engine. Given a loader (a
callable returning an Engine), the app starts answering ``/health`` at once and loads the Engine on a
thread during startup; ``/ready`` turns 200 when the Engine reports itself ready.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar, cast

import anyio.to_thread
import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ninfer.runtime.engine.engine import Engine
from ninfer.serve.chat import ChatHandler
from ninfer.serve.completions import CompletionsHandler
from ninfer.serve.errors import ServeError, install_error_handlers
from ninfer.serve.gateway import Gateway, ServeConfig
from ninfer.serve.host import EngineHost, EngineSource, ServeFrontend
from ninfer.serve.limits import INLINE_PARSE_BYTES, BodyGuardMiddleware, RequestLimits, parse_json_body
from ninfer.serve.metrics import EngineView, ServeMetrics
from ninfer.serve.metrics_vllm import VllmAliases
from ninfer.serve.observability import REQUEST_ID_HEADER, LoadLog, RequestIdMiddleware, kv_used
from ninfer.serve.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    PrefixCacheReset,
    ReadyResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    VersionInfo,
)
from ninfer.serve.responses import JSONBody
from ninfer.serve.reuse import RESET_PATHS, reset_prefix_cache
from ninfer.serve.tokens import TokenHandlers
from ninfer.version import version

log = logging.getLogger("ninfer.serve")
T = TypeVar("T")

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in (
        (
            400,
            "malformed JSON, a schema violation, or a request the model cannot take (the message says "
            "what to change)",
        ),
        (401, "missing or wrong API key"),
        (408, "the request body arrived too slowly (--body-timeout)"),
        (413, "the request body is larger than the server's limit (--max-body-bytes)"),
        (404, "unknown model name"),
        (429, "the Engine queue is full (see Retry-After)"),
        (503, "the Engine is loading, failed, or the request waited past the queue timeout"),
    )
}


class ORJSONRequest(Request):
    """Request bodies parsed by orjson: NaN/Infinity and lone surrogates are malformed JSON (400)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


def _is_json(content_type: str | None) -> bool:
    """FastAPI's own test of a JSON body (``application/json`` or ``application/*+json``)."""
    if not content_type:
        return False
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def route_class(limits: RequestLimits) -> type[APIRoute]:
    """Routes whose JSON body is parsed, shape-checked (``limits``) and validated against the route's
    model before FastAPI sees it: on a worker thread once the body is large, so one request's parsing
    never stalls the event loop. FastAPI then receives the validated model, which pydantic passes through
    without validating it again."""

    class BoundedJSONRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            handler = super().get_route_handler()
            annotation = self.body_field.field_info.annotation if self.body_field is not None else None
            model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None

            async def route(request: Request) -> Response:
                request = ORJSONRequest(request.scope, request.receive)
                if self.body_field is not None and _is_json(request.headers.get("content-type")):
                    try:
                        body = await request.body()
                    except ClientDisconnect:  # gone while sending: nobody to answer, nothing to run
                        request.app.state.gateway.count(request.url.path, "cancelled")
                        return ServeError(499, "client closed the request").response()
                    if body:
                        parse = functools.partial(parse_json_body, body, model, limits)
                        big = len(body) > INLINE_PARSE_BYTES
                        request._json = await anyio.to_thread.run_sync(parse) if big else parse()
                return await handler(request)

            return route

    return BoundedJSONRoute


OPEN_PATHS = frozenset({"/health", "/ready"})
METRICS_PATH = "/metrics"


class APIKeyMiddleware:
    """``Authorization: Bearer KEY`` on every path except the probes (and ``/metrics`` when it is made
    public), checked before the body is read (constant-time comparison)."""

    def __init__(
        self, app: ASGIApp, api_key: str, on_reject: Callable[[str], None], open_paths: frozenset[str]
    ) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.on_reject = on_reject
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization", "")
        scheme, _, token = header.partition(" ")
        error: ServeError | None = None
        if scheme.lower() != "bearer" or not token.strip():
            error = ServeError(
                401,
                "missing API key: send the header 'Authorization: Bearer <key>'",
                code="missing_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        elif not hmac.compare_digest(token.strip().encode(), self.expected):
            error = ServeError(
                401,
                "invalid API key: check the key this server was started with",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if error is None:
            await self.app(scope, receive, send)
            return
        self.on_reject(scope["path"])
        await error.response()(scope, receive, send)


def create_app(
    source: EngineSource, config: ServeConfig, *, frontend: ServeFrontend | None = None
) -> FastAPI:
    """An OpenAI-compatible app serving one Engine (or a loader of one) under ``config.model_name``.

    ``frontend`` defaults to the Engine's own; a loader needs it given (``load_frontend(artifact)``) so
    the tokenizer endpoints work while the Engine loads.
    """
    if frontend is None:
        if not isinstance(source, Engine):
            raise TypeError("create_app(loader, ...) needs frontend=load_frontend(artifact)")
        frontend = cast(ServeFrontend, source.frontend)
    host = EngineHost(source, frontend, retry_after_s=config.retry_after_s)

    def engine_view() -> EngineView | None:
        """The loaded generation Engine's cache counters for /metrics (none while loading)."""
        engine = host.loaded
        if engine is None or engine.config.purpose != "generation":
            return None
        return EngineView(engine.cache_stats, engine.config.speculative, engine.capacity().kv_pool_tokens)

    gateway = Gateway(config, host, metrics=ServeMetrics(engine_view))

    def describe() -> dict[str, Any]:
        """What the ``ready`` log line says about the served Engine."""
        engine = host.loaded
        out: dict[str, Any] = {"model": config.model_name, "version": version()}
        if engine is not None:
            out.update(
                purpose=engine.config.purpose,
                max_context=engine.max_context,
                max_concurrency=engine.config.max_concurrency,
                device=engine.config.device,
            )
        return out

    load_log = LoadLog(host, gateway.metrics, describe, interval_s=config.log_interval_s)
    gateway.metrics.registry.register(
        VllmAliases(gateway.metrics, config.model_name, lambda: kv_used(host.loaded))
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        host.start()
        logging_task = asyncio.get_running_loop().create_task(load_log.run())
        try:
            yield
        finally:
            logging_task.cancel()
            await host.aclose()

    limits = config.limits
    app = FastAPI(
        title="NInfer",
        summary="OpenAI-compatible HTTP gateway over one NInfer Engine",
        version=version(),
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    install_error_handlers(app, gateway.count)

    async def counted(endpoint: str, work: Awaitable[T]) -> T:
        """Count errors raised before a request reached the Engine (after that, the run counts them)."""
        try:
            return await work
        except ServeError as exc:
            if not exc.counted:
                gateway.count(endpoint, exc.outcome)
            raise

    chat = ChatHandler(gateway)
    completions = CompletionsHandler(gateway)
    tokens = TokenHandlers(gateway)
    authed = APIRouter(route_class=route_class(limits), responses=ERRORS)

    @authed.post(
        "/v1/chat/completions",
        response_model=None,
        responses={
            200: {
                "model": ChatCompletionResponse,
                "description": "a chat completion, or with "
                "stream: true an event stream of ChatCompletionChunk",
                "content": {"text/event-stream": {"schema": ChatCompletionChunk.model_json_schema()}},
            }
        },
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await counted("/v1/chat/completions", chat(body, request))

    @authed.post(
        "/v1/completions",
        response_model=None,
        responses={
            200: {
                "model": CompletionResponse,
                "description": "a completion, or with stream: true an "
                "event stream of CompletionResponse chunks",
            }
        },
    )
    async def create_completions(body: CompletionRequest, request: Request) -> Response:
        return await counted("/v1/completions", completions(body, request))

    # exclude_unset: the scoring fields appear only on a causal_scoring server's card
    @authed.get("/v1/models", response_model=ModelList, response_model_exclude_unset=True)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in gateway.model_names]}

    @authed.get("/v1/models/{model}", response_model=ModelCard, response_model_exclude_unset=True)
    async def get_model(model: str) -> dict[str, Any]:
        gateway.check_model(model)
        return model_card(model)

    @authed.get("/version", response_model=VersionInfo)
    async def get_version() -> dict[str, Any]:
        """NInfer's version (``ninfer --version``)."""
        return {"version": version()}

    @authed.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await counted("/tokenize", tokens.tokenize(body))

    @authed.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await counted("/detokenize", tokens.detokenize(body))

    @authed.get("/tokenizer_info", response_model=TokenizerInfo)
    async def tokenizer_info() -> dict[str, Any]:
        return tokens.tokenizer_info()

    async def reset_cache(request: Request) -> dict[str, Any]:
        """Drop every cached prefix checkpoint not in use by a running request; answers how many were
        dropped (`dropped`) and how many the Engine still holds (`checkpoints`: those in use)."""
        return await counted(request.url.path, reset_prefix_cache(host))

    for path in RESET_PATHS:  # vLLM's name and SGLang's
        authed.add_api_route(path, reset_cache, methods=["POST"], response_model=PrefixCacheReset)

    started = int(time.time())

    def model_card(name: str) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": name,
            "object": "model",
            "created": started,
            "owned_by": config.owned_by,
            "max_model_len": host.max_context,  # a scoring Engine's context is its window
        }
        scoring = host.scoring_window
        if scoring is not None:
            card["score_window"], card["score_stride"] = scoring
        return card

    @app.get("/health", response_model=ReadyResponse)
    async def health() -> dict[str, Any]:
        """The process is alive (the Engine may still be loading)."""
        return {"status": "ok"}

    @app.get("/ready", response_model=ReadyResponse, responses={503: {"model": ReadyResponse}})
    async def ready() -> Response:
        """200 only while the Engine is available; 503 while loading, warming up, failed or closed."""
        status = host.status()
        body = {"status": status.state, "reason": status.reason}
        return JSONBody(body, status_code=200 if status.ready else 503)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        gateway.metrics.engine_ready.set(1 if host.status().ready else 0)
        return Response(gateway.metrics.exposition(), media_type=gateway.metrics.content_type)

    app.include_router(authed)
    if config.api_key is not None:
        app.add_middleware(
            APIKeyMiddleware,
            api_key=config.api_key,
            on_reject=lambda path: gateway.count(path, "unauthorized"),
            open_paths=OPEN_PATHS | ({METRICS_PATH} if config.public_metrics else set()),
        )
    app.add_middleware(  # the size and time bounds run from the headers, before the key check
        BodyGuardMiddleware,
        max_bytes=limits.max_body_bytes,
        timeout_s=limits.body_timeout_s,
        on_reject=lambda path: gateway.count(path, "invalid"),
    )
    if config.allowed_origins:  # before the key check: a browser's preflight carries no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=[REQUEST_ID_HEADER, "Retry-After"],
            max_age=600,
        )
    # outermost, outside Starlette's own error layer too: every answer carries its X-Request-Id, a 500
    # from an unforeseen error included
    build_stack = app.build_middleware_stack
    app.build_middleware_stack = lambda: RequestIdMiddleware(build_stack())  # type: ignore[method-assign]
    return app
