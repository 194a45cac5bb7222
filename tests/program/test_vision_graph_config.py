"""The vision tower's start-time graphs, their configuration and their memory (the graphs themselves run
on CUDA only: tests/gpu/test_vision_graphs_cuda.py): `image_grid` is the grid the Frontend's
preprocessing gives; `EngineConfig.vision_graph_sizes` and the CLI flag refuse bad sizes; the Program
refuses a grid over `max_image_tokens`; without CUDA the tower is the eager one; the memory plan counts the
graphs' pool and buffers as working space."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))  # the tiny random views

from qwen3_6_model_harness import tiny_view  # noqa: E402

from ninfer.cli.common import pixel_sizes  # noqa: E402
from ninfer.media.decode.image import DecodedImage  # noqa: E402
from ninfer.targets.qwen3_6.frontend.vision import (  # noqa: E402
    ImageProcessorConfig,
    image_grid,
    preprocess_image,
)
from ninfer.targets.qwen3_6.impl.runtime.program import ProgramConfig, Qwen36Program  # noqa: E402
from ninfer.targets.qwen3_6.impl.runtime.vision_graphs import VisionTower  # noqa: E402
from ninfer.targets.qwen3_6.kernels import REFERENCE  # noqa: E402
from ninfer.targets.qwen3_6.memory import VISION_BYTES_PER_IMAGE_TOKEN, vision_graph_bytes  # noqa: E402
from ninfer.targets.qwen3_6.vision import vision_embeddings  # noqa: E402
from ninfer.targets.registry import PACKAGES  # noqa: E402
from ninfer.types import EngineConfig  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize("size", [(448, 448), (1024, 768), (33, 90), (1, 40), (3000, 2200), (257, 1023)])
def test_image_grid_is_the_preprocessing_grid(size: tuple[int, int]) -> None:
    config = ImageProcessorConfig.from_json(None, PACKAGES["qwen3_6_tiny"].variant.vision)
    width, height = size
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    assert image_grid(width, height, config) == preprocess_image(DecodedImage(pixels), config).grid_thw


def test_sizes_are_checked_where_they_are_given() -> None:
    assert pixel_sizes("448x448, 1024X768") == ((448, 448), (1024, 768))
    for bad in ("448", "0x4", "4x", "ax4", "448x448,"):
        with pytest.raises(argparse.ArgumentTypeError, match="WxH"):
            pixel_sizes(bad)
    with pytest.raises(ValueError, match="vision_graph_sizes"):
        EngineConfig(vision_graph_sizes=((448, 0),))


def _program(grids: tuple[tuple[int, int, int], ...], max_image_tokens: int = 64) -> Qwen36Program:
    name = "qwen3_6_tiny"
    return Qwen36Program(
        PACKAGES[name].variant,
        tiny_view(name),
        ProgramConfig(
            max_concurrency=1, max_context=64, page_size=16, kv_pages=8, device=torch.device("cpu"),
            dtype=torch.float32, max_image_tokens=max_image_tokens, vision_graph_grids=grids,
        ),
    )  # fmt: skip


def test_a_grid_over_the_image_token_limit_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match=r"vision graph grid \(1, 32, 32\) is 256 image tokens"):
        _program(((1, 32, 32),), max_image_tokens=255)
    assert _program(((1, 32, 32),), max_image_tokens=256).vision_tower is not None


def test_without_cuda_the_tower_is_the_eager_one() -> None:
    view = tiny_view("qwen3_6_tiny")
    dims = view.variant.vision
    tower = VisionTower(view.vision, dims, REFERENCE, graph_grids=[(1, 4, 6)])
    grids = [(1, 4, 6), (2, 4, 4)]
    pixels = torch.randn(24 + 32, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(tower(pixels, grids), vision_embeddings(view.vision, dims, pixels, grids))
    assert tower.graph_grids == () and tower.replays == 0


def test_the_memory_plan_counts_the_graphs_pool_and_buffers() -> None:
    dims = PACKAGES["qwen3_6_27b"].variant.vision
    assert dims is not None
    assert vision_graph_bytes(dims, (), torch.bfloat16) == 0
    assert vision_graph_bytes(None, [(1, 4, 4)], torch.bfloat16) == 0
    grids = [(1, 28, 28), (1, 64, 64)]  # 448² and 1024²: the largest decides
    tokens, patches = 1024, 4096
    width = 3 * 2 * 16 * 16
    want = tokens * VISION_BYTES_PER_IMAGE_TOKEN + patches * width * 2 + tokens * dims.out_hidden_size * 2
    assert vision_graph_bytes(dims, grids, torch.bfloat16) == want
