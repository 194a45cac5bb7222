"""The worker's steady-decode fast paths give exactly what the general path gives.

Three shortcuts keep the host time between two decode steps short: the Scheduler hands back the last
decode Unit when the same requests are decode-ready in the same order, the cancellation snapshot scans
the active requests only after a worker signal (every cancel puts one) or an output error, and the
TerminalPending settlement scans only after a snapshot left a request there. These tests run the same
scenarios with the shortcuts disabled (the general path) and compare every unit, event and Program
call, across the changes that must end the steady state: a new request arriving, a cancellation between
units and inside one, rows ending by stop and by length, forced control, and a failing OutputSession.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from engine_fixtures import drain, make_engine
from scripted_program import ScriptedProgram
from test_engine_output_errors import VICTIM, FaultyFrontend

from ninfer import GenerationRequest
from ninfer.runtime.engine.engine import Engine
from ninfer.runtime.engine.request_record import RequestRecord, RequestState
from ninfer.runtime.engine.scheduler import Scheduler, Unit, UnitKind
from ninfer.types import GenerationResult

UnitTrace = tuple[str, tuple[int, ...]]


def _general_path(engine: Engine) -> None:
    """Disable the shortcuts: rebuild every decode Unit and scan for cancellations and TerminalPending
    requests at every boundary, as the worker did before they existed."""
    core: Any = engine.core
    scheduler: Any = core.scheduler
    choose, boundary = scheduler.next_unit, core.boundary

    def next_unit_rebuilt(laned: Any) -> Unit | None:
        scheduler._decode_round = None
        return choose(laned)

    def boundary_scanning_all() -> bool:
        core.snapshot_due = core.settle_due = True
        return boundary()

    scheduler.next_unit = next_unit_rebuilt
    core.boundary = boundary_scanning_all


def _scenario(general: bool, frontend: Any = None) -> tuple[list[UnitTrace], list[list[Any]], list[str], int]:
    """Four requests in steady decode; meanwhile a request arrives, one is cancelled between units, one
    inside a decode unit, some end by stop (EOS) or length, and one goes through forced control.
    Returns the units run, every request's events, the Program's calls, and how often a decode Unit
    was the previous round's object."""
    program = ScriptedProgram(max_concurrency=4, max_context=128, page_size=4, kv_pages=128, eos_period=29)
    engine, program, _ = make_engine(
        program=program, frontend=frontend, max_concurrency=4, queue_capacity=4, prefill_chunk_tokens=4
    )
    if general:
        _general_path(engine)
    units: list[UnitTrace] = []
    reused = 0
    last_decode: list[Unit | None] = [None]

    def observe(core: Any, unit: Unit) -> None:
        nonlocal reused
        ids = tuple(r.request_id for r in unit.members)
        units.append((unit.kind.value, ids))
        if unit.kind is UnitKind.DECODE:
            # a round holds exactly the decode-ready requests, in publication (= request id) order
            states = core.snapshot().states
            assert ids == tuple(sorted(i for i, s in states.items() if s is RequestState.DECODE_READY))
            reused += unit is last_decode[0]
            last_decode[0] = unit

    engine.core.observer = observe
    handles = [
        engine.submit(GenerationRequest(prompt="aaaaaa", max_tokens=60, seed=1)),
        engine.submit(GenerationRequest(prompt=VICTIM.decode(), max_tokens=9, seed=2)),
        engine.submit(
            GenerationRequest(
                messages=[{"role": "user", "content": "think"}],
                chat_template_kwargs={"enable_thinking": True},
                thinking_budget=4,
                max_tokens=40,
                seed=3,
            )
        ),
        engine.submit(GenerationRequest(prompt="ccccccc", max_tokens=50, seed=4)),
    ]
    decodes = 0

    def on_decode(_handles: Any) -> None:
        nonlocal decodes
        decodes += 1
        if decodes == 30:
            handles[3].cancel()  # inside a decode unit: a cancelled row

    program.on_decode = on_decode
    for step in range(400):
        if engine.core.idle:
            break
        if step == 20:
            handles.append(engine.submit(GenerationRequest(prompt="dddddddddd", max_tokens=25, seed=5)))
        if step == 26:
            handles[0].cancel()  # between units: the boundary's snapshot
        if step == 45:
            handles.append(engine.submit(GenerationRequest(prompt="ee", max_tokens=12, seed=6)))
        engine.core.step()
    drain(engine)
    # errors compare by identity: compare their kind and message
    events = [
        [
            dataclasses.replace(e, error=(type(e.error).__name__, str(e.error)))  # type: ignore[arg-type]
            if isinstance(e, GenerationResult) and e.error is not None
            else e
            for e in h
        ]
        for h in handles
    ]
    assert program.usage() == engine.core.baseline
    return units, events, list(program.call_log), reused


def test_steady_decode_shortcuts_match_the_general_path() -> None:
    fast = _scenario(general=False)
    general = _scenario(general=True)
    assert fast[:3] == general[:3]
    units, events, _, reused = fast
    assert reused > 20, "the steady state reused its decode Unit"
    assert {kind for kind, _ in units} == {"prefill", "control", "decode"}
    reasons = [e[-1].finish_reason for e in events]
    assert reasons.count("cancelled") == 2 and "length" in reasons


@pytest.mark.parametrize("method", ["preview", "commit"])
def test_output_errors_end_the_steady_state_as_the_general_path_does(method: str) -> None:
    """A failing OutputSession call of the second request (also the deferred commit, whose error
    reaches the cancellation snapshot) ends it identically with or without the shortcuts."""
    fast = _scenario(general=False, frontend=FaultyFrontend(method, 5, []))
    general = _scenario(general=True, frontend=FaultyFrontend(method, 5, []))
    assert fast[:3] == general[:3]
    assert any(e[-1].finish_reason == "error" for e in fast[1])


def _record(request_id: int, state: RequestState) -> RequestRecord:
    record = RequestRecord(request_id, request_id, None, None, None, None, None)  # type: ignore[arg-type]
    record.state = state
    return record


def test_decode_round_is_rebuilt_whenever_its_requests_change() -> None:
    """The Scheduler's reused decode Unit against a fresh Scheduler (no previous round) in the same
    fairness state, through arrivals, departures, state changes and a lane order that differs from
    publication order (a backfilled borrower holds an earlier lane entry than the head)."""

    def fresh_choice(scheduler: Scheduler, laned: list[RequestRecord]) -> Unit | None:
        reference = Scheduler()
        reference._decode_first = scheduler._decode_first
        reference._last_nondecode = scheduler._last_nondecode
        reference.staged = scheduler.staged
        return reference.next_unit(laned)

    r1, r2, r3, r4 = (_record(i, RequestState.DECODE_READY) for i in (1, 2, 3, 4))
    laned = [r3, r1, r2]
    scheduler = Scheduler()
    steps = [
        lambda: None,
        lambda: None,
        lambda: laned.append(r4),
        lambda: setattr(r2, "state", RequestState.CONTROL_READY),
        lambda: setattr(r2, "state", RequestState.DECODE_READY),
        lambda: setattr(r1, "state", RequestState.TERMINAL_PENDING),
        lambda: laned.remove(r1),
        lambda: laned.reverse(),
        lambda: setattr(scheduler, "staged", _record(9, RequestState.PREFILL)),
        lambda: setattr(scheduler, "staged", None),
        lambda: [setattr(r, "state", RequestState.TERMINAL_PENDING) for r in laned],
    ]
    previous: Unit | None = None
    laned_at_previous: list[RequestRecord] = []
    for change in steps:
        change()
        unit = scheduler.next_unit(laned)
        expected = fresh_choice(scheduler, laned)
        if expected is None:
            assert unit is None
        else:
            assert unit is not None and (unit.kind, unit.members) == (expected.kind, expected.members)
        if unit is not None:
            if unit.kind is UnitKind.DECODE and previous is not None and previous.kind is UnitKind.DECODE:
                # the same object exactly when the same requests are decode-ready in the same order
                same = [r.request_id for r in laned if r.state is RequestState.DECODE_READY] == [
                    r.request_id for r in laned_at_previous if r.state is RequestState.DECODE_READY
                ]
                assert (unit is previous) == same
            scheduler.started(unit)
        previous = unit
        laned_at_previous = [_record(r.request_id, r.state) for r in laned]
