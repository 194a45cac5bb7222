"""Piecewise CUDA graphs of one-row prefill chunks, one set per capacity (64, 128, ... tokens).

A prefill chunk's eager forward costs the host about a hundred milliseconds whatever its size up to about
a thousand tokens (hundreds of Triton launches through their Python wrappers): the floor under every
chunk interleaved with decoding. A chunk of n tokens instead replays the graphs of the smallest capacity
T >= n, its tokens laid out at T (`StepBuilder.padded_values`: padding after them, never cached, the
row's bounds [0, n] on the device; `StepBatch.padded` says what each op does with it).

The graphs are pieces: the forward is captured up to each attention layer's prefill attention, which
runs eagerly between two replays over the row's real n queries and its context (its launch sizes depend
on both), then the next piece from the attention output on (vLLM's piecewise graphs, cut by hand at the
op table's ``prefill_attention``). The last token's logits are one more piece, replayed only when the
caller wants them (a prompt's last chunk).

Every piece reads one static input, the padded packed step (staged through pinned memory as the decode
graphs', `graphs.StepGraphs`), and the buffers the piece before left: the attention breaks keep each
layer's q (a capture output) and share one output buffer, whose rows past n stay zero. Capture runs at
Program construction, from `StepBuilder.placeholder_chunk` (state slot ``scratch_slot``, KV page 0), two
eager warm-ups first; the pieces of all capacities share one memory pool (only one set runs at a time,
each in its capture order).
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
# (the packed device inputs, the op table, the memo to start the step's from) -> (the step, hidden [N, H])
ChunkFn = Callable[[PackedStep, Kernels, dict[str, object]], tuple[StepBatch, Tensor]]
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


@dataclass(frozen=True, eq=False)
class _Attention:
    """One attention layer's cut: what its eager prefill attention reads and where it writes."""

    q: Tensor  # [capacity, heads, dim], written by the piece before
    k_pages: Tensor
    v_pages: Tensor
    scale: float
    out: Tensor  # [capacity, heads, dim], read by the piece after (shared by every cut)


@dataclass(eq=False)
class _Chunk:
    """The pieces of one capacity, their static input and outputs."""

    inputs: PackedStep
    staging: list[Tensor]
    copied: list[torch.cuda.Event]
    pieces: list[torch.cuda.CUDAGraph] = dataclasses.field(default_factory=list)
    cuts: list[_Attention] = dataclasses.field(default_factory=list)
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
    ) -> None:
        from ninfer.ops.triton.schedule import checked_schedule

        self._attention = kernels.prefill_attention
        self._chunks: dict[int, _Chunk] = {}
        self.replays: dict[int, int] = {}  # capacity -> replay count (observability; tests read it)
        self._out: Tensor | None = None  # the cuts' shared attention output, at the largest capacity
        self._pool = torch.cuda.graph_pool_handle()
        self._capturing: torch.cuda.CUDAGraph | None = None
        self._current: _Chunk | None = None
        cut = dataclasses.replace(kernels, prefill_attention=self._cut)
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            # the largest first: the pool then fits the smaller ones
            for capacity in sorted(set(capacities), reverse=True):
                inputs = StepBuilder.placeholder_chunk(capacity, page_size, scratch_slot, device)
                staging = [torch.empty_like(inputs.values, device="cpu").pin_memory() for _ in range(2)]
                c = _Chunk(inputs, staging, [torch.cuda.Event(), torch.cuda.Event()])
                memo: dict[str, object] = {}
                for _ in range(2):  # kernels compiled and tuned, library handles made, outside the capture
                    warm, hidden = chunk(inputs, kernels, {})
                    logits(warm, hidden)
                    memo = warm.memo  # made from the host facts, which every replay shares
                self._current = c
                with checked_schedule():
                    self._begin()
                    try:
                        c.batch, c.hidden = chunk(inputs, cut, dict(memo))
                    finally:  # a failed piece ends its capture, so the error is the piece's own
                        if self._capturing is not None:
                            self._end()
                with torch.cuda.graph(c.logits_graph, pool=self._pool, stream=stream):
                    c.logits = logits(c.batch, c.hidden)
                self._chunks[capacity] = c
        self._current = None
        torch.cuda.current_stream(device).wait_stream(stream)
        self.capacities = sorted(self._chunks)

    def capacity_for(self, tokens: int) -> int | None:
        """The smallest capacity that holds a chunk of ``tokens`` tokens, or None."""
        i = bisect.bisect_left(self.capacities, tokens)
        return self.capacities[i] if i < len(self.capacities) else None

    def run(self, packed: PackedStep, logits: bool) -> tuple[Tensor, Tensor | None]:
        """Replay a one-row text chunk (`pack`'s host step, at most the largest capacity) -> (hidden
        [n, H] after the final norm, the last token's fp32 logits [1, V] or None), valid until the next
        replay of any capacity."""
        n = packed.num_tokens
        capacity = self.capacity_for(n)
        if capacity is None:
            raise ValueError(f"no prefill graph holds {n} tokens (capacities {self.capacities})")
        c = self._chunks[capacity]
        assert c.batch is not None and c.hidden is not None and c.logits is not None and self._out is not None
        turn, c.turn = c.turn, c.turn ^ 1
        c.copied[turn].synchronize()  # at once, unless that copy belongs to a unit still queued
        c.staging[turn].numpy()[:] = StepBuilder.padded_values(packed, capacity)
        c.inputs.values.copy_(c.staging[turn], non_blocking=True)
        c.copied[turn].record()
        # the eager attention's view of the row: its real queries and context (host facts, no device read)
        row = dataclasses.replace(
            c.batch, query_start_host=(0, n), context_lens_host=packed.context_lens_host, padded=False
        )
        self._out[n:capacity].zero_()  # the padding's attention output: zeros, whatever ran before
        for piece, cut in zip(c.pieces, [*c.cuts, None]):
            piece.replay()
            if cut is not None:
                cut.out[:n].copy_(self._attention(cut.q[:n], cut.k_pages, cut.v_pages, row, cut.scale))
        if logits:
            c.logits_graph.replay()
        self.replays[capacity] = self.replays.get(capacity, 0) + 1
        return c.hidden[:n], c.logits if logits else None

    # ---- capture --------------------------------------------------------------------------------
    def _begin(self) -> None:
        self._capturing = torch.cuda.CUDAGraph()
        self._capturing.capture_begin(pool=self._pool)

    def _end(self) -> None:
        assert self._capturing is not None and self._current is not None
        self._capturing.capture_end()
        self._current.pieces.append(self._capturing)
        self._capturing = None

    def _cut(self, q: Tensor, k_pages: Tensor, v_pages: Tensor, step: object, scale: float) -> Tensor:
        """The op table's ``prefill_attention`` during a capture: end the piece, note the cut, begin the
        next piece, which reads the cut's output buffer."""
        assert self._current is not None
        self._end()
        if self._out is None:  # made outside any capture, at the largest capacity (captured first)
            self._out = torch.zeros_like(q)
        out = self._out[: q.shape[0]]
        self._current.cuts.append(_Attention(q, k_pages, v_pages, scale, out))
        self._begin()
        return out
