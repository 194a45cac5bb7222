"""Threaded mode: the real worker thread against several consumer threads and asyncio consumers."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
from engine_fixtures import make_engine
from scripted_program import ScriptedProgram, next_token

from ninfer import EngineFailed, GenerationRequest
from ninfer.types import GenerationDelta, GenerationResult, GenerationStart

# hang guards, not speed limits: every wait below ends on an event long before them on any machine
TIMEOUT_S = 300.0
DEADLOCK_JOIN_S = 120.0  # a gc.collect() of one handle takes milliseconds; a deadlock never ends


def expected(seed: int, prompt: bytes, n: int) -> tuple[int, ...]:
    out, prev = [], prompt[-1]
    for i in range(n):
        prev = next_token(seed, len(prompt) + i, prev, 0)
        out.append(prev)
    return tuple(out)


def _engine(**kw):
    program = ScriptedProgram(max_concurrency=3, max_context=128, page_size=8, kv_pages=24, eos_period=0,
                              spec_k=kw.pop("spec_k", 1))
    return make_engine(program=program, start_worker=True, max_concurrency=3, queue_capacity=32,
                       prefill_chunk_tokens=4, **kw)


def test_warmup_then_many_consumer_threads() -> None:
    engine, program, _ = _engine(warmup=True)
    assert engine.availability.state == "ready"
    assert program.calls["start"] == 1  # the warmup request ran through the public path
    failures: list[BaseException] = []

    def consumer(worker: int) -> None:
        try:
            for j in range(3):
                seed = 100 * worker + j
                prompt = f"thread {worker} request {j}".encode()
                events = list(engine.submit(GenerationRequest(prompt=list(prompt), max_tokens=12, seed=seed)))
                assert isinstance(events[0], GenerationStart)
                assert isinstance(events[-1], GenerationResult)
                streamed = tuple(t for e in events if isinstance(e, GenerationDelta) for t in e.token_ids)
                assert streamed == events[-1].token_ids == expected(seed, prompt, 12)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            failures.append(exc)

    threads = [threading.Thread(target=consumer, args=(w,)) for w in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures
    engine.close()
    assert not engine.core.thread.is_alive()
    assert engine.availability.state == "closed"
    assert program.usage() == engine.core.baseline and engine.core.outstanding == 0


def test_async_iteration_on_the_same_handles() -> None:
    engine, program, _ = _engine(spec_k=2)

    async def consume(seed: int) -> tuple[int, ...]:
        handle = engine.submit(GenerationRequest(prompt="async", max_tokens=10, seed=seed))
        tokens: list[int] = []
        async for event in handle:
            if isinstance(event, GenerationDelta):
                tokens.extend(event.token_ids)
        final = await handle.aresult()
        assert tuple(tokens) == final.token_ids
        return final.token_ids

    async def main() -> list[tuple[int, ...]]:
        return await asyncio.wait_for(asyncio.gather(*(consume(s) for s in range(6))), TIMEOUT_S)

    results = asyncio.run(main())
    assert results == [expected(s, b"async", 10) for s in range(6)]
    engine.close()
    assert program.usage() == engine.core.baseline


def test_cancel_from_another_thread_while_streaming() -> None:
    engine, program, _ = _engine()
    cancel_sent = threading.Event()
    units = [0]

    def on_execute(kind: str, handles: object) -> None:
        units[0] += 1
        if units[0] == 5:  # hold the 5th unit "on the GPU" until the cancellation arrived
            assert cancel_sent.wait(TIMEOUT_S)

    program.on_execute = on_execute
    handle = engine.submit(GenerationRequest(prompt="long", max_tokens=100, seed=1))

    def cancel() -> None:
        handle.cancel()
        cancel_sent.set()

    seen: list[object] = []
    for event in handle:
        seen.append(event)
        if isinstance(event, GenerationDelta) and not cancel_sent.is_set() and len(seen) == 2:
            threading.Thread(target=cancel).start()
    result = seen[-1]
    assert isinstance(result, GenerationResult) and result.finish_reason == "cancelled"
    # the unit that ran during the cancellation committed a cancelled row: 4 tokens, none after
    assert result.token_ids == expected(1, b"long", 4)
    engine.close()
    assert program.usage() == engine.core.baseline


def test_close_cancels_outstanding_requests_and_refuses_new_ones() -> None:
    engine, program, _ = _engine()
    closing = threading.Event()
    program.on_execute = lambda kind, handles: closing.wait(TIMEOUT_S)
    handles = [engine.submit(GenerationRequest(prompt="x", max_tokens=120, seed=s)) for s in range(6)]
    engine.core.close()
    closing.set()
    engine.close()
    assert not engine.core.thread.is_alive()
    reasons = [h.result(TIMEOUT_S).finish_reason for h in handles]
    assert reasons == ["cancelled"] * 6
    try:
        engine.submit(GenerationRequest(prompt="y"))
    except EngineFailed as err:
        assert "closed" in err.message
    else:
        raise AssertionError("submit after close must fail")
    assert program.usage() == engine.core.baseline


@pytest.mark.parametrize("held", ["engine lock", "channel lock"])
def test_handle_collected_by_the_cycle_gc_inside_a_lock_does_not_deadlock(held: str) -> None:
    """The cycle collector may finalize a dropped handle on any thread at any allocation, also one that
    holds the Engine's or the channel's (non-reentrant) lock. The finalizer takes no lock: it only queues
    the request id, and the worker releases the consumer side at its next boundary."""
    engine, program, _ = make_engine(
        program=ScriptedProgram(max_concurrency=1, max_context=64, page_size=4, kv_pages=64, eos_period=0),
        max_concurrency=1,
    )
    handle = engine.submit(GenerationRequest(prompt="abc", max_tokens=20, seed=1))
    engine.core.step()
    channel = handle._channel
    lock = engine.core.ingress.lock if held == "engine lock" else channel._lock
    gc.disable()  # the cycle must be collected inside the lock, not by an automatic collection before
    try:
        handle.cycle = handle  # type: ignore[attr-defined]  # only the cycle collector can free it now
        del handle

        def collect_holding_the_lock() -> None:
            with lock:
                gc.collect()

        collector = threading.Thread(target=collect_holding_the_lock, daemon=True)
        collector.start()
        collector.join(DEADLOCK_JOIN_S)
    finally:
        gc.enable()
    assert not collector.is_alive(), f"the handle's finalizer deadlocked on the {held}"
    assert not channel.consumer_released  # only a signal so far
    engine.core.step()
    assert channel.consumer_released and channel.cancel_requested
    while not engine.core.idle:
        engine.core.step()
    assert channel.final is not None and channel.final.finish_reason == "cancelled"
    assert channel.capacity_release_count == 1 and engine.core.outstanding == 0
    assert program.usage() == engine.core.baseline


def test_idle_worker_wakes_to_release_a_collected_handle() -> None:
    """A finished request whose consumer never read the result holds capacity until its handle goes;
    the finalizer's signal wakes the sleeping worker, which releases it exactly once."""
    engine, program, _ = _engine()
    handle = engine.submit(GenerationRequest(prompt="abc", max_tokens=3, seed=1))
    channel = handle._channel
    released = threading.Event()
    release = channel._release_capacity
    channel._release_capacity = lambda request_id: (release(request_id), released.set())  # type: ignore[method-assign]
    with channel._ready:
        assert channel._ready.wait_for(lambda: channel.response_done, TIMEOUT_S), "the request did not finish"
    assert engine.core.outstanding == 1 and not released.is_set()  # done, but the consumer still holds it
    handle.cycle = handle  # type: ignore[attr-defined]
    del handle
    gc.collect()
    assert released.wait(TIMEOUT_S), "the worker did not wake to release the dropped handle"
    assert engine.core.outstanding == 0
    assert channel.consumer_released and channel.capacity_release_count == 1
    assert channel.final is not None and channel.final.finish_reason == "length"
    engine.close()
    assert not engine.core.thread.is_alive()
    assert program.usage() == engine.core.baseline
