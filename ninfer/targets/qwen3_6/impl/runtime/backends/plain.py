"""`PlainDecode`: one token per row per decode unit, with the decode lookahead.

The lookahead (``ProgramConfig.decode_lookahead``): when the Engine expects the same round next
(``repeat_expected``), `decode` queues, right behind the unit it was asked for, the decode after it, fed
on the device by the first one's sampled tokens, so the GPU runs it while the Engine previews, commits
and publishes the first (SGLang's overlap scheduling, vLLM's async scheduling). It is provisional state
like any unit's: it reads the first unit's output slot and writes a third slot of the sequence, and its
K/V position lies beyond the frontier, so a commit or an abort of the unit before it still finds
everything it may keep intact. The next `decode` takes it only when it is exactly that unit (the same
rows in the same order, each one position on, fed the tokens the Engine committed; rows at their last
token are not run ahead at all, so a round that loses them by length still matches); anything else
drops it unread: every later unit and every later write of the Program is queued behind it on the one
stream. Exactly, because a row's logits depend, in their last bits, on which rows share its batch and in
which order (the kernels' reduction order), so a unit run for other rows is not the unit plain decoding
runs, even where each row's state is right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ninfer.runtime.contract.constraint import RowConstraint
from ninfer.runtime.contract.types import PendingRow, RowDecision, SequenceHandle
from ninfer.targets.qwen3_6.impl.runtime.backends import RowCommit
from ninfer.targets.qwen3_6.impl.runtime.draws import Queued, Sampler, StepRun, gather_rows
from ninfer.targets.qwen3_6.impl.runtime.executor import StepExecutor
from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.model import StateStore


@dataclass(eq=False)
class _Ahead:
    """The lookahead decode: queued for ``handles`` at ``frontiers``, fed by the tokens ``inputs``."""

    handles: tuple[SequenceHandle, ...]
    frontiers: tuple[int, ...]  # each row's committed frontier the unit assumes
    queued: Queued
    inputs: tuple[int, ...]  # the unit before's tokens (read back): its inputs
    commits: tuple[RowCommit, ...]  # each row's output slot


class PlainDecode:
    name = "plain"
    extra_tokens = 0

    def __init__(self, *, lookahead: bool) -> None:
        self.lookahead_enabled = lookahead
        self.ahead: _Ahead | None = None
        self.lookahead = {"taken": 0, "dropped": 0}  # lookahead units (observability; tests read it)
        self._executor: StepExecutor | None = None
        self._sampler: Sampler | None = None

    kv_layers = 0
    taps: tuple[int, ...] = ()
    kv_head_shape: tuple[int, int] | None = None
    observes_steps = False

    def bind(self, executor: StepExecutor, sampler: Sampler, kv: StateStore | None = None) -> None:
        self._executor, self._sampler = executor, sampler

    def observe(
        self, seqs: Sequence[SequenceState], run: StepRun, following: torch.Tensor, *, drafts: bool
    ) -> None:
        pass  # no drafter

    @property
    def slots_per_sequence(self) -> int:
        """Current + the unit's spare, + the lookahead's."""
        return 3 if self.lookahead_enabled else 2

    def graph_shapes(self, max_batch: int) -> list[tuple[int, int]]:
        return [(b, 1) for b in range(1, max_batch + 1)]

    def decode(
        self,
        seqs: Sequence[SequenceState],
        budgets: Sequence[int],
        *,
        while_running: Callable[[], None] | None,
        repeat_expected: bool,
        constraints: Sequence[RowConstraint | None] | None = None,
    ) -> list[PendingRow]:
        executor, sampler = self._executor, self._sampler
        assert executor is not None and sampler is not None, "PlainDecode.bind was not called"
        if constraints is not None:
            # constrained rows (structured outputs): the same step graph, the rows' masks applied in the
            # sampler, and no lookahead (a constrained row's next mask depends on this round's token)
            self.drop()
            outs = [s.spare for s in seqs]
            run = executor.uniform(
                seqs, [s.pending_input for s in seqs], 1, state_in=[s.current for s in seqs], state_out=outs
            )
            masks = [c.masks(())[0] if c is not None else None for c in constraints]
            queued = sampler.draw(seqs, run, masks)
            if while_running is not None:
                while_running()
            return queued.rows(seqs, tuple(RowCommit((o,)) for o in outs))
        taken = self._take_ahead(seqs)
        if taken is not None:
            queued, commits = taken
        else:
            outs = [s.spare for s in seqs]
            run = executor.uniform(
                seqs, [s.pending_input for s in seqs], 1, state_in=[s.current for s in seqs], state_out=outs
            )
            queued = sampler.draw(seqs, run)
            commits = tuple(RowCommit((o,)) for o in outs)
        ahead_rows = self._look_ahead_rows(seqs, budgets) if repeat_expected else []
        if ahead_rows:
            # the rows that go on after this unit, fed on the device by its draw
            ahead_seqs = [seqs[i] for i in ahead_rows]
            fed = queued.drawn if len(ahead_rows) == len(seqs) else gather_rows(queued.drawn, ahead_rows)
            reads = [commits[i].out_slots[0] for i in ahead_rows]
            writes = [s.spares(1, exclude=(r,))[0] for s, r in zip(ahead_seqs, reads)]
            run = executor.uniform(
                ahead_seqs, [0] * len(ahead_seqs), 1, state_in=reads, state_out=writes, offset=1, fed=fed
            )
            ahead = sampler.draw(ahead_seqs, run)
        if while_running is not None:
            # the unit (and the sampler, if it runs) is queued: the Engine's host work overlaps it. The
            # callback never runs the Program (the contract). If it raises, the lookahead is forgotten in
            # flight: the Engine then fails, and any later unit would be queued behind it anyway
            while_running()
        rows = queued.rows(seqs, commits)
        if ahead_rows:
            self.ahead = _Ahead(
                handles=tuple(seqs[i].handle for i in ahead_rows),
                frontiers=tuple(seqs[i].frontier + 1 for i in ahead_rows),
                queued=ahead,
                inputs=tuple(rows[i].tokens[0] for i in ahead_rows),
                commits=tuple(RowCommit((w,)) for w in writes),
            )
        return rows

    def committed(
        self, seqs: Sequence[SequenceState], rows: Sequence[PendingRow], decisions: Sequence[RowDecision]
    ) -> None:
        pass  # nothing beyond the Program's commit: the lookahead checks the frontiers when it is taken

    def drop(self, handle: SequenceHandle | None = None) -> None:
        """Forget the lookahead unit (all of it, or only if it runs ``handle``): what it writes is
        provisional, and whatever the Program queues next runs after it on the one stream."""
        if self.ahead is not None and (handle is None or handle in self.ahead.handles):
            self.ahead = None
            self.lookahead["dropped"] += 1

    def _look_ahead_rows(self, seqs: Sequence[SequenceState], budgets: Sequence[int]) -> list[int]:
        """The rows of the decode after this one, worth queueing now: those whose budget holds another
        token (a row at its last one ends here), provided none of them has a sampler reading output
        counts, which only commit brings up to date (the next round would hold that row: no lookahead)."""
        if not self.lookahead_enabled:
            return []
        rows = [i for i, b in enumerate(budgets) if b >= 2]
        if any(seqs[i].penalised or seqs[i].frontier + 2 > seqs[i].max_total for i in rows):
            return []
        return rows

    def _take_ahead(self, seqs: Sequence[SequenceState]) -> tuple[Queued, tuple[RowCommit, ...]] | None:
        """The lookahead unit, when it is exactly the decode asked for: the same rows in the same order,
        each committed one position on, fed the token the Engine committed. Otherwise it is dropped."""
        ahead = self.ahead
        if ahead is None:
            return None
        self.ahead = None
        if ahead.handles == tuple(s.handle for s in seqs) and all(
            s.frontier == f and s.pending_input == t for s, f, t in zip(seqs, ahead.frontiers, ahead.inputs)
        ):
            self.lookahead["taken"] += 1
            return ahead.queued, ahead.commits
        self.lookahead["dropped"] += 1
        return None
