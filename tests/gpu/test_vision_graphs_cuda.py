"""The vision tower replayed as CUDA graphs (`VisionTower`) against the eager tower: the same kernels, so
the same bits, for one image and for a call of several images of different sizes and frame counts;
a replay's features stay the caller's after the next replay; the capture policy (the second sighting,
at most ``max_graphs`` lists, none over ``max_patches``); and through the public Engine, image
requests with the tower in graphs give the tokens of the same Engine with the tower eager.

Imports neither Pillow nor transformers (the GPU image may lack them): images are `DecodedImage`s of
random pixels."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))  # the tiny random views

from qwen3_6_model_harness import tiny_view  # noqa: E402

from ninfer import EngineConfig, GenerationRequest  # noqa: E402
from ninfer.media.decode.image import DecodedImage  # noqa: E402
from ninfer.runtime.engine.engine import Engine  # noqa: E402
from ninfer.targets.qwen3_6.frontend import Frontend, FrontendResources, SpecialTokens  # noqa: E402
from ninfer.targets.qwen3_6.frontend.vision import FAMILY_DEFAULTS  # noqa: E402
from ninfer.targets.qwen3_6.impl.runtime.program import ProgramConfig, Qwen36Program  # noqa: E402
from ninfer.targets.qwen3_6.impl.runtime.vision_graphs import VisionTower  # noqa: E402
from ninfer.targets.qwen3_6.kernels import select_kernels  # noqa: E402
from ninfer.targets.qwen3_6.resources import chat_template, tokenizer_json  # noqa: E402
from ninfer.targets.qwen3_6.vision import vision_embeddings  # noqa: E402
from ninfer.targets.registry import PACKAGES  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

CUDA = torch.device("cuda")
ONE_IMAGE = ((1, 16, 16),)
MIXED = ((1, 4, 6), (2, 4, 4), (1, 32, 48))  # three frame lengths, a two-frame grid


def _pixels(grids: tuple, seed: int) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(seed)).to(CUDA)


def _cuda_view(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    view = tiny_view("qwen3_6_tiny").to("cuda", dtype)
    assert view.vision is not None and view.variant.vision is not None
    return view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table", ["fast", "reference"])
def test_replays_equal_the_eager_tower(dtype: torch.dtype, table: str) -> None:
    view = _cuda_view(dtype)
    dims, kernels = view.variant.vision, select_kernels(CUDA, table)
    tower = VisionTower(view.vision, dims, kernels, graphs=True, max_patches=1 << 20)
    with torch.inference_mode():
        for grids in (ONE_IMAGE, MIXED):
            kept = []
            for call in range(4):  # eager, capture, replay, replay
                pixels = _pixels(grids, seed=call)
                got = tower(pixels, grids)
                want = vision_embeddings(view.vision, dims, pixels, grids, kernels)
                assert torch.equal(got, want), f"{grids} call {call}: {(got - want).abs().max().item():.3g}"
                kept.append((got, want))
            for call, (got, want) in enumerate(kept):  # later replays left earlier features alone
                assert torch.equal(got, want), f"{grids} call {call} changed after later calls"
    assert tower.captures == 2 and tower.replays == 4 and tower.graph_count == 2


def test_capture_policy() -> None:
    view = _cuda_view(torch.float32)
    dims, kernels = view.variant.vision, select_kernels(CUDA, "fast")
    small = ((1, 4, 4),)
    tower = VisionTower(view.vision, dims, kernels, graphs=True, max_patches=100, max_graphs=1)
    with torch.inference_mode():
        for _ in range(3):
            tower(_pixels(ONE_IMAGE, 0), ONE_IMAGE)  # 256 patches: over max_patches, always eager
        assert tower.captures == 0 and tower.graph_count == 0
        tower(_pixels(small, 0), small)
        assert tower.captures == 0  # seen once: eager
        tower(_pixels(small, 1), small)
        assert tower.captures == 1 and tower.replays == 0
        tower(_pixels(small, 2), small)
        assert tower.replays == 1
        other = ((1, 2, 6),)
        for seed in range(2):
            tower(_pixels(other, seed), other)  # captured, and the first list dropped (max_graphs=1)
        assert tower.captures == 2 and tower.graph_count == 1
        tower(_pixels(small, 3), small)
        assert tower.replays == 1  # dropped: eager again, a first sighting


def _frontend() -> Frontend:
    config = {**FAMILY_DEFAULTS, "size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 6}}
    resources = FrontendResources(
        tokenizer_json=tokenizer_json(), chat_template=chat_template("qwen3_6"), generation_config={},
        preprocessor_config=json.loads(json.dumps(config)),
    )  # fmt: skip
    return Frontend.from_resources(resources, SpecialTokens())


def _image_requests() -> list[GenerationRequest]:
    rng = np.random.default_rng(7)
    requests = []
    for i in range(4):  # four images of one size: eager, capture, replay, replay
        image = DecodedImage(rng.integers(0, 256, size=(40, 70, 3), dtype=np.uint8))
        parts = [{"type": "image", "image": image}, {"type": "text", "text": f"Q{i}"}]
        messages = [{"role": "user", "content": parts}]
        requests.append(GenerationRequest(messages=messages, max_tokens=8, temperature=0.0, ignore_eos=True))
    return requests


def _tokens(graphs: bool) -> tuple[list[tuple[int, ...]], int]:
    name = "qwen3_6_tiny"
    program = Qwen36Program(
        PACKAGES[name].variant,
        tiny_view(name).to("cuda", torch.float32),
        ProgramConfig(
            max_concurrency=1, max_context=256, page_size=16, kv_pages=32, device=CUDA, dtype=torch.float32,
            cuda_graphs=True,
        ),
    )  # fmt: skip
    assert program.vision_tower is not None
    program.vision_tower.graphs = graphs
    config = EngineConfig(
        max_concurrency=1, device="cuda", dtype="float32", max_context=256, page_size=16, warmup=False,
        prefix_cache=False,
    )  # fmt: skip
    with Engine.from_parts(program, _frontend(), config, package_name=name) as engine:
        tokens = [engine.generate(r).token_ids for r in _image_requests()]
    return tokens, program.vision_tower.replays


def test_image_requests_with_the_tower_in_graphs_give_the_eager_tokens() -> None:
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        graphed, replays = _tokens(graphs=True)
        eager, none = _tokens(graphs=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert replays == 2 and none == 0
    assert graphed == eager
