"""Shutdown does not stall the event loop while the Engine's worker drains, and both ways of running the
server (foreground, background thread) share one uvicorn configuration."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import pytest
from serve_helpers import MODEL, ScriptProgram, scripted_engine

from ninfer.serve import BackgroundServer, ServeConfig, create_app
from ninfer.serve.server import GRACEFUL_SHUTDOWN_S, serve_forever, uvicorn_config
from ninfer.targets.open import load_frontend

SLOW_CLOSE_S = 0.6


def test_app_shutdown_keeps_the_event_loop_running(tiny_artifact: Path) -> None:
    """The lifespan's Engine close (a worker join of up to 30 s) runs off the loop: a ticker on the loop
    keeps ticking while a deliberately slow close is under way."""
    frontend = load_frontend(str(tiny_artifact))
    engine = scripted_engine(ScriptProgram(max_context=64, page_size=16, kv_pages=16), frontend)
    real_close = engine.close
    close_threads: list[str] = []
    closing, ticked = threading.Event(), threading.Event()

    def slow_close(timeout: float = 30.0) -> None:
        close_threads.append(threading.current_thread().name)
        closing.set()
        ticked.wait(60)  # a blocked loop never ticks: then this waits it out and the assertion fails
        time.sleep(SLOW_CLOSE_S)  # stands in for joining a worker that finishes its last unit
        real_close(timeout)

    engine.close = slow_close  # type: ignore[method-assign]
    app = create_app(engine, ServeConfig(model_name=MODEL), frontend=frontend)

    async def main() -> None:
        async def ticker() -> None:
            while True:
                await asyncio.sleep(0.01)
                if closing.is_set():  # the loop runs while the close is under way
                    ticked.set()

        async with app.router.lifespan_context(app):
            tick = asyncio.ensure_future(ticker())
            await asyncio.sleep(0.05)
        tick.cancel()  # the lifespan's exit (the slow close) has finished here

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started >= SLOW_CLOSE_S  # the close did run, and was awaited
    assert close_threads and close_threads[0] != threading.main_thread().name
    assert ticked.is_set(), "the event loop stood still while the Engine closed"
    assert engine.availability.state == "closed"


def test_one_uvicorn_config_for_both_ways_of_serving(tiny_artifact: Path) -> None:
    frontend = load_frontend(str(tiny_artifact))
    app = create_app(
        scripted_engine(ScriptProgram(max_context=64, page_size=16, kv_pages=16), frontend),
        ServeConfig(model_name=MODEL),
        frontend=frontend,
    )
    config = uvicorn_config(app, "127.0.0.1", 0, "warning")
    background = BackgroundServer(app).server.config
    for field in ("host", "port", "loop", "log_level", "timeout_graceful_shutdown"):
        assert getattr(background, field) == getattr(config, field), field
    assert config.timeout_graceful_shutdown == GRACEFUL_SHUTDOWN_S and config.loop == "auto"
    # the foreground server exits nonzero when it cannot bind, as uvicorn.run did
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit) as info:
            serve_forever(app, "127.0.0.1", taken.getsockname()[1], log_level="critical")
    assert info.value.code not in (0, None)
