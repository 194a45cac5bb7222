"""CUDA graphs for the decode unit, one per exact batch size ``B`` (1..max_concurrency).

A graph reads one static buffer: the step's packed host facts (`step.PackedStep`: token ids,
positions, KV slots, context lengths, state slots, fresh flags, sequence indices), copied in with one
host-to-device copy before replay. Unpacking them into the model's `StepBatch` (casts, the block-table
gather) is part of the captured work. Request identity and page ids are data, never part of the key,
so one graph per ``B`` serves every mix of requests. Graphs share one memory pool and are captured
once, at Program construction (warmup), never on the request path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ninfer.targets.qwen3_6.impl.runtime.step import PackedStep, packed_length
from ninfer.targets.qwen3_6.model import StepBatch

DecodeFn = Callable[[StepBatch], torch.Tensor]
# (packed device values, num_tokens, num_rows) -> the StepBatch over them
Unpack = Callable[[torch.Tensor, int, int], StepBatch]


class _Graph:
    def __init__(self, b: int, scratch_slot: int, device: torch.device) -> None:
        # placeholder inputs for capture: every row reads and writes one scratch state slot and KV slot 0
        # of page 0, which no committed state depends on (the spare slot of lane 0 is overwritten by the
        # next unit before it is read); sequence index 0's block table row
        zeros = [0] * b
        self.packed = torch.tensor(
            zeros * 3 + list(range(b + 1)) + [1] * b + [scratch_slot] * 2 * b + zeros * 2,
            dtype=torch.long,
            device=device,
        )
        assert self.packed.numel() == packed_length(b, b)
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None


class DecodeGraphs:
    """Captured decode steps keyed by exact ``B``; `run` replays the one for the step's B."""

    def __init__(
        self, fn: DecodeFn, unpack: Unpack, max_batch: int, device: torch.device, scratch_slot: int
    ) -> None:
        self._graphs: dict[int, _Graph] = {}
        self.replays: dict[int, int] = {}  # B -> replay count (observability; tests read it)
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for b in range(max_batch, 0, -1):  # largest first: the pool then fits the smaller ones
                g = _Graph(b, scratch_slot, device)

                def step(g: _Graph = g, b: int = b) -> torch.Tensor:
                    return fn(unpack(g.packed, b, b))

                for _ in range(2):  # warm allocator and library handles outside the capture
                    step()
                with torch.cuda.graph(g.graph, pool=self._pool, stream=stream):
                    g.logits = step()
                self._graphs[b] = g
        torch.cuda.current_stream(device).wait_stream(stream)

    @property
    def sizes(self) -> list[int]:
        return sorted(self._graphs)

    def run(self, step: PackedStep) -> torch.Tensor:
        if not step.is_decode:
            rows, tokens = step.num_rows, step.num_tokens
            raise ValueError(f"a decode graph takes one token per row: {tokens} tokens for {rows} rows")
        g = self._graphs[step.num_rows]
        g.packed.copy_(step.values, non_blocking=True)
        g.graph.replay()
        self.replays[step.num_rows] = self.replays.get(step.num_rows, 0) + 1
        assert g.logits is not None
        return g.logits
