"""Bounds on the work one request may cause before it reaches the Engine, and on how long a client may
take to send it.

- ``RequestLimits``: body bytes (413 before anything is parsed), JSON nesting depth, items per list or
  object, and objects/lists per body (400 naming the field).
- ``parse_json_body``: parse, check those bounds and validate against the route's pydantic model in one
  call, which the route runs on a worker thread for large bodies, so the event loop (``/health`` and every
  other request) never waits for one request's parsing.
- ``BodyGuardMiddleware``: the body size limit (413 in the OpenAI error shape: Starlette's own body
  limit answers in plain text), and a body must arrive within ``body_timeout_s`` of its headers (408,
  connection closed). The header deadline and the connection cap live in ``server.py`` (uvicorn's
  protocol and ``limit_concurrency``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ninfer.serve.errors import ServeError

MIB = 1 << 20
# bodies up to this size are parsed on the event loop: a thread hop costs more than parsing them
INLINE_PARSE_BYTES = 64 << 10


@dataclass(frozen=True)
class RequestLimits:
    """Defaults are far beyond any real request (a 262,144-token prompt as token ids is ~1.8 MB of JSON, a
    deep tool schema ~15 levels) and small enough that parsing and validating the largest allowed body
    takes well under a second of one core."""

    max_body_bytes: int = 32 * MIB
    max_json_depth: int = 64
    max_items: int = 1 << 20  # per list or object
    max_containers: int = 1 << 16  # objects and lists in one body (parsing and pydantic cost grow with them)
    max_values: int = 1 << 23  # values in lists and objects of one body, counted before parsing
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_connections: int = 512

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_json_depth",
            "max_items",
            "max_containers",
            "max_values",
            "max_connections",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")


def json_path(path: Sequence[str | int]) -> str:
    """``("tools", 0, "function")`` -> ``tools[0].function`` (the form error messages use)."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def check_json_shape(value: Any, limits: RequestLimits) -> None:
    """Refuse (400, ``param`` the offending field's path) nesting deeper than ``max_json_depth``, a list
    or object of more than ``max_items`` entries, or more than ``max_containers`` lists and objects. Walks
    without recursion, so any depth orjson accepts is refused cleanly."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    containers = 0
    while stack:
        node, path = stack.pop()
        containers += 1
        where = json_path(path)
        if len(path) >= limits.max_json_depth:
            raise _shape_error(f"{where}: nested deeper than {limits.max_json_depth} levels", path)
        if containers > limits.max_containers:
            raise _shape_error(
                f"{where}: the body holds more than {limits.max_containers} objects and lists; send fewer",
                path,
            )
        if len(node) > limits.max_items:
            raise _shape_error(
                f"{where}: {len(node)} entries, more than the {limits.max_items} one list or object may hold",
                path,
            )
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(child, (dict, list)):
                stack.append((child, (*path, key)))


def _shape_error(message: str, path: tuple[str | int, ...]) -> ServeError:
    return ServeError(400, message, code="invalid_request", param=json_path(path))


# a JSON string (unrolled, so a long string is one fast scan); what is left is the document's structure
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def check_json_size(body: bytes, limits: RequestLimits) -> None:
    """Refuse, before parsing, a body with more lists and objects or more values than the limits allow:
    the parser holds the GIL while it builds them (a million one-item lists take it for a second).
    Counting brackets and commas is one pass; only when that count is over a limit are the strings taken
    out (their brackets and commas are text) and the structure counted exactly."""
    if body.count(b"[") + body.count(b"{") <= limits.max_containers and body.count(b",") < limits.max_values:
        return
    structure = _JSON_STRING.sub(b"", body)
    containers = structure.count(b"[") + structure.count(b"{")
    if containers > limits.max_containers:
        raise _shape_error(
            f"the body holds {containers} objects and lists, more than {limits.max_containers}; send fewer",
            (),
        )
    values = structure.count(b",") + 1
    if values > limits.max_values:
        raise _shape_error(
            f"the body holds about {values} values, more than {limits.max_values}; send fewer", ()
        )


def parse_json_body(body: bytes, model: type[BaseModel] | None, limits: RequestLimits) -> Any:
    """The body size-checked, parsed, shape-checked and (with ``model``) validated. Raises
    RequestValidationError (as FastAPI would: malformed JSON, schema violations) or ServeError (limits)."""
    check_json_size(body, limits)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([{**error, "ctx": {"error": exc.msg}}]) from None
    if isinstance(data, (dict, list)):
        check_json_shape(data, limits)
    if model is None:
        return data
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=True)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


def body_too_large(max_bytes: int) -> ServeError:
    return ServeError(
        413,
        f"the request body is larger than this server's limit of {max_bytes} bytes; send less, or start "
        "the server with a larger --max-body-bytes",
        code="body_too_large",
    )


class BodyGuardMiddleware:
    """A request body may hold at most ``max_bytes`` and must be complete within ``timeout_s`` of its
    headers. A ``Content-Length`` over the limit is answered 413 before the app runs (no byte read); a
    body that grows past it without one is cut off at the limit (413); a slower sender gets 408 and its
    connection is closed. Only body reads are bounded: once the body is in, ``receive`` (which streaming
    responses use to notice a disconnect) waits as long as the response lasts."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, timeout_s: float, on_reject: Callable[[str], None]
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            self.on_reject(scope["path"])
            await body_too_large(self.max_bytes).response()(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done, received = False, 0

        async def guarded_receive() -> Message:
            nonlocal body_done, received
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise ServeError(
                    408,
                    f"the request body did not arrive within {self.timeout_s:g} s of its headers; send it "
                    "faster (the server's --body-timeout)",
                    code="request_timeout",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    error = body_too_large(self.max_bytes)
                    error.headers["Connection"] = "close"  # the rest is not read
                    raise error
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, guarded_receive, send)
