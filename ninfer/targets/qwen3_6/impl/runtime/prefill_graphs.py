"""CUDA graphs of one-row prefill chunks, one per capacity (64, 128, ... tokens).

A prefill chunk's eager forward costs the host about a hundred milliseconds whatever its size up to about
a thousand tokens (hundreds of Triton launches through their Python wrappers): the floor under every
chunk interleaved with decoding. A chunk of n tokens instead replays the graph of the smallest capacity
T >= n, its tokens laid out at T (`StepBuilder.padded_values`: padding after them, never cached, the
row's bounds [0, n] on the device; `StepBatch.padded` says what each op does with it: the prefill
attention reads the row's bounds, lengths and pages on the device and writes the padding's output as
zeros). The whole forward is one graph; the last token's logits are a second, replayed only when the
caller wants them (a prompt's last chunk).

Each graph reads the padded packed step (staged through pinned memory as the decode graphs',
`graphs.StepGraphs`), with the three M-RoPE axes of a prompt with images (a text chunk's are its
positions), and an embedding splice in its dense form (`StepBatch.splice_mask`): a mask and an [T, H]
buffer, shared by all capacities, that a chunk with image pads fills with the image features (a text
chunk leaves the mask clear). So a chunk of a prompt with images replays like a text chunk. Capture
runs at Program construction, from `StepBuilder.placeholder_chunk` (state slot ``scratch_slot``, KV
page 0), two eager warm-ups first; the graphs of all capacities share one memory pool (only one runs at a
time).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ninfer.targets.qwen3_6.impl.runtime.step import PackedStep, StepBuilder
from ninfer.targets.qwen3_6.kernels import Kernels
from ninfer.targets.qwen3_6.model import StepBatch

Tensor = torch.Tensor
# (the packed device inputs, the op table, the memo to start the step's from, the dense splice (mask [N],
# embeddings [N, H])) -> (the step, hidden [N, H])
ChunkFn = Callable[[PackedStep, Kernels, dict[str, object], tuple[Tensor, Tensor]], tuple[StepBatch, Tensor]]
LogitsFn = Callable[[StepBatch, Tensor], Tensor]  # (the step, hidden) -> the last token's logits [1, V]
# the smallest capacity: fla's chunk length, below which a chunk costs the GPU no less
MIN_CAPACITY = 64


def capacities(largest: int, max_context: int) -> list[int]:
    """The capacities captured: 64, 128, ... up to ``largest`` tokens and the context."""
    out, size = [], MIN_CAPACITY
    while size <= min(largest, max_context):
        out.append(size)
        size *= 2
    return out


@dataclass(eq=False)
class _Chunk:
    """The graphs of one capacity, their static input and outputs."""

    inputs: PackedStep
    staging: list[Tensor]
    copied: list[torch.cuda.Event]
    graph: torch.cuda.CUDAGraph = dataclasses.field(default_factory=torch.cuda.CUDAGraph)
    logits_graph: torch.cuda.CUDAGraph = dataclasses.field(default_factory=torch.cuda.CUDAGraph)
    batch: StepBatch | None = None
    hidden: Tensor | None = None
    logits: Tensor | None = None
    turn: int = 0


class PrefillGraphs:
    """Captured one-row prefill chunks by capacity; `run` replays the smallest capacity that holds one."""

    def __init__(
        self,
        chunk: ChunkFn,
        logits: LogitsFn,
        kernels: Kernels,
        capacities: Iterable[int],
        *,
        page_size: int,
        scratch_slot: int,
        device: torch.device,
        hidden_size: int,
        dtype: torch.dtype,
    ) -> None:
        from ninfer.ops.triton.schedule import checked_schedule

        self._chunks: dict[int, _Chunk] = {}
        self.replays: dict[int, int] = {}  # capacity -> replay count (observability; tests read it)
        self.spliced_replays = 0  # replays of chunks with image pads (tests read it)
        largest = max(capacities, default=0)
        # the dense splice every capacity's graph reads (views of one buffer pair: one graph runs at a time)
        self._splice_mask = torch.zeros(largest, dtype=torch.bool, device=device)
        self._splice_embeds = torch.zeros(largest, hidden_size, dtype=dtype, device=device)
        self._mask_set = False  # the last spliced replay left mask entries set
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            # the largest first: the pool then fits the smaller ones
            for capacity in sorted(set(capacities), reverse=True):
                inputs = StepBuilder.placeholder_chunk(capacity, page_size, scratch_slot, device)
                staging = [torch.empty_like(inputs.values, device="cpu").pin_memory() for _ in range(2)]
                c = _Chunk(inputs, staging, [torch.cuda.Event(), torch.cuda.Event()])
                memo: dict[str, object] = {}
                splice = (self._splice_mask[:capacity], self._splice_embeds[:capacity])
                for _ in range(2):  # kernels compiled and tuned, library handles made, outside the capture
                    warm, hidden = chunk(inputs, kernels, {}, splice)
                    logits(warm, hidden)
                    memo = warm.memo  # made from the host facts, which every replay shares
                with checked_schedule(), torch.cuda.graph(c.graph, pool=pool, stream=stream):
                    c.batch, c.hidden = chunk(inputs, kernels, dict(memo), splice)
                with torch.cuda.graph(c.logits_graph, pool=pool, stream=stream):
                    c.logits = logits(c.batch, c.hidden)
                self._chunks[capacity] = c
        torch.cuda.current_stream(device).wait_stream(stream)
        self.capacities = sorted(self._chunks)

    def capacity_for(self, tokens: int) -> int | None:
        """The smallest capacity that holds a chunk of ``tokens`` tokens, or None."""
        i = bisect.bisect_left(self.capacities, tokens)
        return self.capacities[i] if i < len(self.capacities) else None

    def run(
        self, packed: PackedStep, logits: bool, splice: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Replay a one-row chunk (`pack`'s host step, at most the largest capacity; ``splice``: its
        (token indices, embeddings) of image pads) -> (hidden [n, H] after the final norm, the last
        token's fp32 logits [1, V] or None), valid until the next replay of any capacity."""
        n = packed.num_tokens
        capacity = self.capacity_for(n)
        if capacity is None:
            raise ValueError(f"no prefill graph holds {n} tokens (capacities {self.capacities})")
        c = self._chunks[capacity]
        assert c.hidden is not None and c.logits is not None
        turn, c.turn = c.turn, c.turn ^ 1
        c.copied[turn].synchronize()  # at once, unless that copy belongs to a unit still queued
        c.staging[turn].numpy()[:] = StepBuilder.padded_values(packed, capacity)
        c.inputs.values.copy_(c.staging[turn], non_blocking=True)
        c.copied[turn].record()
        if self._mask_set:  # device writes in stream order: the replay before has read them
            self._splice_mask.zero_()
            self._mask_set = False
        if splice is not None:
            index, embeds = splice
            self._splice_mask.index_fill_(0, index, True)
            self._splice_embeds.index_copy_(0, index, embeds.to(self._splice_embeds.dtype))
            self._mask_set = True
            self.spliced_replays += 1
        c.graph.replay()
        if logits:
            c.logits_graph.replay()
        self.replays[capacity] = self.replays.get(capacity, 0) + 1
        return c.hidden[:n], c.logits if logits else None
