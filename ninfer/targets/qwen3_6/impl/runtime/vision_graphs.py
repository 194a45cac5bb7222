"""`VisionTower`: the Program's vision tower, with a CUDA graph per configured image grid, captured at start.

The tower's eager forward (`vision.vision_embeddings`) is some 490 launches for one 1,024 x 1,024 image,
18 a block: between its GEMMs and attention the small kernels finish before the host has launched the
next, so the host sets the pace there (run 28: a graph replay 3.16 against 6.87 ms at 448², 14.42
against 15.69 at 1024²). Its shapes depend only on the image's grid, so the grids the Program is
configured with (`ProgramConfig.vision_graph_grids`, from `EngineConfig.vision_graph_sizes`) are captured
at construction, as the specification wants every CUDA graph resource built before the Engine accepts
requests: no capture, allocation or device synchronisation happens on the request path.

One graph per image, keyed by its grid (so where a prefill chunk cuts and which images share a call do
not change the key): a call replays the graph of each image whose grid has one (its pixels copied into
the static input, its features cloned out of the static output, since a prompt keeps them across other
replays) and runs the other images eagerly together. The graphs' static input and output are views of
one buffer pair of the largest grid, and they share one memory pool (one runs at a time, and each
replay's output is copied out before the next): the memory plan counts both (`memory.vision_graph_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.targets.qwen3_6.kernels import Kernels
from ninfer.targets.qwen3_6.variant import VisionDims
from ninfer.targets.qwen3_6.view import VisionView
from ninfer.targets.qwen3_6.vision import Grid, check_grids, vision_embeddings, vision_tokens

Tensor = torch.Tensor


def patches(grid: Grid) -> int:
    t, h, w = grid
    return t * h * w


class VisionTower:
    """``tower(pixels, grids)`` -> the images' features (`vision_embeddings`' result, images in order);
    images whose grid was captured replay its graph (module docstring)."""

    def __init__(
        self, view: VisionView, dims: VisionDims, kernels: Kernels, *, graph_grids: Sequence[Grid] = ()
    ) -> None:
        """``graph_grids``: the grids to capture (CUDA only; ignored elsewhere)."""
        self.view, self.dims, self.kernels = view, dims, kernels
        self.replays = 0  # images served by a graph (observability; tests read it)
        self._graphs: dict[Grid, torch.cuda.CUDAGraph] = {}
        weight = view.patch_embed_weight
        grids = sorted({_grid(g) for g in graph_grids}, key=patches, reverse=True)  # the pool fits the rest
        if not grids or weight.device.type != "cuda":
            return
        width = dims.in_channels * dims.temporal_patch_size * dims.patch_size**2
        self._pixels = torch.zeros(patches(grids[0]), width, dtype=weight.dtype, device=weight.device)
        self._features = torch.zeros(
            vision_tokens(grids[:1], dims), dims.out_hidden_size, dtype=weight.dtype, device=weight.device
        )
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=weight.device)
        stream.wait_stream(torch.cuda.current_stream(weight.device))
        with torch.cuda.stream(stream):
            for grid in grids:
                pixels, out = self._static(grid)
                for _ in range(2):  # kernels compiled, library plans made, outside the capture
                    out.copy_(vision_embeddings(view, dims, pixels, [grid], kernels))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out.copy_(vision_embeddings(view, dims, pixels, [grid], kernels))
                self._graphs[grid] = graph
        torch.cuda.current_stream(weight.device).wait_stream(stream)

    @property
    def graph_grids(self) -> tuple[Grid, ...]:
        return tuple(self._graphs)

    def __call__(self, pixels: Tensor, grids: Sequence[Grid]) -> Tensor:
        keys = [_grid(g) for g in grids]
        check_grids(pixels, keys, self.dims)
        if not any(k in self._graphs for k in keys):
            return vision_embeddings(self.view, self.dims, pixels, keys, self.kernels)
        parts = pixels.split([patches(k) for k in keys])
        eager = [i for i, k in enumerate(keys) if k not in self._graphs]
        rest: list[Tensor] = []
        if eager:  # the images without a graph in one eager call, then split back per image
            out = vision_embeddings(
                self.view, self.dims, torch.cat([parts[i] for i in eager]), [keys[i] for i in eager],
                self.kernels,
            )  # fmt: skip
            rest = list(out.split([vision_tokens([keys[i]], self.dims) for i in eager]))
        features = []
        for part, key in zip(parts, keys):
            graph = self._graphs.get(key)
            if graph is None:
                features.append(rest.pop(0))
                continue
            static_in, static_out = self._static(key)
            static_in.copy_(part)  # the eager forward's own cast to the weights' dtype
            graph.replay()
            features.append(static_out.clone())
            self.replays += 1
        return torch.cat(features)

    def _static(self, grid: Grid) -> tuple[Tensor, Tensor]:
        return self._pixels[: patches(grid)], self._features[: vision_tokens([grid], self.dims)]


def _grid(grid: Sequence[int]) -> Grid:
    t, h, w = (int(v) for v in grid)
    return (t, h, w)
