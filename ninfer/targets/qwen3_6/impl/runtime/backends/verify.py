"""`VerifyRound`: the decode unit every speculative backend shares.

A round proposes K drafts per row (the subclass's `drafts`), runs them through one verify step (B rows
x K + 1 tokens: the pending input and the drafts, one CUDA graph per (B, K + 1)), accepts a prefix by
the exact rule of `ninfer.ops.speculative` (greedy: while the draft equals the target's argmax; sampled:
with probability p(draft), a correction or bonus token drawn from the target), and returns one pending
row per sequence: the accepted drafts and the target's next token. The commit of ``a`` accepted tokens
makes the slot of the state after position ``a - 1`` current (the verify wrote the state after each
position into its own spare): no re-execution, no state copy, nothing to undo on abort. Output is the
target's whatever the drafts are; only the accepted length depends on them.

Subclasses add what their drafter needs: `after_verify` runs on the device between the verify and the
read back (a drafter conditions on the verify's hidden states and proposes the next round there).
`QueuedDraftRound` keeps such device-made drafts per row until the next round reads them (MTP, DFlash).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ninfer.runtime.contract.constraint import RowConstraint
from ninfer.runtime.contract.types import (
    PendingRow,
    ProgramInvariantError,
    RowDecision,
    SequenceHandle,
    TokenLogprob,
)
from ninfer.targets.qwen3_6.impl.runtime.backends import RowCommit
from ninfer.targets.qwen3_6.impl.runtime.draws import QueuedVerify, Sampler, StepRun, _finite_top
from ninfer.targets.qwen3_6.impl.runtime.executor import StepExecutor
from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.impl.runtime.step import host_copy
from ninfer.targets.qwen3_6.model import StateStore


class VerifyRound:
    name = "verify"
    kv_layers = 0
    taps: tuple[int, ...] = ()
    kv_head_shape: tuple[int, int] | None = None
    observes_steps = False

    def __init__(self, *, draft_tokens: int) -> None:
        if draft_tokens < 1:
            raise ValueError(f"draft_tokens must be >= 1, got {draft_tokens}")
        self.draft_tokens = draft_tokens
        self.drafted = 0  # drafts proposed and accepted by the verify rule (observability; tests read it)
        self.accepted = 0
        self._executor: StepExecutor | None = None
        self._sampler: Sampler | None = None
        self._kv: StateStore | None = None

    def bind(self, executor: StepExecutor, sampler: Sampler, kv: StateStore | None = None) -> None:
        self._executor, self._sampler, self._kv = executor, sampler, kv

    @property
    def tokens_per_step(self) -> int:
        return self.draft_tokens + 1

    @property
    def slots_per_sequence(self) -> int:
        """Current + the state after each of a verify's positions."""
        return 1 + self.tokens_per_step

    @property
    def extra_tokens(self) -> int:
        """A verify near the end of a reservation still writes K drafts past the last allowed token."""
        return self.draft_tokens

    def graph_shapes(self, max_batch: int) -> list[tuple[int, int]]:
        rows = range(1, max_batch + 1)
        return [(b, 1) for b in rows] + [(b, self.tokens_per_step) for b in rows]

    # ---- what a subclass provides ----
    def drafts(self, seq: SequenceState) -> list[int]:
        """The K tokens proposed after the sequence's pending input."""
        raise NotImplementedError

    def accept(self, seq: SequenceState, accepted: int) -> int:
        """How many drafts the row keeps, given how many the verify rule accepted (a benchmark override)."""
        return accepted

    def after_verify(self, seqs: Sequence[SequenceState], run: StepRun, queued: QueuedVerify) -> None:
        """Device work between the verify and its read back (the drafter's next proposal)."""

    def after_read(self, seqs: Sequence[SequenceState], accepted: Sequence[int]) -> None:
        """The round's accepted draft counts (by the rule) are on the host."""

    def observe(
        self, seqs: Sequence[SequenceState], run: StepRun, following: torch.Tensor, *, drafts: bool
    ) -> None:
        pass

    # ---- the round ----
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
        assert executor is not None and sampler is not None, f"{type(self).__name__}.bind was not called"
        t = self.tokens_per_step
        drafts = [self.drafts(s) for s in seqs]
        masks = None
        if constraints is not None:  # one bitmask (or None) per verified position of each row
            masks = []
            for c, d in zip(constraints, drafts):
                masks.extend(c.masks(d) if c is not None else (None,) * t)
        outs = [s.spares(t) for s in seqs]
        tokens = [x for s, d in zip(seqs, drafts) for x in (s.pending_input, *d)]
        run = executor.uniform(seqs, tokens, t, state_in=[s.current for s in seqs], state_out=outs)
        queued = sampler.verify(seqs, run, drafts, masks)
        self.after_verify(seqs, run, queued)
        if while_running is not None:
            while_running()
        chosen, accepted, logprob, top_ids, top_lp = queued.read()
        self.after_read(seqs, accepted)
        rows = []
        for i, (s, budget) in enumerate(zip(seqs, budgets)):
            a = accepted[i]
            self.drafted += self.draft_tokens
            self.accepted += a
            # a constrained row keeps what the masked rule accepted (a benchmark override would keep
            # drafts the grammar may refuse)
            constrained = constraints is not None and constraints[i] is not None
            kept = a if constrained else max(0, min(self.draft_tokens, self.accept(s, a)))
            produced = tuple(chosen[i][: a + 1]) if kept == a else (*drafts[i][:kept], chosen[i][kept])
            produced = produced[:budget]
            lp = None
            if s.logprobs.enabled:
                n = s.logprobs.top_n
                lp = tuple(
                    TokenLogprob(
                        tok, logprob[i][j], _finite_top(top_ids[i][j][:n], top_lp[i][j][:n]) if n else ()
                    )
                    for j, tok in enumerate(produced)
                )
            hits = min(kept, len(produced))
            rows.append(
                PendingRow(s.handle, produced, s.frontier, lp, RowCommit(outs[i]), self.draft_tokens, hits)
            )
        return rows

    def committed(
        self, seqs: Sequence[SequenceState], rows: Sequence[PendingRow], decisions: Sequence[RowDecision]
    ) -> None:
        pass

    def drop(self, handle: SequenceHandle | None = None) -> None:
        pass  # nothing is queued past a unit


@dataclass(eq=False)
class QueuedDrafts:
    """A row's drafts for the round at ``frontier``, on their way to the host."""

    handle: SequenceHandle
    frontier: int  # the committed frontier the drafts follow (-1 until a verify's acceptance is read)
    host: torch.Tensor  # [K]
    done: torch.cuda.Event | None
    base: int | None = None  # after a verify: the frontier before it (a redraft from its outputs)


class QueuedDraftRound(VerifyRound):
    """A verify round whose drafter proposes on the device, after every prefill, forced span and verify:
    each row's next drafts are queued to the host behind the work that computes them (`_queue`) and read
    when its next round is built. A row that committed less of its round than the drafts assumed (a
    decode budget the Frontend capped) is drafted again from its frontier (`_redraft`)."""

    def __init__(self, *, draft_tokens: int) -> None:
        super().__init__(draft_tokens=draft_tokens)
        self._pending: dict[int, QueuedDrafts] = {}  # sequence index -> its next round's drafts

    def _redraft(self, seq: SequenceState, pending: QueuedDrafts) -> None:
        """Queue drafts for ``seq`` at its frontier, which ``pending``'s do not follow; raise
        ProgramInvariantError where that frontier cannot be."""
        raise NotImplementedError

    def drafts(self, seq: SequenceState) -> list[int]:
        pending = self._pending.get(seq.handle.index)
        if pending is None or pending.handle != seq.handle:
            raise ProgramInvariantError(f"{seq.handle} has no {self.name} drafts")
        if pending.frontier != seq.frontier:
            self._redraft(seq, pending)
            pending = self._pending[seq.handle.index]
        if pending.done is not None:
            pending.done.synchronize()
        return [int(t) for t in pending.host.tolist()]

    def after_read(self, seqs: Sequence[SequenceState], accepted: Sequence[int]) -> None:
        for seq, a in zip(seqs, accepted):  # the drafts follow the row's whole round
            self._pending[seq.handle.index].frontier = seq.frontier + a + 1

    def drop(self, handle: SequenceHandle | None = None) -> None:
        if handle is not None:
            self._pending.pop(handle.index, None)

    def _queue(
        self, seqs: Sequence[SequenceState], proposed: torch.Tensor, frontiers: Sequence[int] | None
    ) -> None:
        """Queue the drafts' host copy [B, K] behind the work that computes them; ``frontiers``: the
        frontiers they follow (None: a verify's, known once its acceptance is read, `after_read`)."""
        host, done = host_copy(proposed)
        for i, seq in enumerate(seqs):
            frontier = frontiers[i] if frontiers is not None else -1
            self._pending[seq.handle.index] = QueuedDrafts(seq.handle, frontier, host[i], done)
