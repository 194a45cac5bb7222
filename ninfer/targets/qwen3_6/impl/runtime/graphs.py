"""CUDA graphs for the decode unit, one per exact batch size ``B`` (1..max_concurrency).

A graph reads one static buffer: the step's packed host facts (`step.PackedStep`: token ids,
positions, KV slots, context lengths, state slots, fresh flags, sequence indices), written as a plain
list (`StepBuilder.decode_values`) into a pinned staging buffer (two per graph, used in turn, for the
Program's decode lookahead) and copied in with one host-to-device copy before replay. Unpacking them into
the model's `StepBatch` (casts, the block-table gather) is part of the captured work. A lookahead's input
tokens are the previous unit's draw, on the device: when that unit was this graph's last replay and its
rows took the graph's argmax, the replay reads them where the argmax wrote them (the packed token ids
are -1, `StepBuilder.unpack`'s ``feed``), with no device copy queued between the two replays; any other
draw (the sampler's, a subset of rows) is copied over the token ids first. Request identity
and page ids are data, never part of the key, so one graph per ``B`` serves every mix of requests.
Graphs share one memory pool and are captured once, at Program construction (warmup), never on the
request path.

Each graph ends with the argmax of its logits (``argmax``, the op table's): rows that all decode
greedily, without penalties or log-probs, take their tokens from it and skip the sampler's launches after
the replay (steps that still run the sampler pay for one unused argmax over the vocabulary inside the
graph).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ninfer.targets.qwen3_6.impl.runtime.step import PackedStep, StepBuilder

# (the packed device inputs, the feed: the graph's own argmax buffer) -> last-token logits
DecodeFn = Callable[[PackedStep, torch.Tensor], torch.Tensor]
ArgmaxFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]  # (logits, out) -> argmax


class _Graph:
    def __init__(self, b: int, scratch_slot: int, device: torch.device) -> None:
        self.inputs = StepBuilder.placeholder(b, scratch_slot, device)  # the static input buffer
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
        self.greedy: torch.Tensor | None = None  # [B] int64: argmax of each row's logits


class DecodeGraphs:
    """Captured decode steps keyed by exact ``B``; `run` replays the one for the step's B."""

    def __init__(
        self,
        fn: DecodeFn,
        max_batch: int,
        device: torch.device,
        scratch_slot: int,
        argmax: ArgmaxFn = lambda logits, out: torch.argmax(logits, dim=-1, out=out),
    ) -> None:
        self._graphs: dict[int, _Graph] = {}
        self.replays: dict[int, int] = {}  # B -> replay count (observability; tests read it)
        self.fed_in_place = 0  # replays that read the last replay's argmax as their tokens (tests read it)
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for b in range(max_batch, 0, -1):  # largest first: the pool then fits the smaller ones
                g = _Graph(b, scratch_slot, device)
                for _ in range(2):  # warm allocator, library handles and kernel modules outside the capture
                    feed = torch.empty(b, dtype=torch.int64, device=device)
                    argmax(fn(g.inputs, feed), feed)
                with torch.cuda.graph(g.graph, pool=self._pool, stream=stream):
                    # the argmax's output, allocated before the step that reads it as the next replay's feed
                    g.greedy = torch.empty(b, dtype=torch.int64, device=device)
                    g.logits = fn(g.inputs, g.greedy)
                    argmax(g.logits, g.greedy)
                self._graphs[b] = g
        torch.cuda.current_stream(device).wait_stream(stream)

    @property
    def sizes(self) -> list[int]:
        return sorted(self._graphs)

    def run(
        self, values: list[int], rows: int, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, PackedStep, torch.Tensor]:
        """Copy a decode step's packed ``values`` (`StepBuilder.decode_values`, ``rows`` rows) in and
        replay: (logits, the step on the device, each row's argmax token).

        ``tokens``: the rows' input tokens as a device tensor (the sampled tokens of the unit before,
        not yet read back): read in place when they are this graph's argmax buffer (its last replay's
        draw), else copied over the token ids in ``values``.
        All three results are the graphs' static buffers (one shared pool): valid until the next `run`.
        """
        g = self._graphs[rows]
        turn, g.turn = g.turn, g.turn ^ 1
        g.copied[turn].synchronize()  # at once, unless that copy belongs to a unit still queued
        g.staging_arrays[turn][:] = values
        fed_in_place = tokens is g.greedy
        if fed_in_place:
            g.staging_arrays[turn][:rows] = -1  # the token ids: the graph's unpack reads its feed instead
            self.fed_in_place += 1
        g.inputs.values.copy_(g.staging[turn], non_blocking=True)
        g.copied[turn].record()
        if tokens is not None and not fed_in_place:
            g.inputs.fields().token_ids.copy_(tokens)
        g.graph.replay()
        self.replays[rows] = self.replays.get(rows, 0) + 1
        assert g.logits is not None and g.greedy is not None
        return g.logits, g.inputs, g.greedy
