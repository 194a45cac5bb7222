"""The vision tower's Triton rotary (`ninfer.ops.triton.vision_rope`) against the reference op
(`ninfer.ops.rope.vision_qkv_rotary`), and the whole tower on the fast table against the tower on the
reference table: in the interpreter at small dims over several frame lengths, on CUDA at the 27B's."""

from __future__ import annotations

import warnings
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import interpreted_kernels, run_interpreter_child

torch.set_num_threads(1)


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.vision_rope")


def _reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
    """The reference table's op (as transformers: q and k rotated in fp32), each [heads, n, D]."""
    from ninfer.ops.rope import vision_qkv_rotary

    return list(vision_qkv_rotary(qkv, cos, sin))


def _inputs(
    n: int, heads: int, head_dim: int, dtype: torch.dtype, device: str = "cpu"
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(n * 31 + heads + head_dim)
    qkv = torch.randn(n, 3, heads, head_dim, generator=gen).to(dtype)
    angles = torch.rand(n, head_dim // 2, generator=gen) * 40.0
    angles = torch.cat((angles, angles), dim=-1)
    return qkv.to(device), angles.cos().to(device), angles.sin().to(device)


@pytest.mark.parametrize("n", [1, 5, 64, 257])
@pytest.mark.parametrize("heads, head_dim", [(16, 72), (3, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_equals_the_reference(
    kernels: ModuleType, n: int, heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    qkv, cos, sin = _inputs(n, heads, head_dim, dtype)
    got = kernels.vision_qkv_rotary(qkv, cos, sin)
    for name, a, b in zip("qkv", got, _reference(qkv, cos, sin)):
        assert a.shape == (heads, n, head_dim) and a.dtype == dtype and a.is_contiguous(), name
        if name == "v":
            assert torch.equal(a, b)
        elif dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
        else:  # the same fp32 value rounded once; a fused multiply-add may move it by one bf16 step
            step = torch.exp2(torch.floor(torch.log2(b.float().abs().clamp(min=1e-30))) - 7)
            assert bool(((a.float() - b.float()).abs() <= step).all()), name


def test_rotary_refuses_bad_shapes(kernels: ModuleType) -> None:
    qkv, cos, sin = _inputs(4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="qkv must be"):
        kernels.vision_qkv_rotary(qkv[:, :2], cos, sin)
    with pytest.raises(ValueError, match="cos must be"):
        kernels.vision_qkv_rotary(qkv, cos[:3], sin)
    with pytest.raises(ValueError, match="head_dim must be even"):
        kernels.vision_qkv_rotary(torch.zeros(4, 3, 2, 7), torch.zeros(4, 7), torch.zeros(4, 7))


def _tower(dims: object, device: str, dtype: torch.dtype, gen: torch.Generator) -> object:
    """Random vision weights of ``dims`` (a 2 x 16 x 16 patch embedding over 3 channels)."""
    from ninfer.targets.qwen3_6.view import VisionBlockView, VisionMergerView, VisionView

    c, m, merged = dims.hidden_size, dims.intermediate_size, dims.hidden_size * 4

    def w(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    blocks = tuple(
        VisionBlockView(
            norm1_weight=w(c, scale=1.0), norm1_bias=w(c), norm2_weight=w(c, scale=1.0), norm2_bias=w(c),
            qkv_weight=w(3 * c, c), qkv_bias=w(3 * c), proj_weight=w(c, c), proj_bias=w(c),
            fc1_weight=w(m, c), fc1_bias=w(m), fc2_weight=w(c, m), fc2_bias=w(c),
        )  # fmt: skip
        for _ in range(dims.depth)
    )
    return VisionView(
        patch_embed_weight=w(c, 3, 2, 16, 16), patch_embed_bias=w(c),
        pos_embed=w(dims.num_position_embeddings, c), blocks=blocks,
        merger=VisionMergerView(
            norm_weight=w(c, scale=1.0), norm_bias=w(c), fc1_weight=w(merged, merged),
            fc1_bias=w(merged), fc2_weight=w(dims.out_hidden_size, merged), fc2_bias=w(dims.out_hidden_size),
        ),
    )  # fmt: skip


def test_the_fast_tables_tower_equals_the_reference_tower_in_the_interpreter(kernels: ModuleType) -> None:
    """Two images of different sizes (two frame lengths, so the attention runs per frame group) and a
    two-frame video, through the interpreted fast table's rotary and the reference table's: the same
    embeddings in fp32."""
    from ninfer.targets.qwen3_6.variant import VisionDims
    from ninfer.targets.qwen3_6.vision import vision_embeddings

    tables = interpreted_kernels("ninfer.targets.qwen3_6.kernels")
    dims = VisionDims(depth=2, hidden_size=64, num_heads=2, intermediate_size=96, out_hidden_size=32)
    gen = torch.Generator().manual_seed(1)
    view = _tower(dims, "cpu", torch.float32, gen)
    grids = [(1, 4, 4), (1, 2, 6), (2, 2, 2)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 16 * 16, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla-core absent: only GDN prefill falls back
        fast = tables.fast_kernels()
    got = vision_embeddings(view, dims, pixels, grids, fast)
    want = vision_embeddings(view, dims, pixels, grids, tables.REFERENCE)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_tower_with_the_kernel_equals_the_plain_tower_on_cuda(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ninfer.targets.qwen3_6.kernels import REFERENCE, fast_kernels
    from ninfer.targets.qwen3_6.variant import VisionDims
    from ninfer.targets.qwen3_6.vision import vision_embeddings

    dims = VisionDims(depth=2, hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=512)
    gen = torch.Generator(device="cuda").manual_seed(0)
    view = _tower(dims, "cuda", dtype, gen)
    grid = (1, 32, 32)
    pixels = torch.randn(32 * 32, 3 * 2 * 16 * 16, device="cuda", generator=gen)
    with torch.inference_mode():
        plain = vision_embeddings(view, dims, pixels, [grid], REFERENCE)
        fast = vision_embeddings(view, dims, pixels, [grid], fast_kernels())
    error = (fast.float() - plain.float()).abs().max() / plain.float().abs().max()
    assert error <= (1e-5 if dtype == torch.float32 else 2e-2), float(error)
    assert F.cosine_similarity(fast.float().flatten(), plain.float().flatten(), dim=0) > 0.9999
