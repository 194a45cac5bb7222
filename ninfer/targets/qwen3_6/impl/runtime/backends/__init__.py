"""Decode backends: how a Program's decode unit proposes, runs and turns a step into pending rows.

The Program owns the contract (handles, the one open PendingBatch, commit and abort, resources); a
backend owns what happens inside a decode unit:

- ``plain`` (`PlainDecode`): one token per row per unit, and the decode lookahead (the next round queued
  on the device before this one is committed; docs/engine.md). The lookahead lives here and only here:
  it needs the next unit's inputs before the Engine commits this one, which a speculative backend
  cannot know (its next inputs depend on how many drafts the Engine accepts).
- ``known`` (`KnownContinuation`): a test and benchmark backend that proposes K given tokens per row
  (a known continuation of the sequence), verifies them in one step of K + 1 tokens per row through the
  real verify step and the exact acceptance rule, and commits the accepted prefix by slot selection.
- ``mtp`` (`MtpDraft`): the model's own MTP layer drafts K tokens a row, verified like ``known``'s.
- ``dflash`` (`DFlashDraft`): a DFlash block drafter conditioned on the target's inner layers drafts K
  tokens a row in one forward, verified like ``known``'s. DFlash2: a later backend on the same verify.

Every row a backend returns carries a `RowCommit` (``PendingRow.accept_meta``): the slot holding the
state after each position the unit ran, so that commit of ``a`` accepted tokens advances the frontier by
``a`` and makes the slot of position ``a - 1`` current, with no state copy and nothing to undo on abort.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from ninfer.runtime.contract.constraint import RowConstraint
from ninfer.runtime.contract.types import PendingRow, RowDecision, SequenceHandle
from ninfer.targets.qwen3_6.impl.runtime.draws import Sampler, StepRun
from ninfer.targets.qwen3_6.impl.runtime.executor import StepExecutor
from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.model import StateStore


class RowCommit(NamedTuple):
    """How a pending row commits (``PendingRow.accept_meta``).

    ``out_slots``: the state slot after each position the unit ran for the row. ``consumed``: None for a
    decode or verify unit (``a`` accepted tokens consumed ``a`` inputs: the frontier advances by ``a``
    and ``out_slots[a - 1]`` becomes current); a number for a unit that commits its inputs whole
    (a final prefill chunk: always; forced control: when every forced token is accepted), whose one
    output slot holds the state after them.
    """

    out_slots: tuple[int, ...]
    consumed: int | None = None


class DecodeBackend(Protocol):
    """What the Program asks of a decode backend (see the module docstring)."""

    name: str

    @property
    def slots_per_sequence(self) -> int:
        """State slots a sequence holds: its current one and the spares its units write."""
        ...

    @property
    def extra_tokens(self) -> int:
        """KV positions a unit may write past a sequence's last allowed token (a verify's drafts), which
        every reservation includes."""
        ...

    @property
    def kv_layers(self) -> int:
        """Attention layers of the backend's own (a drafter's), whose KV the Program keeps in pages of
        the same ids as the text model's (`StateStore.allocate_kv`), so checkpoints hold it too."""
        ...

    @property
    def kv_head_shape(self) -> tuple[int, int] | None:
        """(KV heads, head dim) of the backend's own attention layers; None: the text model's."""
        ...

    @property
    def taps(self) -> tuple[int, ...]:
        """Text-model layers whose outputs every step's hidden states carry (`StepExecutor`, ``taps``)."""
        ...

    def bind(self, executor: StepExecutor, sampler: Sampler, kv: StateStore | None) -> None:
        """The Program's executor, sampler and the backend's KV store (built after the backend, which
        sizes them)."""
        ...

    @property
    def observes_steps(self) -> bool:
        """The backend wants `observe` calls (a drafter conditioned on the target's hidden states)."""
        ...

    def observe(
        self, seqs: Sequence[SequenceState], run: StepRun, following: torch.Tensor, *, drafts: bool
    ) -> None:
        """A prefill chunk or forced control ran outside the backend: ``run`` holds its hidden states and
        ``following`` [N] (on the device) the token after each of its inputs; with ``drafts`` the rows
        decode next (a drafter proposes from their last positions). Queued on the device, no sync."""
        ...

    def graph_shapes(self, max_batch: int) -> list[tuple[int, int]]:
        """The ``(B, T)`` uniform steps to capture as CUDA graphs."""
        ...

    def decode(
        self,
        seqs: Sequence[SequenceState],
        budgets: Sequence[int],
        *,
        while_running: Callable[[], None] | None,
        repeat_expected: bool,
        constraints: Sequence[RowConstraint | None] | None = None,
    ) -> list[PendingRow]:
        """Run one decode unit for exactly these rows (checked decode-ready by the Program): queue the
        step and the draw, call ``while_running`` once the unit is on the device, read the tokens back and
        return one pending row per sequence (1 <= produced <= budget) with its `RowCommit`.
        ``constraints``: the rows' grammars (contract rule 15): each position sampled under its mask."""
        ...

    def committed(
        self, seqs: Sequence[SequenceState], rows: Sequence[PendingRow], decisions: Sequence[RowDecision]
    ) -> None:
        """The Program committed a decode unit's accepted prefixes (frontiers and slots already moved)."""
        ...

    def drop(self, handle: SequenceHandle | None = None) -> None:
        """The Program is about to run something other than this backend's next expected unit (a prefill,
        forced control, the release of ``handle``): forget provisional work queued for later."""
        ...
