"""`StepExecutor`: runs one step of the model over the Program's `StateStore`.

Two kinds of step, one forward (`model.forward`):

- **uniform**: B rows of exactly T tokens each (decode T = 1, a speculative verify T = K + 1). It replays
  the step graph captured for ``(B, T)`` when there is one (CUDA graphs on), else runs eagerly; either
  way it returns the logits of every token, and a graph also their argmax.
- **ragged**: rows of any lengths (prefill chunks, forced control), with the logits the caller asks for
  (each row's last token, every token, or none), an optional embedding splice (image features at their
  pad positions) and hidden-state taps. A one-row chunk that a captured capacity holds (text, or a
  prompt's with images and their splice), wanting its last token's logits or none, replays that
  capacity's prefill graphs (`prefill_graphs.PrefillGraphs`); the rest run eagerly.

Which slots a row reads and writes, and at which positions, is the caller's choice (the Program and its
decode backend); the executor only lays the step out (`StepBuilder`) and runs it.

Every step returns its hidden states (`StepRun.hidden`): the final norm's output [N, H], and, with
``taps`` (a drafter conditioned on the target's inner layers: DFlash), those layers' outputs after it,
[N, H * (1 + len(taps))], in graphs and eagerly alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch

from ninfer.targets.qwen3_6.impl.runtime.draws import StepRun
from ninfer.targets.qwen3_6.impl.runtime.graphs import StepGraphs
from ninfer.targets.qwen3_6.impl.runtime.prefill_graphs import PrefillGraphs
from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.impl.runtime.step import PackedStep, StepBuilder
from ninfer.targets.qwen3_6.kernels import Kernels
from ninfer.targets.qwen3_6.model import (
    ForwardOutput,
    LogitsMode,
    StateStore,
    StepBatch,
    forward,
    step_logits,
)
from ninfer.targets.qwen3_6.variant import Variant
from ninfer.targets.qwen3_6.view import ModelView


class StepExecutor:
    def __init__(
        self,
        variant: Variant,
        view: ModelView,
        store: StateStore,
        kernels: Kernels,
        steps: StepBuilder,
        *,
        graph_shapes: Iterable[tuple[int, int]] = (),
        prefill_capacities: Iterable[int] = (),
        scratch_slot: int = 0,
        taps: tuple[int, ...] = (),
    ) -> None:
        """``graph_shapes``: the ``(B, T)`` uniform steps to capture as CUDA graphs (none: all eager);
        ``prefill_capacities``: the one-row prefill chunk sizes to capture (the fast op table only).
        Capture runs here, before any sequence exists: its placeholder rows read and write state slot
        ``scratch_slot`` and KV page 0, which no committed state depends on yet. ``taps``: the layers
        whose outputs every step's hidden states carry after the final norm's (the module docstring)."""
        self.taps = taps
        self.variant = variant
        self.view = view
        self.store = store
        self.kernels = kernels
        self.steps = steps
        shapes = list(graph_shapes)
        self.graphs: StepGraphs | None = None
        if shapes:
            self.graphs = StepGraphs(
                self._graph_step, shapes, store.k_pages.device, scratch_slot, kernels.argmax
            )
        capacities = list(prefill_capacities)
        self.prefill_graphs: PrefillGraphs | None = None
        if capacities:
            self.prefill_graphs = PrefillGraphs(
                self._chunk_step, self._chunk_logits, kernels, capacities, page_size=steps.page_size,
                scratch_slot=scratch_slot, device=store.k_pages.device, hidden_size=variant.hidden_size,
                dtype=view.text.embed.dtype,
            )  # fmt: skip

    def uniform(
        self,
        seqs: Sequence[SequenceState],
        tokens: Sequence[int],
        tokens_per_row: int,
        *,
        state_in: Sequence[int],
        state_out: Sequence[int] | Sequence[Sequence[int]],
        offset: int = 0,
        fed: torch.Tensor | None = None,
    ) -> StepRun:
        """A step of ``tokens_per_row`` tokens for every row (`StepBuilder.uniform_values`); ``fed``: a
        decode whose input tokens are this device tensor (the unit before's draw) in place of
        ``tokens``. Returns the logits of every token."""
        rows = len(seqs)
        values = self.steps.uniform_values(
            seqs, tokens, tokens_per_row, state_in=state_in, state_out=state_out, offset=offset
        )
        if self.graphs is not None and self.graphs.has(rows, tokens_per_row):
            return StepRun(*self.graphs.run(values, rows, tokens_per_row, fed))
        step = self.steps.to_device(self.steps.uniform_step(values, rows, tokens_per_row))
        if fed is not None:
            step.fields().token_ids.copy_(fed)
        out = self._forward(step, None, "all")
        return StepRun(out.logits, step, None, out.hidden)

    def ragged(
        self,
        seqs: Sequence[SequenceState],
        inputs: Sequence[Sequence[int]],
        *,
        state_out: Sequence[int],
        logits: LogitsMode,
        splice: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> StepRun:
        """Rows of any lengths at their frontiers, from their current slots, final states to
        ``state_out`` (eagerly, or a prefill graph's replay). ``splice``: (token indices, embeddings)
        whose input embedding replaces the token's (image features at their pads)."""
        packed = self.steps.pack(seqs, inputs, state_out=state_out)
        graphs = self.prefill_graphs
        if graphs is not None and logits != "all" and _graph_chunk(packed, graphs):
            hidden, last = graphs.run(packed, logits == "last", splice)
            return StepRun(last, self.steps.to_device(packed), None, hidden)
        step = self.steps.to_device(packed)
        out = self._forward(step, None, logits, splice)
        return StepRun(out.logits, step, None, out.hidden)

    def _forward(
        self,
        step: PackedStep,
        feed: torch.Tensor | None,
        logits: LogitsMode,
        splice: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> ForwardOutput:
        batch = self.steps.unpack(step, feed)
        if splice is not None:
            batch = dataclasses.replace(batch, splice_index=splice[0], splice_embeds=splice[1])
        batch = self._with_taps(batch)
        out = forward(self.view, self.variant, batch, self.store, logits=logits, kernels=self.kernels)
        return self._tapped(out)

    def _with_taps(self, batch: StepBatch) -> StepBatch:
        if not self.taps:
            return batch
        tapped = dataclasses.replace(batch, taps=self.taps)
        tapped.memo.update(batch.memo)
        return tapped

    def _tapped(self, out: ForwardOutput) -> ForwardOutput:
        """``out`` with the tap layers' outputs after its hidden states."""
        if not self.taps:
            return out
        joined = torch.cat((out.hidden, *(out.taps[i] for i in self.taps)), dim=-1)
        return dataclasses.replace(out, hidden=joined)

    def _graph_step(self, step: PackedStep, feed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The work a step graph captures: the packed inputs unpacked (rows with a negative token id fed
        from ``feed``, the graph's own argmax buffer), then the forward to every token's logits."""
        out = self._forward(step, feed, "all")
        assert out.logits is not None
        return out.logits, out.hidden

    def _chunk_step(
        self,
        step: PackedStep,
        kernels: Kernels,
        memo: dict[str, object],
        splice: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[StepBatch, torch.Tensor]:
        """The work a prefill graph captures: the padded chunk unpacked, its dense splice (mask, embeddings)
        applied, then the forward to the hidden states (and the taps), under ``kernels`` and starting from
        ``memo``."""
        mask, embeds = splice
        unpacked = dataclasses.replace(self.steps.unpack(step), splice_mask=mask, splice_embeds=embeds)
        batch = self._with_taps(unpacked)
        batch.memo.update(memo)
        out = forward(self.view, self.variant, batch, self.store, logits="none", kernels=kernels)
        return batch, self._tapped(out).hidden

    def _chunk_logits(self, batch: StepBatch, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden[:, : self.variant.hidden_size]  # without the taps
        logits = step_logits(self.view, batch, hidden, "last", self.kernels)
        assert logits is not None
        return logits


def _graph_chunk(packed: PackedStep, graphs: PrefillGraphs) -> bool:
    """A one-row chunk of two or more tokens that a captured capacity holds."""
    return (
        packed.num_rows == 1
        and packed.tokens_per_row is None
        and graphs.capacity_for(packed.num_tokens) is not None
    )
