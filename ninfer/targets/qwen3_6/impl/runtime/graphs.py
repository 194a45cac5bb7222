"""CUDA graphs of uniform steps, one per exact shape ``(B, T)``: B rows of T tokens each (decode T = 1,
a speculative verify T = K + 1).

A graph reads one static buffer: the step's packed host facts (`step.PackedStep`: token ids, positions,
KV slots, context lengths, state slots, fresh flags, sequence indices, and for T > 1 the per-position
state slots), written as a plain list (`StepBuilder.uniform_values`) into a pinned staging buffer (two
per graph, used in turn, for the Program's decode lookahead) and copied in with one host-to-device copy
before replay. Unpacking them into the model's `StepBatch` (casts, the block-table gather) is part of
the captured work. A decode lookahead's input tokens are the previous unit's draw, on the device: when
that unit was this graph's last replay and its rows took the graph's argmax, the replay reads them where
the argmax wrote them (the packed token ids are -1, `StepBuilder.unpack`'s ``feed``), with no device
copy queued between the two replays; any other draw (the sampler's, a subset of rows) is copied over the
token ids first. Request identity and page ids are data, never part of the key, so one graph per shape
serves every mix of requests. Graphs share one memory pool and are captured once, at Program
construction, never on the request path.

Every capture runs under the PDL schedule check (`ninfer.ops.triton.schedule.checked_schedule`): a
captured step whose launches could overlap a kernel's early reads with another's writes is refused at
start, before any request runs.

Each graph computes the logits of every token (``[B*T, V]``, fp32), their argmax (the op table's) and
keeps the final hidden states (``[B*T, H]``, a drafter's input): greedy rows without penalties or
log-probs take their tokens from the argmax and skip the sampler's launches after the replay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from ninfer.targets.qwen3_6.impl.runtime.step import PackedStep, StepBuilder

# (the packed device inputs, the feed: the graph's own argmax buffer) -> (logits [N, V], hidden [N, H])
StepFn = Callable[[PackedStep, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
ArgmaxFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]  # (logits, out) -> argmax


class GraphRun(NamedTuple):
    """A replay's static outputs (valid until the next replay of any graph: they share one pool)."""

    logits: torch.Tensor  # [B*T, V] fp32
    step: PackedStep  # the static inputs, on the device
    greedy: torch.Tensor  # [B*T] int64: the argmax of each token's logits
    hidden: torch.Tensor  # [B*T, H] after the final norm


class _Graph:
    def __init__(self, rows: int, tokens: int, scratch_slot: int, device: torch.device) -> None:
        self.inputs = StepBuilder.placeholder(rows, tokens, scratch_slot, device)  # the static input buffer
        # pinned host staging of the same size (a copy from pageable memory costs the host a staged,
        # synchronous transfer), two buffers used in turn: with the Program's lookahead a replay is
        # queued while the one before it has not run, so a buffer is rewritten only once the copy that
        # last read it has run (its event)
        self.staging = [torch.empty_like(self.inputs.values, device="cpu").pin_memory() for _ in range(2)]
        self.staging_arrays = [s.numpy() for s in self.staging]  # the same memory: lists go in directly
        self.copied = [torch.cuda.Event(), torch.cuda.Event()]
        self.turn = 0
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        self.greedy: torch.Tensor | None = None  # [B*T] int64: argmax of each token's logits


class StepGraphs:
    """Captured uniform steps keyed by exact ``(B, T)``; `run` replays the one for the step's shape."""

    def __init__(
        self,
        fn: StepFn,
        shapes: Iterable[tuple[int, int]],
        device: torch.device,
        scratch_slot: int,
        argmax: ArgmaxFn = lambda logits, out: torch.argmax(logits, dim=-1, out=out),
    ) -> None:
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.replays: dict[tuple[int, int], int] = {}  # shape -> replay count (observability; tests read it)
        self.fed_in_place = 0  # replays that read the last replay's argmax as their tokens (tests read it)
        from ninfer.ops.triton.schedule import checked_schedule

        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        # the largest step first: the pool then fits the smaller ones
        with torch.cuda.stream(stream):
            for rows, tokens in sorted(set(shapes), key=lambda s: (s[0] * s[1], s), reverse=True):
                g = _Graph(rows, tokens, scratch_slot, device)
                for _ in range(2):  # warm allocator, library handles and kernel modules outside the capture
                    out = torch.empty(rows * tokens, dtype=torch.int64, device=device)
                    argmax(fn(g.inputs, out if tokens == 1 else None)[0], out)
                # the schedule check wraps the capture: it records every PDL launch of the step and, once
                # the capture ended, asserts that no kernel reads early what a launch it may overlap writes
                with (
                    checked_schedule(tokens_per_row=tokens),
                    torch.cuda.graph(g.graph, pool=self._pool, stream=stream),
                ):
                    # the argmax's output, allocated before the step that reads it as the next replay's feed
                    g.greedy = torch.empty(rows * tokens, dtype=torch.int64, device=device)
                    g.logits, g.hidden = fn(g.inputs, g.greedy if tokens == 1 else None)
                    argmax(g.logits, g.greedy)
                self._graphs[(rows, tokens)] = g
        torch.cuda.current_stream(device).wait_stream(stream)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)

    @property
    def sizes(self) -> list[int]:
        """The batch sizes of the one-token (decode) graphs."""
        return sorted(b for b, t in self._graphs if t == 1)

    def has(self, rows: int, tokens: int) -> bool:
        return (rows, tokens) in self._graphs

    def graph(self, rows: int, tokens: int) -> torch.cuda.CUDAGraph:
        return self._graphs[(rows, tokens)].graph

    def run(
        self, values: list[int], rows: int, tokens_per_row: int, fed: torch.Tensor | None = None
    ) -> GraphRun:
        """Copy a uniform step's packed ``values`` (`StepBuilder.uniform_values`) in and replay.

        ``fed`` (one token per row only): the rows' input tokens as a device tensor (the tokens drawn by
        the unit before, not yet read back): read in place when they are this graph's argmax buffer (its
        last replay's draw), else copied over the token ids in ``values``.
        """
        g = self._graphs[(rows, tokens_per_row)]
        turn, g.turn = g.turn, g.turn ^ 1
        g.copied[turn].synchronize()  # at once, unless that copy belongs to a unit still queued
        g.staging_arrays[turn][:] = values
        fed_in_place = fed is not None and fed is g.greedy
        if fed_in_place:
            g.staging_arrays[turn][:rows] = -1  # the token ids: the graph's unpack reads its feed instead
            self.fed_in_place += 1
        g.inputs.values.copy_(g.staging[turn], non_blocking=True)
        g.copied[turn].record()
        if fed is not None and not fed_in_place:
            g.inputs.fields().token_ids.copy_(fed)
        g.graph.replay()
        key = (rows, tokens_per_row)
        self.replays[key] = self.replays.get(key, 0) + 1
        assert g.logits is not None and g.greedy is not None and g.hidden is not None
        return GraphRun(g.logits, g.inputs, g.greedy, g.hidden)
