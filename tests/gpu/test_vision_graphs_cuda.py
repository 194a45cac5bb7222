"""The fast table's fused fc1 + tanh GELU (`linear.fast_linear_gelu_tanh`) against the composition it
replaces; the vision tower with graphs captured at construction (`VisionTower`) against the eager tower,
image by image: a graphed image runs the eager kernels of that image alone, so the same bits, and a call
mixing graphed images with one without a graph equals the eager tower image by image; a replay's features
stay the caller's after the next replay; through the public Engine, image requests whose size was
configured (`vision_graph_sizes`) give the tokens of the same Engine without graphs, and image prompts
whose chunks replay the prefill graphs (the splice in the graph's dense form) give the eager chunks'
tokens (up to a near tie: a padded capacity's sums differ, as in test_prefill_graphs_cuda.py) and
first-token log-probabilities.

Imports neither Pillow nor transformers (the GPU image may lack them): images are `DecodedImage`s of
random pixels."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from near_tie import assert_agree

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))  # the tiny random views

from qwen3_6_model_harness import tiny_view  # noqa: E402

from ninfer import EngineConfig, GenerationRequest  # noqa: E402
from ninfer.media.decode.image import DecodedImage  # noqa: E402
from ninfer.ops.linear import fast_linear_gelu_tanh  # noqa: E402
from ninfer.runtime.engine.engine import Engine  # noqa: E402
from ninfer.targets.qwen3_6.frontend import Frontend, FrontendResources, SpecialTokens  # noqa: E402
from ninfer.targets.qwen3_6.frontend.vision import FAMILY_DEFAULTS, image_grid  # noqa: E402
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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("shape", [(256, 1152, 4304), (33, 72, 50)])  # the 27B/35B tower's fc1, odd sizes
def test_fused_fc1_gelu_is_the_tanh_gelu(shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * k**-0.5
    bias = torch.randn(n, generator=gen) * 0.5
    x, w, bias = x.to(CUDA), w.to(CUDA), bias.to(CUDA)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        linear = F.linear(x, w, bias)
        want, exact = F.gelu(linear, approximate="tanh"), F.gelu(linear)
        got = fast_linear_gelu_tanh(x, w, bias)
        # fp32: the tanh form (within the GEMM's accumulation order, ~2e-6 on an H100), told apart from the
        # exact one (~2e-4)
        assert _rel(got, want) <= 1e-5 < 0.1 * _rel(exact, want), (_rel(got, want), _rel(exact, want))
        xb, wb, bb = x.bfloat16(), w.bfloat16(), bias.bfloat16()
        fused = fast_linear_gelu_tanh(xb, wb, bb)
        composed = F.gelu(F.linear(xb, wb, bb), approximate="tanh")  # the reference table in bf16
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert fused.dtype == torch.bfloat16 and fused.shape == (m, n)
    assert _rel(fused, want) <= 1.05 * _rel(composed, want), (_rel(fused, want), _rel(composed, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table", ["fast", "reference"])
def test_replays_equal_the_eager_tower_image_by_image(dtype: torch.dtype, table: str) -> None:
    view = _cuda_view(dtype)
    dims, kernels = view.variant.vision, select_kernels(CUDA, table)
    with torch.inference_mode():
        tower = VisionTower(view.vision, dims, kernels, graph_grids=ONE_IMAGE + MIXED)
        assert set(tower.graph_grids) == set(ONE_IMAGE + MIXED)
        kept = []
        for call, grids in enumerate((ONE_IMAGE, MIXED, MIXED[:1] + ((1, 2, 6),) + MIXED[1:], ONE_IMAGE)):
            pixels = _pixels(grids, seed=call)
            got = tower(pixels, grids)
            parts = pixels.split([t * h * w for t, h, w in grids])
            alone = [vision_embeddings(view.vision, dims, p, [g], kernels) for p, g in zip(parts, grids)]
            want = torch.cat(alone)
            assert torch.equal(got, want), f"{grids}: {(got - want).abs().max().item():.3g}"
            kept.append((got, want))
        for call, (got, want) in enumerate(kept):  # later replays left earlier features alone
            assert torch.equal(got, want), f"call {call} changed after later calls"
    assert tower.replays == 1 + 3 + 3 + 1  # (1, 2, 6) has no graph: eager


def _frontend() -> Frontend:
    config = {**FAMILY_DEFAULTS, "size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 6}}
    resources = FrontendResources(
        tokenizer_json=tokenizer_json(), chat_template=chat_template("qwen3_6"), generation_config={},
        preprocessor_config=json.loads(json.dumps(config)),
    )  # fmt: skip
    return Frontend.from_resources(resources, SpecialTokens())


def _image_requests(count: int = 4, size: tuple[int, int] = (70, 40)) -> list[GenerationRequest]:
    """``count`` one-image chats, the images of one size."""
    rng = np.random.default_rng(7)
    requests = []
    for i in range(count):
        image = DecodedImage(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))
        parts = [{"type": "text", "text": f"Look {i}:"}, {"type": "image", "image": image},
                 {"type": "text", "text": f"Q{i}, and a few words after the image"}]  # fmt: skip
        requests.append(
            GenerationRequest(
                messages=[{"role": "user", "content": parts}], max_tokens=8, temperature=0.0, ignore_eos=True,
                logprobs=True, top_logprobs=2,
            )  # fmt: skip
        )
    return requests


def _engine_run(tower_graphs: bool, prefill_graph_tokens: int = 0, chunk: int | None = None):  # type: ignore[no-untyped-def]
    name = "qwen3_6_tiny"
    grid = image_grid(70, 40, _frontend().image_config)  # the requests' image size
    program = Qwen36Program(
        PACKAGES[name].variant,
        tiny_view(name).to("cuda", torch.float32),
        ProgramConfig(
            max_concurrency=1, max_context=256, page_size=16, kv_pages=32, device=CUDA, dtype=torch.float32,
            cuda_graphs=True, prefill_graph_tokens=prefill_graph_tokens,
            vision_graph_grids=(grid,) if tower_graphs else (),
        ),
    )  # fmt: skip
    assert program.vision_tower is not None
    config = EngineConfig(
        max_concurrency=1, device="cuda", dtype="float32", max_context=256, page_size=16, warmup=False,
        prefix_cache=False, prefill_chunk_tokens=chunk,
    )  # fmt: skip
    with Engine.from_parts(program, _frontend(), config, package_name=name) as engine:
        results = [engine.generate(r) for r in _image_requests()]
    return results, program


def _fp32_matmuls():  # type: ignore[no-untyped-def]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    return tf32


def test_image_requests_with_the_tower_in_graphs_give_the_eager_tokens() -> None:
    tf32 = _fp32_matmuls()
    try:
        graphed, program = _engine_run(tower_graphs=True)
        eager, eager_program = _engine_run(tower_graphs=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert program.vision_tower.replays == len(graphed) and eager_program.vision_tower.replays == 0
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]


@pytest.mark.parametrize("chunk", [None, 24])  # the whole prompt in one chunk; chunks that cut the image
def test_image_prompts_in_prefill_graphs_give_the_eager_chunks_tokens(chunk: int | None) -> None:
    tf32 = _fp32_matmuls()
    try:
        graphed, program = _engine_run(tower_graphs=True, prefill_graph_tokens=256, chunk=chunk)
        eager, _ = _engine_run(tower_graphs=True, prefill_graph_tokens=0, chunk=chunk)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    graphs = program.executor.prefill_graphs
    assert graphs is not None and graphs.spliced_replays >= len(graphed), "image chunks ran eagerly"
    for got, want in zip(graphed, eager):
        assert got.logprobs is not None and want.logprobs is not None
        assert abs(got.logprobs[0].logprob - want.logprobs[0].logprob) <= 1e-3
        assert_agree(got, want, "float32")
