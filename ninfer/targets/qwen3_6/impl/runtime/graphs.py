"""CUDA graphs for the decode unit, one per exact batch size ``B`` (1..max_concurrency).

A graph reads its inputs from static buffers: token ids, positions, context lengths, block tables, KV
slot mapping and state slots are copied in before replay. Request identity and page ids are data,
never part of the key, so one graph per ``B`` serves every mix of requests. Graphs share one memory
pool and are captured once, at Program construction (warmup), never on the request path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ninfer.targets.qwen3_6.model import StepBatch

DecodeFn = Callable[[StepBatch], torch.Tensor]


class _Graph:
    def __init__(self, b: int, max_pages: int, device: torch.device) -> None:
        i32, i64 = torch.int32, torch.long
        self.batch = StepBatch(
            token_ids=torch.zeros(b, dtype=i64, device=device),
            positions=torch.zeros(3, b, dtype=i64, device=device),
            query_start=torch.arange(b + 1, dtype=i32, device=device),
            context_lens=torch.ones(b, dtype=i32, device=device),
            block_table=torch.zeros(b, max_pages, dtype=i32, device=device),
            slot_mapping=torch.zeros(b, dtype=i64, device=device),
            state_in=torch.zeros(b, dtype=i64, device=device),
            state_out=torch.zeros(b, dtype=i64, device=device),
            fresh=torch.zeros(b, dtype=torch.bool, device=device),
        )
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None

    def load(self, src: StepBatch) -> None:
        dst = self.batch
        for name in (
            "token_ids",
            "positions",
            "context_lens",
            "block_table",
            "slot_mapping",
            "state_in",
            "state_out",
            "fresh",
        ):
            getattr(dst, name).copy_(getattr(src, name), non_blocking=True)


class DecodeGraphs:
    """Captured decode steps keyed by exact ``B``; `run` replays the one for ``batch``'s B."""

    def __init__(
        self, fn: DecodeFn, max_batch: int, max_pages: int, device: torch.device, scratch_slot: int
    ) -> None:
        self._fn = fn
        self._graphs: dict[int, _Graph] = {}
        self.replays: dict[int, int] = {}  # B -> replay count (observability; tests read it)
        self._pool = torch.cuda.graph_pool_handle()
        # capture runs the step once on placeholder inputs: point every row at one scratch state slot
        # and KV slot 0 of page 0, which no committed state depends on (the spare slot of lane 0 is
        # overwritten by the next unit before it is read)
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for b in range(max_batch, 0, -1):  # largest first: the pool then fits the smaller ones
                g = _Graph(b, max_pages, device)
                g.batch.state_in.fill_(scratch_slot)
                g.batch.state_out.fill_(scratch_slot)
                for _ in range(2):  # warm allocator and library handles outside the capture
                    fn(g.batch)
                with torch.cuda.graph(g.graph, pool=self._pool, stream=stream):
                    g.logits = fn(g.batch)
                self._graphs[b] = g
        torch.cuda.current_stream(device).wait_stream(stream)

    @property
    def sizes(self) -> list[int]:
        return sorted(self._graphs)

    def run(self, batch: StepBatch) -> torch.Tensor:
        g = self._graphs[batch.num_rows]
        g.load(batch)
        g.graph.replay()
        self.replays[batch.num_rows] = self.replays.get(batch.num_rows, 0) + 1
        assert g.logits is not None
        return g.logits
