"""Server-sent events and client-disconnect detection.

A client that goes away must cancel its Engine request at once, not when the next token would have been
written: ``EventStreamResponse`` listens for ``http.disconnect`` while it streams (independent of the
ASGI spec version the server speaks) and calls ``on_close`` however the stream ends. Non-streaming
handlers race their work against ``wait_disconnect``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ninfer.types import GenerationDelta, GenerationResult

if TYPE_CHECKING:
    from ninfer.serve.gateway import EngineRun

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: Any) -> bytes:
    """One ``data:`` event (orjson output never contains a raw newline)."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (the request body must already have been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; raise ``ClientGone`` (after cancelling it) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def all_or_none(works: Iterable[Awaitable[T]]) -> list[T]:
    """``asyncio.gather`` that cancels the rest as soon as one fails (or the caller is cancelled)."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


class EventStreamResponse(Response):
    """``text/event-stream`` from an async iterator of encoded events, cancelled on client disconnect."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    await send(
                        {
                            "type": "http.response.start",
                            "status": self.status_code,
                            "headers": self.raw_headers,
                        }
                    )
                    async for chunk in self.events:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    await wait_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch)
        finally:
            self.on_close()
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


async def merged(runs: Sequence[EngineRun]) -> AsyncIterator[tuple[int, GenerationDelta | GenerationResult]]:
    """Events of several runs as they arrive, tagged with the run's index; ends after every result."""
    if len(runs) == 1:
        async for event in runs[0].events():
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, GenerationDelta | GenerationResult | BaseException]] = asyncio.Queue()

    async def pump(index: int, run: EngineRun) -> None:
        try:
            async for event in run.events():
                queue.put_nowait((index, event))
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(runs)]
    try:
        remaining = len(runs)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, GenerationResult):
                remaining -= 1
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
