"""`DFlashDraft`: speculative decoding with a DFlash block drafter (``dflash:K``).

The drafter (`ninfer.targets.qwen3_6.dflash`) keeps, for every committed position, its layers' K/V of
that position's context vector (the target's tap-layer states there, through ``fc``); its KV lives in
pages of the same ids as the text model's (`StateStore.allocate_kv`), so a block table maps both, a
checkpoint holds both, and positions past the frontier are provisional exactly like the text model's.

What runs where (all of it queued on the device, read back with the unit's tokens):
- every prefill chunk and forced control (`observe`): the context K/V of the step's positions (the
  executor returns the tap layers' outputs with every step's hidden states); after the last chunk or a
  forced span, the drafts: one block of K + 1 positions from the frontier, the pending token first;
- every decode round (`after_verify`, after the shared verify of `verify.VerifyRound`): the context K/V
  of the round's K + 1 positions (those past what the row accepts are provisional), then the next
  block from the position after the row's last accepted token, the target's token there as its anchor.
  The block's own K/V go to its K + 1 positions: up to 2K + 1 past the frontier before the row's next
  round overwrites them, which every reservation covers (`extra_tokens`).

Drafts are the argmax of the target's ``lm_head`` over the block's outputs at positions 1..K (greedy,
as SGLang and vLLM draft): deterministic drafts, so the verify's exact rule (`ninfer.ops.speculative`)
keeps the output the target's, greedy or sampled, whatever the drafts are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.runtime.contract.types import ProgramInvariantError
from ninfer.targets.qwen3_6 import dflash
from ninfer.targets.qwen3_6.impl.runtime.backends.verify import QueuedDraftRound, QueuedDrafts
from ninfer.targets.qwen3_6.impl.runtime.draws import QueuedVerify, Sampler, StepRun
from ninfer.targets.qwen3_6.impl.runtime.executor import StepExecutor
from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.impl.runtime.step import pinned_ids
from ninfer.targets.qwen3_6.model import StateStore
from ninfer.targets.qwen3_6.variant import DFlashDims


class DFlashDraft(QueuedDraftRound):
    name = "dflash"
    observes_steps = True

    def __init__(self, *, draft_tokens: int, dims: DFlashDims, head_rows: int | None = None) -> None:
        """``dims``: the package's drafter; K = ``draft_tokens`` <= its block size - 1 (a block of K + 1
        positions). ``head_rows``: the draft head scores the first this many token ids (None: all)."""
        if not 1 <= draft_tokens < dims.block_size:
            raise ValueError(
                f"dflash:K needs K = 1..{dims.block_size - 1} (the drafter's block of {dims.block_size}), "
                f"got {draft_tokens}"
            )
        super().__init__(draft_tokens=draft_tokens)
        self.dims = dims
        self._head_rows = head_rows
        self._head: torch.Tensor | None = None

    @property
    def kv_layers(self) -> int:
        return self.dims.num_layers

    @property
    def kv_head_shape(self) -> tuple[int, int]:
        return self.dims.num_kv_heads, self.dims.head_dim

    @property
    def taps(self) -> tuple[int, ...]:
        return self.dims.target_layer_ids

    @property
    def extra_tokens(self) -> int:
        """The verify's K drafts past the last allowed token, and the block after a round that ends at
        the last one: K + 1 positions from up to K + 1 past it."""
        return 2 * self.draft_tokens + 1

    def bind(self, executor: StepExecutor, sampler: Sampler, kv: StateStore | None = None) -> None:
        drafter = executor.view.dflash
        if drafter is None:
            raise ValueError("dflash:K needs the package's DFlash drafter weights in the model view")
        if drafter.fc.device != executor.steps.device:
            raise ValueError(
                f"the DFlash drafter's weights are on {drafter.fc.device}, the Program on "
                f"{executor.steps.device}: load them with the model (EngineConfig.speculative 'dflash:K')"
            )
        super().bind(executor, sampler, kv)
        self._head = executor.view.text.lm_head[: self._head_rows]

    # ---- drafting ----
    def _redraft(self, seq: SequenceState, pending: QueuedDrafts) -> None:
        # the row committed a prefix of its round: its context K/V up to the frontier are the verify's;
        # draft again from its pending token
        if not 0 <= seq.frontier < pending.frontier:
            raise ProgramInvariantError(f"{seq.handle} has no DFlash drafts for frontier {seq.frontier}")
        assert seq.pending_input is not None
        self._draft_from([seq], self._ids([seq.pending_input]), [seq.frontier])

    def observe(
        self, seqs: Sequence[SequenceState], run: StepRun, following: torch.Tensor, *, drafts: bool
    ) -> None:
        executor = self._executor
        assert executor is not None and run.hidden is not None
        bounds = run.step.query_start_host
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        positions = [p for s, n in zip(seqs, lengths) for p in range(s.frontier, s.frontier + n)]
        self._write_context(run, self._ids(positions))
        if drafts:  # the rows commit their whole span: the block starts at its end, after its last token
            last = run.step.fields().query_start[1:].long() - 1
            self._draft_from(
                seqs, following.index_select(0, last), [s.frontier + n for s, n in zip(seqs, lengths)]
            )

    def after_verify(self, seqs: Sequence[SequenceState], run: StepRun, queued: QueuedVerify) -> None:
        executor = self._executor
        assert executor is not None and run.hidden is not None
        t = self.tokens_per_step
        f = run.step.fields()
        rows = run.step.num_rows
        frontiers = f.context_lens.long() - t
        offsets = torch.arange(t, device=frontiers.device)
        self._write_context(run, (frontiers[:, None] + offsets).flatten())
        # the next block: from the position after each row's last accepted draft, the target's token
        # there as its anchor (device tensors only: the acceptance is not on the host yet)
        accepted = queued.drawn_accepted.long()
        anchors = queued.drawn.flatten().index_select(
            0, torch.arange(rows, device=accepted.device) * t + accepted
        )
        proposed = self._block(anchors, frontiers + accepted + 1, f.sequence_index.long())
        self._queue(seqs, proposed, None)

    # ---- the drafter ----
    def _write_context(self, run: StepRun, positions: torch.Tensor) -> None:
        """The drafter's context K/V of a step's tokens at their sequence ``positions`` (on the device)."""
        executor = self._executor
        assert executor is not None and run.hidden is not None and self._kv is not None
        taps = run.hidden[:, executor.variant.hidden_size :]
        context = dflash.context_vectors(executor.view, taps, executor.kernels)
        slots = run.step.fields().slot_mapping
        dflash.write_context(executor.view, context, positions, slots, self._kv, executor.kernels)

    def _draft_from(
        self, seqs: Sequence[SequenceState], anchors: torch.Tensor, frontiers: Sequence[int]
    ) -> None:
        index = self._ids([s.handle.index for s in seqs])
        proposed = self._block(anchors, self._ids(list(frontiers)), index)
        self._queue(seqs, proposed, frontiers)

    def _block(self, anchors: torch.Tensor, starts: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Drafts [B, K] of blocks whose anchors [B] sit at positions ``starts`` [B] of the sequences
        ``index`` [B] (device tensors)."""
        executor = self._executor
        assert executor is not None and self._kv is not None and self._head is not None
        t, rows = self.tokens_per_step, anchors.shape[0]
        device = anchors.device
        tokens = torch.full((rows, t), self.dims.mask_token_id, dtype=torch.long, device=device)
        tokens[:, 0] = anchors
        positions = starts[:, None] + torch.arange(t, device=device)
        table = executor.steps.block_tables.index_select(0, index)
        ps = executor.steps.page_size
        page = table.gather(1, positions // ps).long()
        slots = (page * ps + positions % ps).flatten()
        out = dflash.block(
            executor.view, tokens.flatten(), positions.flatten(), slots, table, (starts + t).int(), self._kv,
            executor.kernels,
        )  # fmt: skip
        heads = out.view(rows, t, -1)[:, 1:].reshape(rows * self.draft_tokens, -1)
        kernels = executor.kernels
        return kernels.argmax(kernels.logits(heads, self._head), None).view(rows, self.draft_tokens)

    def _ids(self, values: list[int]) -> torch.Tensor:
        assert self._executor is not None
        return pinned_ids(values, self._executor.steps.device)
