"""Deterministic lifecycle tests: cancellation in every state, commit/publication order, forced control,
speculative prefix acceptance, chunked prefill fairness, protected head and backfill."""

from __future__ import annotations

import gc

import pytest
from engine_fixtures import drain, make_engine
from scripted_frontend import THINK_CLOSE
from scripted_program import ProofAttempt, ProvingProgram, ScriptedProgram, next_token, token_logprob

from ninfer import GenerationRequest
from ninfer.runtime.engine.engine import GenerationHandle
from ninfer.runtime.engine.request_record import RequestState
from ninfer.runtime.engine.scheduler import UnitKind
from ninfer.types import GenerationDelta, GenerationResult, GenerationStart


def expected_tokens(seed: int, prompt: tuple[int, ...], n: int, start: int | None = None) -> list[int]:
    """What the scripted model samples after ``prompt`` (no EOS, spec_k irrelevant)."""
    out: list[int] = []
    prev, pos = prompt[-1], len(prompt) if start is None else start
    for _ in range(n):
        prev = next_token(seed, pos, prev, 0)
        out.append(prev)
        pos += 1
    return out


def state_of(engine, handle: GenerationHandle) -> RequestState | None:
    return engine.core.snapshot().states.get(handle.request_id)


# ---------------------------------------------------------------------------------------------------
# cancellation in every state
# ---------------------------------------------------------------------------------------------------

def _program() -> ScriptedProgram:
    return ScriptedProgram(max_concurrency=1, max_context=64, page_size=4, kv_pages=64, eos_period=0)


def _reach(state: str):
    """Build an engine and a target request sitting in ``state``.

    Returns (engine, program, handle, others); ``others`` keeps other handles alive (dropping a handle
    would cancel its request)."""
    program = _program()
    if state == "materializing":
        program.materialize_polls = 3
    engine, program, _ = make_engine(program=program, max_concurrency=1, prefill_chunk_tokens=4)
    others = []
    if state == "waiting":
        others.append(engine.submit(GenerationRequest(prompt="a" * 10, max_tokens=30, seed=1)))
    chat = state == "control_ready"
    request = GenerationRequest(
        messages=[{"role": "user", "content": "hi"}] if chat else None,
        prompt=None if chat else ("p" * (12 if state == "prefill" else 3)),
        chat_template_kwargs={"enable_thinking": True} if chat else {},
        thinking_budget=1 if chat else None,
        max_tokens=30,
        seed=7,
    )
    handle = engine.submit(request)
    target = {
        "waiting": RequestState.WAITING,
        "materializing": RequestState.MATERIALIZING,
        "prefill": RequestState.PREFILL,
        "decode_ready": RequestState.DECODE_READY,
        "control_ready": RequestState.CONTROL_READY,
    }[state]
    for _ in range(20):
        engine.core.step()
        if state_of(engine, handle) is target:
            return engine, program, handle, others
    raise AssertionError(f"never reached {state}: {state_of(engine, handle)}")


@pytest.mark.parametrize("state", ["waiting", "materializing", "prefill", "decode_ready", "control_ready"])
def test_cancel_in_state_ends_request_cancelled_and_frees_everything(state: str) -> None:
    engine, program, handle, others = _reach(state)
    starts_before = program.calls.get("start", 0)
    commits_before = program.calls.get("commit", 0)
    handle.cancel()
    engine.core.step()
    if state in ("prefill", "decode_ready", "control_ready"):
        # an Active request goes TerminalPending at the boundary and is released at the next one
        assert state_of(engine, handle) is RequestState.TERMINAL_PENDING
        handle.cancel()  # a second cancel in TerminalPending changes nothing
    drain(engine)
    events = list(handle)
    result = events[-1]
    assert isinstance(result, GenerationResult) and result.finish_reason == "cancelled"
    assert sum(isinstance(e, GenerationResult) for e in events) == 1
    if state == "waiting":
        assert program.calls.get("start", 0) == starts_before == 1  # only the other request
    if state == "materializing":
        assert program.calls["abort"] == 1 and "finish" not in program.calls
        assert not any(isinstance(e, GenerationStart) for e in events)
    if state == "control_ready":
        assert "force" not in program.calls  # the forced control never ran
    if state != "waiting":
        assert program.calls.get("commit", 0) == commits_before  # no unit ran for it after cancel
    assert program.usage() == engine.core.baseline
    assert handle._channel.capacity_release_count == 1
    for other in others:
        assert other.result().finish_reason == "length"
    assert engine.core.outstanding == 0


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_cancel_during_a_unit_commits_a_cancelled_row(kind: str) -> None:
    """A cancellation that arrives while a unit runs is applied through the PendingBatch: the row is
    committed with zero accepted tokens, so none of its provisional tokens is ever published."""
    engine, program, _ = make_engine(program=_program(), max_concurrency=1, prefill_chunk_tokens=8)
    handle = engine.submit(GenerationRequest(prompt="p" * 3, max_tokens=30, seed=3))
    for _ in range(4 if kind == "decode" else 0):
        engine.core.step()
    program.on_execute = lambda k, handles: handle.cancel() if k == kind else None
    drain(engine)
    result = handle.result(raise_on_error=False)
    assert result.finish_reason == "cancelled"
    seq_tokens = expected_tokens(3, tuple(b"ppp"), len(result.token_ids))
    assert list(result.token_ids) == seq_tokens
    assert program.calls["commit"] == len(result.token_ids) + 1  # the last commit accepted nothing
    assert program.usage() == engine.core.baseline


def test_dropped_handle_counts_as_consumer_release() -> None:
    engine, program, _ = make_engine(program=_program(), max_concurrency=1)
    handle = engine.submit(GenerationRequest(prompt="abc", max_tokens=20, seed=1))
    channel = handle._channel
    engine.core.step()
    del handle
    gc.collect()
    # the finalizer only queued a signal; the worker releases the consumer side at its next boundary
    assert not channel.consumer_released and not channel.cancel_requested
    engine.core.step()
    assert channel.consumer_released and channel.cancel_requested
    drain(engine)
    assert channel.final is not None and channel.final.finish_reason == "cancelled"
    assert channel.capacity_release_count == 1 and engine.core.outstanding == 0
    assert program.usage() == engine.core.baseline


def test_context_manager_exit_releases_and_finished_request_releases_once() -> None:
    engine, _, _ = make_engine(program=_program(), max_concurrency=1)
    with engine.submit(GenerationRequest(prompt="abc", max_tokens=2, seed=1)) as handle:
        drain(engine)
        assert engine.core.outstanding == 1  # done, but the consumer has not let go yet
        assert handle.result().finish_reason == "length"
        assert engine.core.outstanding == 0
    assert handle._channel.capacity_release_count == 1


# ---------------------------------------------------------------------------------------------------
# ordering and output semantics
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [True, False], ids=["publish-while-running", "no-callback"])
def test_start_then_deltas_then_one_result_with_committed_tokens_only(overlap: bool) -> None:
    engine, program, _ = make_engine(program=_program(), max_concurrency=1, prefill_chunk_tokens=2)
    program.call_while_running = overlap
    published_before_commit: list[int] = []

    handle = engine.submit(GenerationRequest(prompt="hello", max_tokens=6, seed=11))

    def on_execute(kind: str, handles: object) -> None:
        # inside a unit: nothing of it can have been published yet
        published_before_commit.append(sum(len(e.token_ids) for e in seen if isinstance(e, GenerationDelta)))

    seen: list[object] = []
    program.on_execute = on_execute
    while not engine.core.idle:
        engine.core.step()
        while True:
            try:
                event = handle._channel.get(0)
            except TimeoutError:
                break
            if event is None:
                break
            seen.append(event)
    assert isinstance(seen[0], GenerationStart)
    assert seen[0].prompt_tokens == 5 and seen[0].reused_prefix_tokens == 0
    assert isinstance(seen[-1], GenerationResult)
    expected = expected_tokens(11, tuple(b"hello"), 6)
    assert list(seen[-1].token_ids) == expected
    assert seen[-1].text == "".join(map(chr, expected))
    # a unit's own tokens are never published while it runs; the previous unit's are published once the
    # next decode unit is queued (the Program's while_running call, after on_execute here), or, from a
    # Program that does not call back, when it returns (so the final result above is complete either way)
    decode_units = published_before_commit[-5:]
    assert decode_units == [0, 1, 2, 3, 4]


def test_stop_string_inside_a_speculative_span_accepts_a_prefix() -> None:
    prompt = tuple(b"stop-me")
    full = expected_tokens(5, prompt, 8)
    stop = chr(full[1]) + chr(full[2])
    assert stop not in chr(full[0]) + chr(full[1])
    program = ScriptedProgram(max_concurrency=1, max_context=64, page_size=4, kv_pages=64,
                              eos_period=0, spec_k=3)
    engine, program, _ = make_engine(program=program, max_concurrency=1)
    released = {}
    program.on_release = lambda seq: released.update(frontier=seq.frontier, rng=seq.rng_draws)
    handle = engine.submit(GenerationRequest(prompt=list(prompt), max_tokens=20, seed=5, stop=stop))
    drain(engine)
    result = handle.result()
    assert result.finish_reason == "stop"
    assert list(result.token_ids) == full[:3]  # first token from prefill, then 2 of the 3-token span
    assert result.text == chr(full[0])
    assert released == {"frontier": len(prompt) + 3, "rng": 3}


def test_thinking_budget_forces_the_close_tag_without_sampling() -> None:
    engine, program, frontend = make_engine(program=_program(), max_concurrency=1)
    released = {}
    program.on_release = lambda seq: released.update(output=tuple(seq.output), rng=seq.rng_draws)
    handle = engine.submit(GenerationRequest(
        messages=[{"role": "user", "content": "think"}], chat_template_kwargs={"enable_thinking": True},
        thinking_budget=3, max_tokens=16, seed=9,
    ))
    drain(engine)
    result = handle.result()
    prompt = frontend.sessions[max(frontend.sessions)].prompt.token_ids
    thought = expected_tokens(9, prompt, 3)
    after = expected_tokens(9, tuple(THINK_CLOSE), 5, start=len(prompt) + 3 + len(THINK_CLOSE))
    assert list(result.token_ids) == thought + list(THINK_CLOSE) + after
    assert result.reasoning_text == "".join(map(chr, thought))
    assert result.text == "".join(map(chr, after))
    assert result.finish_reason == "length" and result.usage.completion_tokens == 16
    assert program.calls["force"] == 1
    assert released["rng"] == 16 - len(THINK_CLOSE)  # forced tokens never advanced the RNG


def test_forced_tokens_are_cut_at_the_max_tokens_budget() -> None:
    engine, program, _ = make_engine(program=_program(), max_concurrency=1)
    handle = engine.submit(GenerationRequest(
        messages=[{"role": "user", "content": "t"}], chat_template_kwargs={"enable_thinking": True},
        thinking_budget=2, max_tokens=5, seed=2,
    ))
    drain(engine)
    result = handle.result()
    assert result.finish_reason == "length"
    assert result.token_ids[2:] == THINK_CLOSE[:3]
    assert program.usage() == engine.core.baseline


def test_logprobs_align_with_tokens() -> None:
    engine, _, _ = make_engine(program=_program(), max_concurrency=1)
    request = GenerationRequest(prompt="lp", max_tokens=4, seed=4, logprobs=True, top_logprobs=2)
    handle = engine.submit(request)
    drain(engine)
    events = list(handle)
    result = events[-1]
    assert result.logprobs is not None and len(result.logprobs) == 4
    for i, (lp, tok) in enumerate(zip(result.logprobs, result.token_ids)):
        assert lp == token_logprob(4, 2 + i, tok, 2)
    for delta in (e for e in events if isinstance(e, GenerationDelta)):
        assert delta.logprobs is not None and len(delta.logprobs) == len(delta.token_ids)


def test_forced_tokens_without_program_logprobs_report_zero() -> None:
    engine, program, _ = make_engine(program=_program(), max_concurrency=1)
    program.force_logprobs = False
    handle = engine.submit(GenerationRequest(
        messages=[{"role": "user", "content": "t"}], chat_template_kwargs={"enable_thinking": True},
        thinking_budget=2, max_tokens=12, seed=2, logprobs=True,
    ))
    drain(engine)
    result = handle.result()
    assert result.token_ids[2:10] == THINK_CLOSE
    assert [lp.token_id for lp in result.logprobs] == list(result.token_ids)
    assert all(lp.logprob == 0.0 for lp in result.logprobs[2:10])
    assert all(lp.logprob < 0.0 for lp in result.logprobs[:2] + result.logprobs[10:])


# ---------------------------------------------------------------------------------------------------
# scheduling
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("table", "explicit", "want"),
    [(None, None, 2048), ("reference", None, 2048), ("fast", None, 8192), ("fast", 300, 300)],
)
def test_prefill_unit_defaults_to_the_op_tables_choice(
    table: str | None, explicit: int | None, want: int
) -> None:
    """prefill_chunk_tokens=None takes the unit of the op table the Program runs (`kernels.name`; a
    Program without one counts as the reference), an explicit value always wins."""
    program = _program()
    if table is not None:
        program.kernels = type("Table", (), {"name": table})()  # type: ignore[attr-defined]
    engine, _, _ = make_engine(program=program, max_concurrency=1, prefill_chunk_tokens=explicit)
    assert engine.config.prefill_chunk_tokens == want


def test_chunked_prefill_alternates_with_decode_and_rounds_use_exact_b() -> None:
    program = ScriptedProgram(max_concurrency=4, max_context=64, page_size=4, kv_pages=64, eos_period=0)
    engine, program, _ = make_engine(program=program, max_concurrency=4, prefill_chunk_tokens=2)
    units: list[tuple[UnitKind, int]] = []
    engine.core.observer = lambda core, unit: units.append((unit.kind, len(unit.members)))
    batch_sizes: list[int] = []
    program.on_decode = lambda handles: batch_sizes.append(len(handles))
    a = engine.submit(GenerationRequest(prompt="ab", max_tokens=12, seed=1))
    b = engine.submit(GenerationRequest(prompt="c" * 10, max_tokens=3, seed=2))
    drain(engine)
    assert a.result().finish_reason == "length" and b.result().finish_reason == "length"
    kinds = [k for k, _ in units]
    assert kinds.count(UnitKind.PREFILL) == 1 + 5  # a: one chunk; b: 10 tokens in chunks of 2
    # while a decodes, b's prefill chunks never run back to back
    first_b_prefill = kinds.index(UnitKind.PREFILL, 1)
    window = kinds[first_b_prefill : first_b_prefill + 9]
    assert window == [UnitKind.PREFILL, UnitKind.DECODE] * 4 + [UnitKind.PREFILL]
    assert set(batch_sizes) == {1, 2}  # exact B, never padded to max_concurrency=4


def _blocking_setup(program: ScriptedProgram):
    engine, program, _ = make_engine(program=program, max_concurrency=3, page_size=4)
    starts: list[int] = []
    program.on_start = lambda plan: starts.append(plan.max_new_tokens)
    a = engine.submit(GenerationRequest(prompt="a" * 4, max_tokens=20, seed=1))  # 24 pos = 6 pages
    engine.core.step()
    b = engine.submit(GenerationRequest(prompt="b" * 4, max_tokens=12, seed=2))  # 16 pos = 4 pages: blocked
    c = engine.submit(GenerationRequest(prompt="c" * 2, max_tokens=2, seed=3))  # 4 pos = 1 page: would fit
    engine.core.step()
    return engine, program, (a, b, c), starts


def test_blocked_head_is_protected_and_never_bypassed_without_proof() -> None:
    program = ScriptedProgram(max_concurrency=3, max_context=64, page_size=4, kv_pages=8, eos_period=0)
    engine, program, (a, b, c), starts = _blocking_setup(program)
    snap = engine.core.snapshot()
    assert snap.protected_head == b.request_id and snap.donors == frozenset({a.request_id})
    assert snap.states[c.request_id] is RequestState.WAITING
    plans_while_blocked = program.calls["plan_materialization"]
    for _ in range(3):  # ordinary decode progress does not re-run planning for the blocked head
        engine.core.step()
    assert program.calls["plan_materialization"] == plans_while_blocked
    drain(engine)
    assert starts == [20, 12, 2]  # FIFO: a, b, c
    assert all(h.result().finish_reason == "length" for h in (a, b, c))


def test_backfill_only_with_the_programs_proof() -> None:
    program = ProvingProgram(max_concurrency=3, max_context=64, page_size=4, kv_pages=8, eos_period=0)
    engine, program, (a, b, c), starts = _blocking_setup(program)
    # c borrowed: with c holding 1 page, a's 6 pages returning still leave 4 pages for b
    assert starts == [20, 2]
    assert engine.core.snapshot().protected_head == b.request_id
    drain(engine)
    assert starts == [20, 2, 12]
    assert all(h.result().finish_reason == "length" for h in (a, b, c))
    assert program.usage() == engine.core.baseline


def test_second_borrower_is_proved_against_the_recorded_donors_only() -> None:
    """The donor set is the one recorded when the head was blocked: a first borrower admitted since then
    is no donor (its reservation stays while the head waits), so it cannot vouch for a second one."""
    program = ProvingProgram(max_concurrency=4, max_context=64, page_size=4, kv_pages=10, eos_period=0)
    engine, program, _ = make_engine(program=program, max_concurrency=4, page_size=4)
    live_at_start: dict[bytes, set[bytes]] = {}  # borrower prompt -> prompts holding a sequence then
    program.on_start = lambda plan: live_at_start.__setitem__(
        bytes(plan.prompt_token_ids), {bytes(s.plan.prompt_token_ids) for s in program.sequences()}
    )
    a = engine.submit(GenerationRequest(prompt="a" * 4, max_tokens=16, seed=1))  # 20 pos = 5 pages
    engine.core.step()
    b = engine.submit(GenerationRequest(prompt="b" * 4, max_tokens=28, seed=2))  # 8 pages: blocked by a
    c = engine.submit(GenerationRequest(prompt="c", max_tokens=3, seed=3))  # 1 page: a's end still admits b
    d = engine.submit(GenerationRequest(prompt="dd", max_tokens=6, seed=4))  # 2 pages: only if c ends too
    drain(engine)
    assert engine.core.snapshot().donors == frozenset()
    pa, pb, pc, pd = b"aaaa", b"bbbb", b"c", b"dd"
    assert program.proofs[0] == ProofAttempt(pb, (pa,), pc, True)
    d_proofs = [p for p in program.proofs if p.borrower == pd]
    assert d_proofs, "the second borrower was never considered"
    # every proof for d counts a only (a is the one recorded donor; c is never one)
    assert all(p.head == pb and p.donors == (pa,) for p in d_proofs), d_proofs
    # while c held its page, a's end would leave 7 < 8 pages for b: refused; once c ended, d borrowed
    assert [p.proved for p in d_proofs] == [False] * (len(d_proofs) - 1) + [True]
    assert pc not in live_at_start[pd] and pa in live_at_start[pd]
    assert list(live_at_start) == [pa, pc, pd, pb]
    assert all(h.result().finish_reason == "length" for h in (a, b, c, d))
    assert program.usage() == engine.core.baseline
