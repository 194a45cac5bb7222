"""A per-request output error (an exception from one row's OutputSession.preview/commit/finish, e.g. a
tool-call parser bug) ends only that request with ``RequestFailed``; other rows of the same unit commit
normally, the PendingBatch is consumed by one Program commit, and the Engine stays ready."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from engine_fixtures import drain, make_engine
from scripted_frontend import OutputDelta, OutputPreview, OutputSession, PreparedPrompt, ScriptedFrontend
from scripted_program import ScriptedProgram, next_token

from ninfer import GenerationRequest
from ninfer.runtime.contract.frontend import OutputOptions
from ninfer.types import EngineFailed, GenerationDelta, RequestFailed

VICTIM = b"xxx"
BYSTANDER = b"bbb"
MAX_TOKENS = 8
BYSTANDER_TOKENS = 12  # outlives the victim, so it shares every decode round with it


class OutputBug(RuntimeError):
    """What the faulty session raises (stands in for a parser bug)."""


class FaultySession(OutputSession):
    """The byte-level session, raising ``OutputBug`` on the ``at``-th call of ``method``."""

    def __init__(self, prompt: PreparedPrompt, options: OutputOptions, method: str, at: int,
                 unit_log: list[tuple[str, int]]) -> None:
        super().__init__(prompt, options)
        self.method, self.at, self.unit_log = method, at, unit_log
        self.calls: Counter[str] = Counter()

    def _call(self, method: str) -> None:
        self.calls[method] += 1
        if method == self.method and self.calls[method] == self.at:
            self.unit_log.append(("fault", 0))
            raise OutputBug(f"tool-call parser bug in {method}")

    def preview(self, token_ids: Sequence[int]) -> OutputPreview:
        self._call("preview")
        return super().preview(token_ids)

    def commit(self, preview: OutputPreview) -> OutputDelta:
        self._call("commit")
        return super().commit(preview)

    def finish(self) -> OutputDelta:
        self._call("finish")
        return super().finish()


class FaultyFrontend(ScriptedFrontend):
    """Gives the request whose prompt is ``VICTIM`` a FaultySession; every other one a correct session."""

    def __init__(self, method: str, at: int, unit_log: list[tuple[str, int]]) -> None:
        super().__init__()
        self.method, self.at, self.unit_log = method, at, unit_log

    def new_output_session(self, prompt: PreparedPrompt, options: OutputOptions) -> OutputSession:
        if bytes(prompt.token_ids) != VICTIM:
            return super().new_output_session(prompt, options)
        session = FaultySession(prompt, options, self.method, self.at, self.unit_log)
        self.sessions[prompt.serial] = session
        return session


def expected(seed: int, prompt: bytes, n: int) -> tuple[int, ...]:
    out, prev = [], prompt[-1]
    for i in range(n):
        prev = next_token(seed, len(prompt) + i, prev, 0)
        out.append(prev)
    return tuple(out)


@pytest.mark.parametrize(
    ("method", "at", "unit"),
    [
        ("preview", 1, ("prefill", 1)),  # the first token, in the victim's final prefill chunk
        ("preview", 3, ("decode", 2)),  # in a decode round shared with the bystander
        ("commit", 3, ("decode", 2)),  # after the Program committed the round
        ("finish", 1, ("decode", 2)),  # at the end, flushing held-back output
    ],
    ids=["preview-in-prefill", "preview-in-decode", "commit-in-decode", "finish-at-length"],
)
def test_output_error_ends_only_its_request(method: str, at: int, unit: tuple[str, int]) -> None:
    program = ScriptedProgram(max_concurrency=2, max_context=64, page_size=4, kv_pages=64, eos_period=0)
    unit_log: list[tuple[str, int]] = []  # (unit kind, rows) per unit, and ("fault", 0) when it raised
    program.on_execute = lambda kind, handles: unit_log.append((kind, len(handles)))
    committed: dict[bytes, tuple[int, ...]] = {}
    program.on_release = lambda seq: committed.__setitem__(bytes(seq.plan.prompt_token_ids), seq.output[:])
    engine, program, _ = make_engine(program=program, frontend=FaultyFrontend(method, at, unit_log),
                                     max_concurrency=2, prefill_chunk_tokens=8)
    bystander = engine.submit(GenerationRequest(prompt=list(BYSTANDER), max_tokens=BYSTANDER_TOKENS, seed=1))
    victim = engine.submit(GenerationRequest(prompt=list(VICTIM), max_tokens=MAX_TOKENS, seed=2))
    drain(engine)

    assert ("fault", 0) in unit_log, "the faulty session never raised"
    assert unit_log[unit_log.index(("fault", 0)) - 1] == unit  # the unit the fault happened in
    # the Engine is fine: no failure, still ready, every Program resource back, each batch consumed by
    # exactly one commit (a preview fault became a cancelled row, not an abort)
    assert not engine.core.failed and engine.availability.state == "ready"
    assert "abort_pending" not in program.calls
    assert program.calls["commit"] == sum(1 for kind, _ in unit_log if kind != "fault")
    assert program.usage() == engine.core.baseline

    ok = bystander.result()
    assert ok.finish_reason == "length" and ok.token_ids == expected(1, BYSTANDER, BYSTANDER_TOKENS)
    assert tuple(committed[BYSTANDER]) == ok.token_ids

    failed = victim.result(raise_on_error=False)
    assert failed.finish_reason == "error" and isinstance(failed.error, RequestFailed)
    message = failed.error.message
    assert f"OutputSession.{method} raised OutputBug: tool-call parser bug in {method}" in message
    with pytest.raises(RequestFailed):
        victim.result()
    events = list(victim)  # already consumed by result(): nothing more
    assert events == []
    # published tokens are Program-committed ones; a preview fault commits the row with 0 tokens
    program_tokens, published = tuple(committed[VICTIM]), failed.token_ids
    assert program_tokens[: len(published)] == published == expected(2, VICTIM, len(published))
    extra = {"preview": 0, "commit": 1, "finish": 0}[method]  # commit: Program committed, output did not
    assert len(program_tokens) == len(failed.token_ids) + extra
    if method == "finish":
        assert len(failed.token_ids) == MAX_TOKENS
    assert engine.core.outstanding == 0

    # the Engine serves on
    again = engine.submit(GenerationRequest(prompt="again", max_tokens=3, seed=5))
    drain(engine)
    assert again.result().token_ids == expected(5, b"again", 3)


def test_program_exception_stays_engine_wide() -> None:
    """The per-request path covers only the OutputSession: a Program fault still fails the Engine."""
    program = ScriptedProgram(max_concurrency=2, max_context=64, page_size=4, kv_pages=64, eos_period=0,
                              faults={"decode": 2})
    engine, program, _ = make_engine(program=program, max_concurrency=2)
    handles = [engine.submit(GenerationRequest(prompt=p, max_tokens=MAX_TOKENS, seed=1)) for p in ("a", "b")]
    drain(engine)
    assert engine.core.failed and engine.availability.state == "failed"
    for h in handles:
        result = h.result(raise_on_error=False)
        assert result.finish_reason == "error" and isinstance(result.error, EngineFailed)
        assert not any(isinstance(e, GenerationDelta) for e in h)
