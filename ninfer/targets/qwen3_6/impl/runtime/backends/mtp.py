"""`MtpDraft`: speculative decoding with the model's own MTP layer (``mtp:K``).

The MTP block (`model.mtp_forward`) at position p takes the text model's final-norm hidden state h_p
and the token t_{p+1} after it, writes its own attention layer's K/V at p, and predicts t_{p+2}. Its KV
lives in pages of the same ids as the text model's (`StateStore.allocate_kv`), so a sequence's block
table maps both, a checkpoint holds both, and positions past the frontier are provisional exactly like
the text model's.

What runs where (all of it queued on the device, read back with the unit's tokens):
- every prefill chunk and forced control (`observe`): the MTP over the chunk's positions, paired with
  the token after each (the next prompt token; after the prompt's last, the sampled first token), so
  the MTP KV covers every committed position; after the last chunk or a forced span, the drafts;
- every decode round (`after_verify`, after the shared verify of `verify.VerifyRound`): the MTP over the
  round's K + 1 positions paired with the target's tokens there (the accepted drafts and the
  correction or bonus token), then the drafts from the position of the row's last accepted token.
Drafts chain K deep: draft 1 from the MTP at the last position, draft k + 1 from the MTP one position on,
fed draft k and the MTP's own previous output (after ``mtp.norm``), all greedy. The chain writes MTP KV
up to 2K - 1 positions past the frontier before the next round overwrites them; the reservation covers
them (`extra_tokens`).

With CUDA graphs on, a round's MTP work (`after_verify`: the MTP over the verify's positions, the K - 1
chained steps, the K draft heads) is one captured graph per B, replayed after the verify graph: it reads
only device tensors (the verify step's packed facts, its hidden states, drawn tokens and accepted
counts), so no host fact enters the round after the verify is queued. The MTP at the end of a prefill
(`observe`) and the rare re-draft after a capped round stay eager.

Lossless by construction: the verify accepts by the target's rule, whatever the drafts are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer.runtime.contract.types import ProgramInvariantError
from ninfer.targets.qwen3_6.impl.runtime.backends.verify import QueuedDraftRound, QueuedDrafts
from ninfer.targets.qwen3_6.impl.runtime.draws import QueuedVerify, Sampler, StepRun
from ninfer.targets.qwen3_6.impl.runtime.executor import StepExecutor
from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.impl.runtime.step import PackedStep, StepBuilder, pinned_ids
from ninfer.targets.qwen3_6.model import StateStore, StepBatch, mtp_forward


@dataclass(eq=False)
class _RoundGraph:
    """`MtpDraft._round` captured for B rows: static inputs copied in before each replay, static outputs."""

    step: PackedStep  # the verify step's packed facts (a placeholder at capture)
    drawn: torch.Tensor  # [B * T] the target's tokens at each verified position
    hidden: torch.Tensor  # [B * T, H] the target's final-norm hidden states there
    accepted: torch.Tensor  # [B] int64, the drafts each row accepted
    graph: torch.cuda.CUDAGraph
    proposed: torch.Tensor | None = None  # [B, K] the next round's drafts


class MtpDraft(QueuedDraftRound):
    name = "mtp"
    observes_steps = True

    def __init__(self, *, draft_tokens: int, layers: int, head_rows: int | None = None) -> None:
        """``head_rows``: the draft head scores the first this many token ids (`EngineConfig.draft_vocab`;
        None: all)."""
        super().__init__(draft_tokens=draft_tokens)
        self._layers = layers
        self._head_rows = head_rows
        self._head: torch.Tensor | None = None  # lm_head's first head_rows rows (a view, no copy)
        self._outputs: torch.Tensor | None = None  # [S, K + 1, H]: each sequence's last round's MTP outputs
        self._graphs: dict[int, _RoundGraph] = {}  # B -> the captured round
        self.graph_replays = 0  # rounds whose MTP work ran as a graph (observability; tests read it)
        self._checked = False  # during capture: every MTP pass under the PDL schedule check

    @property
    def kv_layers(self) -> int:
        return self._layers

    def bind(self, executor: StepExecutor, sampler: Sampler, kv: StateStore | None = None) -> None:
        super().bind(executor, sampler, kv)
        self._head = executor.view.text.lm_head[: self._head_rows]
        sequences = executor.steps.block_tables.shape[0]
        hidden = executor.variant.hidden_size
        device, dtype = executor.view.text.embed.device, executor.view.text.embed.dtype
        self._outputs = torch.zeros(sequences, self.tokens_per_step, hidden, dtype=dtype, device=device)
        if executor.graphs is not None:  # the verify runs in graphs: so does the MTP work after it
            self._capture(executor, hidden, device, dtype)

    def _capture(self, executor: StepExecutor, hidden: int, device: torch.device, dtype: torch.dtype) -> None:
        """One graph of `_round` per B, at Program construction (before any sequence: the placeholder rows
        write MTP KV at page 0 and outputs at sequence index 0, which nothing depends on yet). A pool of
        its own: the verify graph's outputs, which the round reads, live in the step graphs' pool."""
        t = self.tokens_per_step
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        self._checked = True
        try:
            with torch.cuda.stream(stream):
                for rows in sorted({b for b, tokens in executor.graphs.shapes if tokens == t}, reverse=True):
                    g = _RoundGraph(
                        StepBuilder.placeholder(rows, t, 0, device),
                        torch.zeros(rows * t, dtype=torch.long, device=device),
                        torch.zeros(rows * t, hidden, dtype=dtype, device=device),
                        torch.zeros(rows, dtype=torch.long, device=device),
                        torch.cuda.CUDAGraph(),
                    )
                    for _ in range(2):  # warm the allocator and the kernel modules outside the capture
                        self._round(g.step, g.drawn, g.hidden, g.accepted)
                    with torch.cuda.graph(g.graph, pool=pool, stream=stream):
                        g.proposed = self._round(g.step, g.drawn, g.hidden, g.accepted)
                    self._graphs[rows] = g
        finally:
            self._checked = False
        torch.cuda.current_stream(device).wait_stream(stream)
        assert self._outputs is not None
        self._outputs.zero_()

    @property
    def extra_tokens(self) -> int:
        """The verify's K drafts past the last allowed token, and the chain's K - 1 MTP positions past a
        row that ends inside its draft."""
        return 2 * self.draft_tokens

    # ---- drafting ----
    def _redraft(self, seq: SequenceState, pending: QueuedDrafts) -> None:
        # the row committed a prefix of its round: draft again from its last committed position, from
        # the MTP's output there in the round's (`_outputs`, position `base` on)
        if pending.base is None or not pending.base < seq.frontier < pending.frontier:
            raise ProgramInvariantError(f"{seq.handle} has no MTP drafts for frontier {seq.frontier}")
        assert self._outputs is not None
        outputs = self._outputs[seq.handle.index]
        last = seq.frontier - 1
        at = pinned_ids([last], outputs.device)
        self._chain(
            [seq], outputs[last - pending.base : last - pending.base + 1].clone(), at, [seq.frontier]
        )  # fmt: skip

    def observe(
        self, seqs: Sequence[SequenceState], run: StepRun, following: torch.Tensor, *, drafts: bool
    ) -> None:
        assert self._executor is not None and run.hidden is not None
        batch = self._executor.steps.unpack(run.step)
        out = self._mtp(following, run.hidden, batch)
        if drafts:  # the rows commit their whole span: the drafts follow its end
            ends = [seq.frontier + n for seq, n in zip(seqs, _row_lengths(batch))]
            last = batch.query_start[1:].long() - 1
            positions = pinned_ids([e - 1 for e in ends], out.device)
            self._chain(seqs, out.index_select(0, last), positions, ends)

    def after_verify(self, seqs: Sequence[SequenceState], run: StepRun, queued: QueuedVerify) -> None:
        assert run.hidden is not None and self._outputs is not None
        drawn, accepted = queued.drawn.flatten(), queued.drawn_accepted.long()
        g = self._graphs.get(len(seqs))
        if g is not None and run.step.values.shape == g.step.values.shape:
            g.step.values.copy_(run.step.values)
            g.drawn.copy_(drawn)
            g.hidden.copy_(run.hidden)
            g.accepted.copy_(accepted)
            g.graph.replay()
            self.graph_replays += 1
            assert g.proposed is not None
            proposed = g.proposed
        else:
            proposed = self._round(run.step, drawn, run.hidden, accepted)
        # the frontier the drafts follow is known once the acceptance is read back (`after_read`)
        self._queue(seqs, proposed, None)
        for seq in seqs:
            self._pending[seq.handle.index].base = seq.frontier

    def _round(
        self, step: PackedStep, drawn: torch.Tensor, hidden: torch.Tensor, accepted: torch.Tensor
    ) -> torch.Tensor:
        """A verify round's MTP work from device tensors only (capturable): the MTP over the verify's
        B x T positions paired with the target's tokens ``drawn`` there, each sequence's outputs kept
        (`_outputs`, for a re-draft), then the next drafts [B, K] from each row's last accepted position
        (the frontier plus the drafts it accepted, whose MTP output pairs it with the target's token
        after them). The frontiers, sequence indices and rope offsets come from the packed step: a
        verify row's context is its frontier + T, its first position the frontier + its rope offset."""
        executor = self._executor
        assert executor is not None and self._outputs is not None
        t = self.tokens_per_step
        out = self._mtp(drawn, hidden, executor.steps.unpack(step))
        f = step.fields()
        index = f.sequence_index
        self._outputs.index_copy_(0, index, out.view(step.num_rows, t, -1))
        frontiers = f.context_lens - t
        last = torch.arange(step.num_rows, device=out.device) * t + accepted
        delta = f.positions.view(step.num_rows, t)[:, 0] - frontiers
        return self._propose(out.index_select(0, last), frontiers + accepted, index, delta)

    def _mtp(self, following: torch.Tensor, hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        executor = self._executor
        assert executor is not None and self._kv is not None
        view, variant, kernels = executor.view, executor.variant, executor.kernels
        if not self._checked:
            return mtp_forward(view, variant, following, hidden, batch, self._kv, kernels)
        from ninfer.ops.triton.schedule import checked_schedule

        with checked_schedule(tokens_per_row=batch.tokens_per_row):  # a captured pass's PDL launches
            return mtp_forward(view, variant, following, hidden, batch, self._kv, kernels)

    def _chain(
        self,
        seqs: Sequence[SequenceState],
        out: torch.Tensor,
        positions: torch.Tensor,
        frontiers: Sequence[int] | None,
    ) -> None:
        """The next round's drafts of each row from the MTP output ``out`` [B, H] at the row's last
        position (``positions``, on the device), tagged with the frontier the row reaches when it commits
        all it produced (``frontiers``; after a verify, set once its acceptance is read)."""
        device = out.device
        index = pinned_ids([s.handle.index for s in seqs], device)
        delta = pinned_ids([s.rope_delta for s in seqs], device)
        self._queue(seqs, self._propose(out, positions, index, delta), frontiers)

    def _propose(
        self, out: torch.Tensor, positions: torch.Tensor, index: torch.Tensor, delta: torch.Tensor
    ) -> torch.Tensor:
        """Drafts [B, K]: draft 1 from ``out`` through the draft head, then K - 1 chained MTP steps one
        position on each (device tensors only: ``index`` the rows' sequence indices, ``delta`` their rope
        offsets)."""
        executor = self._executor
        assert executor is not None and self._head is not None
        kernels, lm_head = executor.kernels, self._head  # the ids of its rows are the tokens'
        drafts = [kernels.argmax(kernels.logits(out, lm_head), None)]
        for k in range(1, self.draft_tokens):
            step = self._chain_step(drafts[-1], positions + k, index, delta)
            out = self._mtp(drafts[-1], out, step)
            drafts.append(kernels.argmax(kernels.logits(out, lm_head), None))
        return torch.stack(drafts, dim=1)

    def _chain_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, index: torch.Tensor, delta: torch.Tensor
    ) -> StepBatch:
        """A one-token-per-row step at device ``positions`` (no host sync): the MTP layer's attention
        reads the row's block table and writes its KV slot there; no GDN state is touched."""
        executor = self._executor
        assert executor is not None
        steps = executor.steps
        device = positions.device
        rows = tokens.shape[0]
        table = steps.block_tables.index_select(0, index)
        ps = steps.page_size
        page = table.gather(1, (positions // ps).unsqueeze(1)).squeeze(1).long()
        zeros = torch.zeros(rows, dtype=torch.long, device=device)
        return StepBatch(
            token_ids=tokens,
            positions=(positions + delta).expand(3, -1),
            query_start=torch.arange(rows + 1, dtype=torch.int32, device=device),
            context_lens=(positions + 1).int(),
            block_table=table,
            slot_mapping=page * ps + positions % ps,
            state_in=zeros,
            state_out=zeros,
            fresh=torch.zeros(rows, dtype=torch.bool, device=device),
            tokens_per_row=1,
        )


def _row_lengths(batch: StepBatch) -> list[int]:
    bounds = batch.query_bounds()
    return [b - a for a, b in zip(bounds, bounds[1:])]
