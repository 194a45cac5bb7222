"""The package-neutral Program contract values and their rules."""

from __future__ import annotations

import sys

import pytest
from engine_fixtures import drain, make_engine
from scripted_program import ScriptedProgram

from ninfer import GenerationRequest
from ninfer.runtime.contract.types import (
    PendingBatch,
    PendingRow,
    Program,
    ProgramInvariantError,
    ResourcePlan,
    RowDecision,
    RunningTransaction,
    SequenceHandle,
    StalePlan,
    validate_decisions,
)

H0, H1 = SequenceHandle(1, 0, 1), SequenceHandle(1, 1, 1)


def _batch() -> PendingBatch:
    return PendingBatch(1, 1, "decode", [PendingRow(H0, (5, 6, 7), 10), PendingRow(H1, (8,), 4)])


@pytest.mark.parametrize(
    "decisions",
    [
        [RowDecision(H0, 3), RowDecision(H1, 1)],
        [RowDecision(H0, 2, terminal=True), RowDecision(H1, 1, terminal=True)],
        [RowDecision(H0, 0, terminal=True, cancelled=True), RowDecision(H1, 1, boundaries=(1,))],
    ],
)
def test_legal_decisions(decisions: list[RowDecision]) -> None:
    validate_decisions(_batch(), decisions)


@pytest.mark.parametrize(
    ("decisions", "words"),
    [
        ([RowDecision(H0, 3)], "2 rows"),
        ([RowDecision(H1, 1), RowDecision(H0, 3)], "row is"),
        ([RowDecision(H0, 0), RowDecision(H1, 1)], "outside 1..3"),
        ([RowDecision(H0, 4, terminal=True), RowDecision(H1, 1)], "outside 1..3"),
        ([RowDecision(H0, 2), RowDecision(H1, 1)], "nonterminal"),
        ([RowDecision(H0, 1, terminal=True, cancelled=True), RowDecision(H1, 1)], "cancelled"),
        ([RowDecision(H0, 0, cancelled=True), RowDecision(H1, 1)], "cancelled"),
        ([RowDecision(H0, 3, boundaries=(4,)), RowDecision(H1, 1)], "boundary"),
    ],
)
def test_illegal_decisions(decisions: list[RowDecision], words: str) -> None:
    with pytest.raises(ProgramInvariantError, match=words):
        validate_decisions(_batch(), decisions)


def test_pending_batch_is_consumed_once() -> None:
    batch = _batch()
    batch._consume()
    assert batch.consumed
    with pytest.raises(ProgramInvariantError, match="consumed twice"):
        batch._consume()


def test_scripted_program_satisfies_the_protocol_and_checks_handles() -> None:
    program = ScriptedProgram(max_concurrency=2)
    assert isinstance(program, Program)
    with pytest.raises(ProgramInvariantError):
        program.release(SequenceHandle(program.program_id + 1, 0, 1))


class StaleOnceProgram(ScriptedProgram):
    """The first start finds its plan stale (something moved the revision): the Engine must re-plan."""

    stale_left = 1

    def start(self, plan: ResourcePlan) -> RunningTransaction:
        if self.stale_left:
            self.stale_left -= 1
            self._revision += 1
            raise StalePlan("moved")
        return super().start(plan)


def test_stale_plan_is_replanned_without_side_effects() -> None:
    program = StaleOnceProgram(max_concurrency=1, eos_period=0)
    engine, program, _ = make_engine(program=program, max_concurrency=1)
    handle = engine.submit(GenerationRequest(prompt="abc", max_tokens=3, seed=1))
    engine.core.step()
    assert program.calls["plan_materialization"] == 2
    drain(engine)
    assert handle.result().finish_reason == "length"
    assert program.usage() == engine.core.baseline


def test_import_ninfer_and_engine_modules_stay_free_of_torch() -> None:
    code = (
        "import sys, ninfer, ninfer.runtime.engine.engine_core, ninfer.runtime.engine.engine; "
        "ninfer.Engine; assert 'torch' not in sys.modules; "
        "assert not any(m.startswith('ninfer.targets') for m in sys.modules)"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True)
