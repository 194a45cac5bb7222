"""Hypothesis property tests of the Engine control plane, driven step by step (no threads).

Random arrivals, prompt lengths, max_tokens, thinking budgets, stop strings, cancellations between and
during units, dropped handles, queue timeouts (fake clock) and overload. Invariants are checked while the
scenario runs (inside Program hooks and the scheduler observer) and after it drains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripted_frontend import ScriptedFrontend
from scripted_program import ScriptedProgram

from ninfer import Engine, EngineConfig, GenerationRequest, RequestRejected
from ninfer.runtime.contract.types import RequestPlan, SequenceHandle
from ninfer.runtime.engine.engine_core import EngineCore
from ninfer.runtime.engine.request_record import RequestState, ResponseChannel
from ninfer.runtime.engine.resource_manager import LaneState
from ninfer.runtime.engine.scheduler import Unit, UnitKind
from ninfer.types import GenerationDelta, GenerationResult, GenerationStart

MAX_CONTEXT = 48
QUEUE_TIMEOUT_S = 3.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Submitted:
    request: GenerationRequest
    serial: int
    channel: ResponseChannel
    handle: object | None  # GenerationHandle, or None once dropped
    max_new: int
    events: list[object] = field(default_factory=list)
    dropped: bool = False  # the handle was garbage-collected (its finalizer signalled the worker)


@dataclass
class Harness:
    program: ScriptedProgram
    frontend: ScriptedFrontend
    engine: Engine
    clock: FakeClock
    limit: int
    submitted: list[Submitted] = field(default_factory=list)
    by_serial: dict[int, Submitted] = field(default_factory=dict)
    started: list[int] = field(default_factory=list)  # serials in Program.start order
    released: dict[int, tuple[tuple[int, ...], int]] = field(default_factory=dict)  # serial -> (output, rng)
    armed_cancel: list[int] = field(default_factory=list)  # indices to cancel during the next unit
    last_unit: UnitKind | None = None
    steps: int = 0

    @property
    def core(self) -> EngineCore:
        return self.engine.core

    # ---- hooks: invariants checked while the worker is inside a boundary ----
    def on_start(self, plan: RequestPlan) -> None:
        serial = plan.prepared_prompt.serial  # type: ignore[union-attr]
        rid = self.by_serial[serial].channel.request_id
        if self.started:
            assert rid > self.by_serial[self.started[-1]].channel.request_id, "admission out of FIFO order"
        waiting = self.core.snapshot().waiting
        assert waiting and waiting[0] == rid, f"admitted {rid} while {waiting[:1]} heads the FIFO"
        self.started.append(serial)

    def on_decode(self, handles: tuple[SequenceHandle, ...]) -> None:
        eligible = set()
        for seq in self.program.sequences():
            serial = seq.plan.prepared_prompt.serial  # type: ignore[union-attr]
            session = self.frontend.sessions[serial]
            cancelled = self.by_serial[serial].channel.cancel_requested
            if seq.prompt_done and not seq.terminal and not session.awaiting_force and not cancelled:
                eligible.add(seq.handle)
        assert len(handles) == len(set(handles))
        assert set(handles) == eligible, "decode round is not exactly the decode-ready set"

    def on_execute(self, kind: str, handles: object) -> None:
        for index in self.armed_cancel:
            self.submitted[index].channel.cancel()
        self.armed_cancel.clear()

    def on_release(self, seq: object) -> None:
        serial = seq.plan.prepared_prompt.serial  # type: ignore[attr-defined]
        self.released[serial] = (tuple(seq.output), seq.rng_draws)  # type: ignore[attr-defined]

    def observe(self, core: EngineCore, unit: Unit) -> None:
        snap = core.snapshot()
        decode_ready = {rid for rid, s in snap.states.items() if s is RequestState.DECODE_READY}
        if unit.kind is UnitKind.DECODE:
            assert {r.request_id for r in unit.members} == decode_ready
        elif self.last_unit is not None and self.last_unit is not UnitKind.DECODE:
            assert not decode_ready, "two non-decode units in a row while decode work waited"
        self.last_unit = unit.kind

    # ---- actions ----
    def submit(self, prompt_len: int, max_tokens: int | None, budget: int | None, stop: bool,
               logprobs: bool, seed: int, chat: bool) -> None:
        if chat:
            request = GenerationRequest(
                messages=[{"role": "user", "content": "x" * prompt_len}],
                chat_template_kwargs={"enable_thinking": budget is not None},
                max_tokens=max_tokens, thinking_budget=budget, seed=seed, logprobs=logprobs,
                top_logprobs=2 if logprobs else 0, stop=["qq"] if stop else None,
            )
        else:
            request = GenerationRequest(
                prompt=[ord("p")] * prompt_len, max_tokens=max_tokens, seed=seed, logprobs=logprobs,
                stop="k" if stop else None,
            )
        outstanding = self.core.outstanding
        try:
            handle = self.engine.submit(request)
        except RequestRejected as err:
            if err.kind == "overload":
                assert outstanding >= self.limit
            else:
                assert err.kind == "context_too_long" and "max_context" in err.message
            return
        assert outstanding < self.limit
        channel = handle._channel
        serial = max(self.frontend.sessions)
        n = len(self.frontend.sessions[serial].prompt.token_ids)
        max_new = max_tokens if max_tokens is not None else MAX_CONTEXT - n
        entry = Submitted(request, serial, channel, handle, max_new)
        self.submitted.append(entry)
        self.by_serial[serial] = entry

    def step(self) -> None:
        self.core.step()
        self.steps += 1
        snap = self.core.snapshot()
        staged = [rid for rid, s in snap.states.items()
                  if s in (RequestState.MATERIALIZING, RequestState.PREFILL)]
        assert len(staged) <= 1, f"more than one staged prefill: {staged}"
        busy_lanes = [lane for lane in snap.lanes if lane.state is not LaneState.FREE]
        assert len(busy_lanes) == self.program.usage().sequences + self.program.usage().open_transactions
        for e in self.submitted:  # a boundary handles every drop signalled before it
            assert not e.dropped or e.channel.consumer_released, "a dropped handle was not released"

    def read(self, index: int) -> None:
        entry = self.submitted[index]
        if entry.handle is None:
            return
        while True:
            try:
                event = entry.channel.get(0)
            except TimeoutError:
                return
            if event is None:
                return
            entry.events.append(event)

    def drop(self, index: int) -> None:
        entry = self.submitted[index]
        if entry.handle is None:
            return
        released_before = entry.channel.consumer_released
        entry.handle = None  # the last reference: the finalizer only signals the worker (it takes no lock)
        entry.dropped = True
        assert entry.channel.consumer_released == released_before, "the finalizer released by itself"
        assert not self.core.idle, "the drop signal is not pending for the worker"


def make_harness(mc: int, queue: int, pages: int, spec_k: int, polls: int, chunk: int) -> Harness:
    program = ScriptedProgram(max_concurrency=mc, max_context=MAX_CONTEXT, page_size=4, kv_pages=pages,
                              spec_k=spec_k, materialize_polls=polls, eos_period=29)
    frontend = ScriptedFrontend()
    clock = FakeClock()
    config = EngineConfig(max_concurrency=mc, queue_capacity=queue, queue_timeout_s=QUEUE_TIMEOUT_S,
                          prefill_chunk_tokens=chunk, page_size=4, warmup=False)
    engine = Engine.from_parts(program, frontend, config, clock=clock, start_worker=False)
    h = Harness(program, frontend, engine, clock, mc + queue)
    program.on_start = h.on_start
    program.on_decode = h.on_decode
    program.on_execute = h.on_execute
    program.on_release = h.on_release
    engine.core.observer = h.observe
    return h


submit_action = st.tuples(
    st.just("submit"),
    st.integers(1, 20),  # prompt length
    st.one_of(st.none(), st.integers(1, 24)),  # max_tokens
    st.one_of(st.none(), st.integers(1, 4)),  # thinking budget (chat only)
    st.booleans(),  # stop string
    st.booleans(),  # logprobs
    st.integers(0, 2**20),  # seed
    st.booleans(),  # chat
)
index = st.integers(0, 40)
step_action = st.tuples(st.just("step"), st.integers(1, 12))
# several short requests at once, so rounds with many decode-ready rows happen
burst_action = st.tuples(st.just("burst"), st.integers(2, 6), st.integers(0, 2**20))
action = st.one_of(
    submit_action,
    submit_action,
    burst_action,
    step_action,
    step_action,
    st.tuples(st.just("cancel"), index),
    st.tuples(st.just("cancel_mid"), index),
    st.tuples(st.just("drop"), index),
    st.tuples(st.just("read"), index),
    st.tuples(st.just("clock"), st.floats(0.5, 4.0)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mc=st.integers(1, 4),
    queue=st.integers(0, 4),
    pages=st.integers(6, 48),
    spec_k=st.integers(1, 3),
    polls=st.integers(0, 2),
    chunk=st.integers(2, 16),
    actions=st.lists(action, min_size=12, max_size=60),
)
def test_engine_invariants_hold_for_random_scenarios(
    mc: int, queue: int, pages: int, spec_k: int, polls: int, chunk: int, actions: list[tuple]
) -> None:
    h = make_harness(mc, queue, pages, spec_k, polls, chunk)
    for act in actions:
        kind = act[0]
        if kind == "submit":
            h.submit(*act[1:])
        elif kind == "burst":
            for j in range(act[1]):
                h.submit(1 + (act[2] + j) % 3, 6 + (act[2] >> j) % 12, None, False, False, act[2] + j, False)
        elif kind == "step":
            for _ in range(act[1]):
                h.step()
        elif kind == "clock":
            h.clock.now += act[1]
        elif h.submitted:
            i = act[1] % len(h.submitted)
            if kind == "cancel":
                h.submitted[i].channel.cancel()
            elif kind == "cancel_mid":
                h.armed_cancel.append(i)
            elif kind == "drop":
                h.drop(i)
            else:
                h.read(i)

    # drain: every request ends within a bounded number of boundaries (no starvation, no hang)
    work = sum(len(e.request.prompt or "x" * 40) + 2 * e.max_new + 10 for e in h.submitted)
    bound = 4 * work + 50
    while not h.core.idle:
        h.step()
        assert h.steps <= bound, "the Engine did not drain: starvation or a stuck request"
    for i in range(len(h.submitted)):
        h.read(i)

    for e in h.submitted:
        if e.handle is not None:
            check_events(h, e)
        assert e.channel.response_done
        # consumers that never read still hold capacity until they let go
        if e.handle is not None and not e.channel.consumer_released:
            e.handle.close()
        assert e.channel.capacity_release_count == 1
    assert h.core.outstanding == 0
    assert h.program.usage() == h.core.baseline
    assert all(lane.state is LaneState.FREE for lane in h.core.snapshot().lanes)
    assert h.program.calls.get("start", 0) == len(h.started)


def check_events(h: Harness, e: Submitted) -> None:
    events = e.events
    results = [x for x in events if isinstance(x, GenerationResult)]
    assert len(results) == 1 and events[-1] is results[0], "exactly one terminal event, last"
    result = results[0]
    starts = [i for i, x in enumerate(events) if isinstance(x, GenerationStart)]
    deltas = [x for x in events if isinstance(x, GenerationDelta)]
    assert len(starts) <= 1
    if deltas:
        assert starts and starts[0] == 0, "GenerationStart precedes every delta"
    assert result.token_ids == tuple(t for d in deltas for t in d.token_ids)
    assert result.text == "".join(d.text for d in deltas)
    assert result.reasoning_text == "".join(d.reasoning_text for d in deltas)
    assert result.usage.completion_tokens == len(result.token_ids)
    if result.finish_reason == "error":
        assert result.error is not None and result.error.kind in ("queue_timeout", "infeasible")
        if result.error.kind == "queue_timeout":
            assert not starts
        return
    if result.finish_reason == "length":
        assert len(result.token_ids) == e.max_new
    if result.finish_reason in ("stop", "length"):
        assert e.serial in h.released
    if e.serial in h.released:
        output, rng_draws = h.released[e.serial]
        # what the consumer saw is exactly what the Program committed
        assert output == result.token_ids
        forced = h.frontend.sessions[e.serial].forced_tokens
        assert rng_draws == len(output) - forced, "forced tokens advanced the sampling RNG"
        if e.request.logprobs:
            assert result.logprobs is not None and len(result.logprobs) == len(output)
            assert all(lp.token_id == t for lp, t in zip(result.logprobs, output))

