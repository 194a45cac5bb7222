"""`VisionTower`: the Program's vision tower, replayed as a CUDA graph for image grids it has seen before.

The tower's eager forward (`vision.vision_embeddings`) is some 490 launches for one 1,024 x 1,024 image,
18 a block: between its GEMMs and attention the small kernels finish faster than the host launches
them, so the host sets the pace there. Its shapes depend only on the images' grids, so a call whose grid
list was seen before replays a graph captured for that list: the pixels copied into the graph's static
input, the features cloned out of its static output (a prompt keeps its features until its prefill has
passed the image pads, across other images' replays).

A grid list is captured the second time it is seen (an image size seen once costs no capture): a
warm-up run on the capture stream gives that call's output, then the capture. At most ``max_graphs``
lists are kept (the least recently used dropped), each of at most ``max_patches`` patches (the vision
workspace the memory plan counts); they share one memory pool, as only one runs at a time. A list
whose capture fails runs eagerly from then on. Without CUDA graphs (CPU, `ProgramConfig.cuda_graphs`
off) every call is the eager tower.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer.targets.qwen3_6.kernels import Kernels
from ninfer.targets.qwen3_6.variant import VisionDims
from ninfer.targets.qwen3_6.view import VisionView
from ninfer.targets.qwen3_6.vision import Grid, check_grids, vision_embeddings

Tensor = torch.Tensor
GridKey = tuple[Grid, ...]

_log = logging.getLogger(__name__)

# grid lists kept as graphs: a server sees a few recurring image sizes (fixed-size screenshots, client
# resizes), not dozens
DEFAULT_MAX_GRAPHS = 8


@dataclass(eq=False)
class _TowerGraph:
    pixels: Tensor  # the static input [patches, C*T*P*P]
    features: Tensor  # the static output [image tokens, out_hidden]
    graph: torch.cuda.CUDAGraph


class VisionTower:
    """``tower(pixels, grids)`` -> the images' features (`vision_embeddings`' result), from a graph replay
    where the grid list has been seen before (module docstring)."""

    def __init__(
        self,
        view: VisionView,
        dims: VisionDims,
        kernels: Kernels,
        *,
        graphs: bool,
        max_patches: int,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
    ) -> None:
        device = view.patch_embed_weight.device
        self.view, self.dims, self.kernels = view, dims, kernels
        self.graphs = graphs and device.type == "cuda" and max_graphs > 0
        self.max_patches = max_patches
        self.max_graphs = max_graphs
        self._seen: OrderedDict[GridKey, None] = OrderedDict()  # lists seen once (bounded like the graphs)
        self._graphs: OrderedDict[GridKey, _TowerGraph] = OrderedDict()  # least recently used first
        self._eager_only: set[GridKey] = set()  # lists whose capture failed
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._stream = torch.cuda.Stream(device=device) if self.graphs else None
        self.replays = 0  # calls served by a graph (observability; tests read it)
        self.captures = 0

    @property
    def graph_count(self) -> int:
        return len(self._graphs)

    def __call__(self, pixels: Tensor, grids: Sequence[Grid]) -> Tensor:
        key: GridKey = tuple(tuple(int(v) for v in g) for g in grids)  # type: ignore[misc]
        check_grids(pixels, key, self.dims)
        if not self.graphs or pixels.shape[0] > self.max_patches or key in self._eager_only:
            return self._eager(pixels, key)
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            graph.pixels.copy_(pixels)
            graph.graph.replay()
            self.replays += 1
            return graph.features.clone()
        if key not in self._seen:
            self._remember(self._seen, key)
            return self._eager(pixels, key)
        del self._seen[key]
        return self._capture(pixels, key)

    def _eager(self, pixels: Tensor, key: GridKey) -> Tensor:
        return vision_embeddings(self.view, self.dims, pixels, key, self.kernels)

    def _capture(self, pixels: Tensor, key: GridKey) -> Tensor:
        """Warm up on the capture stream (this call's output), then capture the list's graph."""
        stream = self._stream
        assert stream is not None
        current = torch.cuda.current_stream(pixels.device)
        static = torch.empty_like(pixels)
        static.copy_(pixels)
        stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            out = self._eager(static, key)  # kernels compiled, library plans made, outside the capture
            try:
                # thread_local: another thread's CUDA calls (none expected) do not break the capture
                with torch.cuda.graph(graph, self._pool, stream, capture_error_mode="thread_local"):
                    features = self._eager(static, key)
            except RuntimeError as error:  # a kernel that cannot be captured: this list stays eager
                _log.warning("vision tower: grids %s run eagerly, the capture failed: %s", key, error)
                self._eager_only.add(key)
                features = None
        current.wait_stream(stream)
        out.record_stream(current)  # made on the capture stream, read on this one
        if features is not None:
            self._remember(self._graphs, key, _TowerGraph(static, features, graph))
            self.captures += 1
        return out

    def _remember(self, table: OrderedDict, key: GridKey, value: object = None) -> None:
        table[key] = value
        while len(table) > self.max_graphs:
            table.popitem(last=False)
