"""Product errors in the OpenAI error shape, and the mapping from Engine errors to HTTP statuses.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` and its message says what the
client should change. The Engine decides *whether* a request fails (``RequestRejected`` kinds,
``EngineFailed``); the gateway only chooses the status code and headers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from ninfer.serve.observability import current_request_id
from ninfer.types import EngineFailed, NInferError, RequestFailed, RequestRejected

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    408: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_error",
    503: "service_unavailable_error",
}

# RequestRejected.kind -> (status, OpenAI-style code)
REJECT_STATUS: dict[str, tuple[int, str]] = {
    "context_too_long": (400, "context_length_exceeded"),
    "invalid_request": (400, "invalid_request"),
    "infeasible": (400, "request_too_large"),
    "wrong_purpose": (400, "wrong_purpose"),
    "overload": (429, "queue_full"),
    "queue_timeout": (503, "queue_timeout"),
}


class ServeError(Exception):
    """An error the gateway answers with ``status`` and the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        self.counted = False  # a RequestTracker already counted this outcome in the metrics

    @property
    def outcome(self) -> str:
        """The metrics label of a request that ended with this error."""
        if self.code in ("queue_full", "queue_timeout", "engine_failed", "engine_unavailable"):
            return self.code
        if self.status == 499:
            return "cancelled"
        return "invalid" if self.status < 500 else "error"

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code, param=self.param)

    def response(self) -> Response:
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    error: dict[str, Any] = {"message": message, "type": kind, "param": param, "code": code}
    request_id = current_request_id.get()
    if request_id is not None:  # the X-Request-Id of the answer (ninfer.serve.observability)
        error["request_id"] = request_id
    return {"error": error}


def from_engine_error(exc: NInferError, retry_after_s: int, param: str | None = None) -> ServeError:
    """Map an Engine error to its HTTP answer (429 and queue timeouts carry ``Retry-After``); ``param``
    is the request field it is about, when the gateway knows it."""
    if isinstance(exc, RequestRejected):
        status, code = REJECT_STATUS.get(exc.kind, (400, exc.kind))
        headers = {"Retry-After": str(retry_after_s)} if status in (429, 503) else None
        return ServeError(status, exc.message, code=code, param=param, headers=headers)
    if isinstance(exc, EngineFailed):
        return ServeError(
            503,
            f"{exc.message}. The server cannot serve until it is restarted; check its log.",
            code="engine_failed",
        )
    if isinstance(exc, RequestFailed):  # this request's output processing failed; the server is fine
        return ServeError(500, f"{exc.message}. Other requests are unaffected.", code="output_error")
    return ServeError(500, f"{type(exc).__name__}: {exc}", code="internal_error")


def _location(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) if parts else "body"


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """A readable message naming each offending field, and the first field (OpenAI ``param``)."""
    lines = []
    first: str | None = None
    for err in errors[:8]:
        where = _location(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            lines.append(f"the body is not valid JSON ({detail}); send a JSON object")
            continue
        first = first or where
        if err.get("type") == "extra_forbidden":  # a closed list: a field NInfer does not take is refused
            lines.append(
                f"{where}: unknown field; this endpoint does not take it (docs/cli-and-http.md lists the "
                "fields it takes); remove it"
            )
            continue
        lines.append(f"{where}: {err.get('msg', 'invalid value')}")
    if len(errors) > 8:
        lines.append(f"... and {len(errors) - 8} more problems")
    return "; ".join(lines), first


def install_error_handlers(app: FastAPI, count: Callable[[str, str], None]) -> None:
    """Route schema violations (FastAPI's 422), HTTP errors, gateway errors and anything unexpected to
    the OpenAI shape; ``count(endpoint, outcome)`` records requests refused before any handler ran."""

    async def on_serve_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServeError)
        return exc.response()

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message, param = validation_message(exc.errors())
        count(request.url.path, "invalid")
        return ServeError(400, message, code="invalid_request", param=param).response()

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        headers = dict(exc.headers or {})
        return ServeError(exc.status_code, str(exc.detail), headers=headers).response()

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        count(request.url.path, "error")  # uvicorn logs the traceback (Starlette re-raises after this)
        message = f"internal error: {type(exc).__name__}: {exc}"
        return ServeError(500, message, code="internal_error").response()

    app.add_exception_handler(ServeError, on_serve_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
