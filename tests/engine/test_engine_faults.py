"""Engine-wide failure: a Program that raises (or breaks the contract) fails the Engine cleanly.

Every outstanding request (waiting and active) ends with EngineFailed, availability is failed with the
reason, later submits raise EngineFailed, the worker thread exits, nothing hangs; cleanup aborts open
Program transactions before releasing active state, and the consumer never saw an uncommitted token.
"""

from __future__ import annotations

import threading

import pytest
from engine_fixtures import drain, make_engine
from scripted_program import PendingBatch, ScriptedProgram

from ninfer import EngineFailed, GenerationHandle, GenerationRequest
from ninfer.runtime.contract.types import RequestPlan, SequenceHandle

JOIN_TIMEOUT_S = 10.0
RESULT_TIMEOUT_S = 10.0


def _program(faults: dict[str, int], polls: int = 0) -> ScriptedProgram:
    return ScriptedProgram(max_concurrency=2, max_context=64, page_size=4, kv_pages=64, eos_period=0,
                           materialize_polls=polls, faults=faults)


@pytest.mark.parametrize(
    "fault",
    [
        {"commit": 4},
        {"decode": 2},
        {"finish": 2},
        {"release": 1},
        {"prefill": 2},
        {"abort_pending": 1, "commit": 3},  # commit fails, then its cleanup fails too
        {"plan_materialization": 3},
    ],
    ids=lambda f: "+".join(f),
)
def test_program_fault_fails_engine_cleanly(fault: dict[str, int]) -> None:
    program = _program(fault)
    committed: dict[int, tuple[int, ...]] = {}
    program.on_release = lambda seq: committed.__setitem__(seq.plan.sampling.seed, tuple(seq.output))
    engine, program, _ = make_engine(program=program, start_worker=True, max_concurrency=2,
                                     queue_capacity=8, prefill_chunk_tokens=4)
    handles = [engine.submit(GenerationRequest(prompt="q" * 6, max_tokens=8, seed=s)) for s in range(5)]
    results = [h.result(RESULT_TIMEOUT_S, raise_on_error=False) for h in handles]
    engine.core.thread.join(JOIN_TIMEOUT_S)
    assert not engine.core.thread.is_alive(), "the worker did not exit after the failure"
    assert engine.availability.state == "failed" and "injected fault" in engine.availability.reason
    failed = [r for r in results if r.finish_reason == "error"]
    assert failed, "the fault hit no request"
    for r in failed:
        assert isinstance(r.error, EngineFailed) and "injected fault" in r.error.message
    cleanup_can_release = "abort_pending" not in fault  # a batch stuck open blocks every release
    for seed, r in enumerate(results):
        if seed not in committed:
            assert not (cleanup_can_release and r.token_ids), "an active request was not released"
            continue
        # the consumer never saw a token the Program did not commit (a failure between commit and
        # publication may lose the tail, never add to it)
        assert r.token_ids == committed[seed][: len(r.token_ids)]
        if r.finish_reason == "length":
            assert r.token_ids == committed[seed]
    with pytest.raises(EngineFailed):
        engine.submit(GenerationRequest(prompt="late", max_tokens=1))
    # cleanup: open transactions first (abort_pending/abort), then releases of active state
    name = next(iter(fault))
    tail = program.call_log[program.call_log.index(name) + 1 :]
    releases = [i for i, c in enumerate(tail) if c == "release"]
    aborts = [i for i, c in enumerate(tail) if c in ("abort", "abort_pending")]
    if releases and aborts:
        assert max(aborts) < min(releases)
    assert engine.core.outstanding == 0
    if "abort_pending" not in fault and "release" not in fault:
        assert program.usage() == engine.core.baseline  # best-effort cleanup returned everything


def test_fault_in_abort_of_a_cancelled_materialization() -> None:
    program = _program({"abort": 1}, polls=10**9)  # the transaction never completes by itself
    engine, program, _ = make_engine(program=program, start_worker=True, max_concurrency=2)
    submitted = threading.Event()
    handles: list[GenerationHandle] = []

    def cancel_once_both_submitted(plan: RequestPlan) -> None:
        # the worker may reach start() before the test submitted the second request: wait for it, so the
        # failure (abort raising) cannot overtake that submit
        assert submitted.wait(RESULT_TIMEOUT_S)
        handles[0].cancel()  # cancelled while Materializing

    program.on_start = cancel_once_both_submitted
    first = engine.submit(GenerationRequest(prompt="abc", max_tokens=4))
    handles.append(first)
    waiting = engine.submit(GenerationRequest(prompt="def", max_tokens=4))
    submitted.set()
    for h in (first, waiting):
        r = h.result(RESULT_TIMEOUT_S, raise_on_error=False)
        assert r.finish_reason == "error" and isinstance(r.error, EngineFailed)
    engine.core.thread.join(JOIN_TIMEOUT_S)
    assert not engine.core.thread.is_alive()
    with pytest.raises(EngineFailed, match="injected fault in abort"):
        waiting.result()


class OverproducingProgram(ScriptedProgram):
    """Breaks the contract: decode produces one token more than the row's budget."""

    def decode(self, handles: list[SequenceHandle], budgets: list[int], **kwargs: object) -> PendingBatch:
        batch = super().decode(handles, budgets, **kwargs)  # type: ignore[arg-type]
        if budgets[0] == 1:
            row = batch.rows[0]
            batch.rows = (row._replace(tokens=row.tokens + row.tokens), *batch.rows[1:])
        return batch


def test_contract_break_is_an_engine_failure_not_a_request_error() -> None:
    program = OverproducingProgram(max_concurrency=2, max_context=64, page_size=4, kv_pages=64, eos_period=0)
    engine, program, _ = make_engine(program=program, max_concurrency=2)
    a = engine.submit(GenerationRequest(prompt="abc", max_tokens=3, seed=1))
    b = engine.submit(GenerationRequest(prompt="xyz", max_tokens=9, seed=2))
    drain(engine)
    assert engine.core.failed and "budget" in engine.availability.reason
    for h in (a, b):
        r = h.result(raise_on_error=False)
        assert r.finish_reason == "error" and isinstance(r.error, EngineFailed)
    assert program.calls["abort_pending"] == 1  # the unconsumed PendingBatch was rolled back
    assert program.usage() == engine.core.baseline
    assert engine.core.step() is False  # a failed worker does nothing more
