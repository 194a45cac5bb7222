"""Shutdown: the exit hook closes Engines whose worker still runs, close() is idempotent, and a closed
scoring Engine says so."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from engine_fixtures import make_engine
from scripted_frontend import ScriptedFrontend
from scripted_program import ScriptedProgram, ScriptedScoringProgram

from ninfer import Engine, EngineConfig, EngineFailed, GenerationRequest

ENGINE_TESTS = Path(__file__).resolve().parent
SUBPROCESS_TIMEOUT_S = 60.0

# The child streams one delta of a long request, then exits without closing anything. Its report hook
# is registered before the Engine module is imported, so (atexit runs last-in first-out) it runs after
# the Engine's exit hook.
EXIT_SCRIPT = textwrap.dedent(
    """
    import atexit, time
    state = {}

    def report():
        engine = state["engine"]
        worker = "worker alive" if engine.core.thread.is_alive() else "worker joined"
        print("at exit:", engine.availability.state, worker, flush=True)

    atexit.register(report)

    from engine_fixtures import make_engine
    from scripted_program import ScriptedProgram
    from ninfer import GenerationRequest
    from ninfer.types import GenerationDelta

    program = ScriptedProgram(max_concurrency=1, max_context=256, page_size=8, kv_pages=64, eos_period=0)
    program.on_execute = lambda kind, handles: time.sleep(0.005)  # each unit "on the GPU" for 5 ms
    program.on_release = lambda seq: print("released", flush=True)
    engine, _, _ = make_engine(program=program, start_worker=True, max_concurrency=1)
    state["engine"] = engine
    handle = engine.submit(GenerationRequest(prompt="abc", max_tokens=200, seed=1))
    next(e for e in handle if isinstance(e, GenerationDelta))
    print("exiting mid-request", flush=True)
    """
)


def test_exit_hook_closes_and_joins_a_running_worker() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ENGINE_TESTS), env.get("PYTHONPATH")) if p)
    child = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, env=env,
        timeout=SUBPROCESS_TIMEOUT_S, check=False,
    )
    assert child.returncode == 0, child.stderr
    # the request was cancelled and its sequence released by the worker before the interpreter finished
    expected = ["exiting mid-request", "released", "at exit: closed worker joined"]
    assert child.stdout.splitlines() == expected, (child.stdout, child.stderr)


def test_generation_engine_close_is_idempotent() -> None:
    program = ScriptedProgram(max_concurrency=2, max_context=64, page_size=4, kv_pages=64, eos_period=0)
    engine, program, _ = make_engine(program=program, start_worker=True, max_concurrency=2)
    handle = engine.submit(GenerationRequest(prompt="abc", max_tokens=40, seed=1))
    engine.close()
    engine.close()  # again: no error, nothing changes
    assert engine.availability.state == "closed" and not engine.core.thread.is_alive()
    assert handle.result(raise_on_error=False).finish_reason in ("cancelled", "length")
    threads = [threading.Thread(target=engine.close) for _ in range(3)]  # also from several threads
    for t in threads:
        t.start()
    for t in threads:
        t.join(SUBPROCESS_TIMEOUT_S)
    assert engine.availability.state == "closed"
    assert engine.core.outstanding == 0 and program.usage() == engine.core.baseline


def test_score_after_close_says_the_engine_is_closed() -> None:
    config = EngineConfig(purpose="causal_scoring", score_window=4, score_stride=2)
    engine = Engine.from_parts(ScriptedScoringProgram(), ScriptedFrontend(), config)
    assert len(engine.score(["abc"])[0].logprobs) == 3
    engine.close()
    engine.close()
    assert engine.availability.state == "closed"
    with pytest.raises(EngineFailed) as err:
        engine.score(["abc"])
    assert "closed" in err.value.message and "None" not in err.value.message


def test_close_without_a_worker_thread_cancels_an_active_request_at_the_next_boundary() -> None:
    """`close()` on an Engine stepped by hand takes the cancellations' signals on the closing thread
    (`settle_dropped_handles`); the next boundary's cancellation snapshot must still look, so the
    prefilling request runs no further unit."""
    from ninfer.runtime.engine.request_record import RequestState

    program = ScriptedProgram(max_concurrency=1, max_context=256, page_size=4, kv_pages=128, eos_period=0)
    engine, program, _ = make_engine(program=program, max_concurrency=1, prefill_chunk_tokens=4)
    handle = engine.submit(GenerationRequest(prompt="x" * 120, max_tokens=5, seed=1))
    for _ in range(4):
        engine.core.step()
    assert engine.core.snapshot().states[1] is RequestState.PREFILL
    calls_before = len(program.call_log)
    engine.close()
    for _ in range(10):
        if engine.core.idle:
            break
        engine.core.step()
    assert engine.core.idle
    assert handle.result(raise_on_error=False).finish_reason == "cancelled"
    assert "prefill" not in program.call_log[calls_before:]
