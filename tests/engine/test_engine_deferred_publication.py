"""Publication of a round's ongoing rows overlaps the next decode unit (docs/engine.md, "Publication
overlaps the next decode unit"): when it happens, and what a failing deferred OutputSession commit or an
Engine failure does to the rows still waiting."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine_fixtures import drain, make_engine
from scripted_program import ScriptedProgram, next_token
from test_engine_output_errors import FaultyFrontend

from ninfer import GenerationRequest
from ninfer.runtime.contract.types import PendingBatch, SequenceHandle
from ninfer.types import EngineFailed, GenerationDelta, RequestFailed


def _published_tokens(channel: object, seen: list[object]) -> int:
    """Drain what the channel holds into ``seen``; the number of token ids published so far."""
    while True:
        try:
            event = channel.get(0)  # type: ignore[attr-defined]
        except TimeoutError:
            break
        if event is None:
            break
        seen.append(event)
    return sum(len(e.token_ids) for e in seen if isinstance(e, GenerationDelta))


def test_a_round_is_published_while_the_next_decode_unit_runs() -> None:
    program = ScriptedProgram(max_concurrency=1, max_context=64, page_size=4, kv_pages=64, eos_period=0)
    engine, program, _ = make_engine(program=program, max_concurrency=1, prefill_chunk_tokens=8)
    handle = engine.submit(GenerationRequest(prompt="hello", max_tokens=6, seed=3))
    channel, seen = handle._channel, []
    marks: list[tuple[str, int]] = []
    decode = program.decode

    def traced(
        handles: Sequence[SequenceHandle],
        budgets: Sequence[int],
        *,
        while_running: Callable[[], None] | None = None,
        repeat_expected: bool = False,
    ) -> PendingBatch:
        assert while_running is not None, "the Engine passes its publication to the decode call"
        marks.append(("decode", _published_tokens(channel, seen)))

        def publish() -> None:
            marks.append(("running", _published_tokens(channel, seen)))
            while_running()
            marks.append(("published", _published_tokens(channel, seen)))

        return decode(handles, budgets, while_running=publish, repeat_expected=repeat_expected)

    program.decode = traced  # type: ignore[method-assign]
    drain(engine)
    # token 1 comes from the final prefill chunk, tokens 2..6 from decode units 1..5: unit k starts with
    # k - 1 tokens published and publishes the k-th (the previous unit's) while it runs; the last one
    # ends the request (length), so it is published at once with the result
    expected = []
    for k in range(1, 6):
        expected += [("decode", k - 1), ("running", k - 1), ("published", k)]
    assert marks == expected
    assert _published_tokens(channel, seen) == 6 and handle.result().finish_reason == "length"


def test_cancel_then_failing_deferred_commit_ends_with_the_error() -> None:
    """The request is cancelled while its last row waits for publication; that row's OutputSession
    commit then raises: the result is an error (not "cancelled" with an error attached), its session is
    not finished, and the Engine and the other request carry on."""
    unit_log: list[tuple[str, int]] = []
    program = ScriptedProgram(max_concurrency=2, max_context=64, page_size=4, kv_pages=64, eos_period=0)
    frontend = FaultyFrontend("commit", 3, unit_log)
    engine, program, _ = make_engine(
        program=program, frontend=frontend, max_concurrency=2, prefill_chunk_tokens=8
    )
    bystander = engine.submit(GenerationRequest(prompt=list(b"bbb"), max_tokens=12, seed=1))
    victim = engine.submit(GenerationRequest(prompt=list(b"xxx"), max_tokens=8, seed=2))
    session = None
    for _ in range(200):
        engine.core.step()
        session = next((s for s in frontend.sessions.values() if hasattr(s, "calls")), None)
        waiting = [row.record.request_id for row in engine.core.committer.unpublished]
        if session is not None and session.calls["commit"] == 2 and victim._channel.request_id in waiting:
            break
    else:
        raise AssertionError("the victim's third row never waited for publication")
    victim._channel.cancel()
    drain(engine)

    failed = victim.result(raise_on_error=False)
    assert failed.finish_reason == "error" and isinstance(failed.error, RequestFailed)
    assert "OutputSession.commit raised OutputBug" in failed.error.message
    assert session is not None and session.calls["finish"] == 0
    assert bystander.result().finish_reason == "length"
    assert not engine.core.failed and program.usage() == engine.core.baseline


def test_engine_failure_still_publishes_what_the_program_committed() -> None:
    committed: dict[bytes, list[int]] = {}
    program = ScriptedProgram(
        max_concurrency=2, max_context=64, page_size=4, kv_pages=64, eos_period=0, faults={"decode": 3}
    )
    program.on_release = lambda seq: committed.__setitem__(bytes(seq.plan.prompt_token_ids), seq.output[:])
    engine, program, _ = make_engine(program=program, max_concurrency=2, prefill_chunk_tokens=8)
    prompts = [b"aa", b"bbb"]
    handles = [engine.submit(GenerationRequest(prompt=list(p), max_tokens=8, seed=5)) for p in prompts]
    drain(engine)
    assert engine.core.failed
    for prompt, handle in zip(prompts, handles):
        events = list(handle)
        published = [t for e in events if isinstance(e, GenerationDelta) for t in e.token_ids]
        assert published and published == committed[prompt], (prompt, published, committed[prompt])
        prev, expected = prompt[-1], []
        for i in range(len(published)):
            prev = next_token(5, len(prompt) + i, prev, 0)
            expected.append(prev)
        assert published == expected
        result = handle.result(raise_on_error=False)
        assert result.finish_reason == "error" and isinstance(result.error, EngineFailed)
