"""Triton skinny GEMM (`ninfer.ops.triton.skinny_gemm`) against `F.linear`.

CPU tests run both kernels (elementwise and dot), with and without split-K, in the Triton interpreter
through a private copy of the module (fp32, tiny shapes whose sizes the blocks do not divide). `gpu`
tests run the compiled kernels at every real Qwen3.6 decode projection shape in bf16.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import interpreted_kernels, max_rel_error, run_interpreter_child

from ninfer.ops.conv import causal_conv1d_update

if TYPE_CHECKING:
    from ninfer.ops.triton.skinny_gemm import SkinnyConfig

torch.set_num_threads(1)


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.skinny_gemm")


# (block_n, block_k, split_k, use_dot, unroll): none of the blocks divides N in {5, 33} or K = 40
INTERPRETER_CONFIGS = {
    "fma": (4, 16, 1, False, 1),
    "fma-unroll": (8, 8, 1, False, 2),
    "fma-split": (2, 16, 2, False, 1),
    "fma-split-uneven": (4, 8, 3, False, 2),
    "dot": (16, 16, 1, True, 1),
    "dot-split": (16, 16, 3, True, 1),
}
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("config_name", list(INTERPRETER_CONFIGS))
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("n", [5, 33])
@pytest.mark.parametrize("k", [16, 40])
def test_skinny_linear_matches_f_linear(
    kernels: ModuleType, config_name: str, rows: int, n: int, k: int
) -> None:
    block_n, block_k, split_k, use_dot, unroll = INTERPRETER_CONFIGS[config_name]
    config = kernels.SkinnyConfig(
        block_n=block_n, block_k=block_k, split_k=split_k, use_dot=use_dot, unroll=unroll
    )
    gen = torch.Generator().manual_seed(rows * 1000 + n * 10 + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    out = torch.full((rows, n), float("nan"))

    got = kernels.skinny_linear(x, w, out=out, config=config)

    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, F.linear(x, w), **CLOSE)


@pytest.mark.parametrize("config_name", ["fma", "fma-split", "dot-split"])
def test_skinny_linear_strided_x_and_weight_view(kernels: ModuleType, config_name: str) -> None:
    """x a column slice of a wider activation, w a column slice of a wider buffer (row stride > K)."""
    block_n, block_k, split_k, use_dot, unroll = INTERPRETER_CONFIGS[config_name]
    config = kernels.SkinnyConfig(
        block_n=block_n, block_k=block_k, split_k=split_k, use_dot=use_dot, unroll=unroll
    )
    gen = torch.Generator().manual_seed(5)
    rows, n, k = 3, 33, 40
    wide_x = torch.randn(rows, k + 24, generator=gen)
    wide_w = torch.randn(n, k + 8, generator=gen)
    x, w = wide_x[:, 8 : 8 + k], wide_w[:, :k]
    assert x.stride(0) == k + 24 and w.stride(0) == k + 8

    got = kernels.skinny_linear(x, w, config=config)

    assert got.shape == (rows, n) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w), **CLOSE)


def test_skinny_linear_default_config_and_out_row_stride(kernels: ModuleType) -> None:
    """Without a config the shape's default is used; out may be a column slice of a wider buffer."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 24, generator=gen)
    w = torch.randn(20, 24, generator=gen)
    wide_out = torch.full((2, 32), float("nan"))
    out = wide_out[:, 4:24]

    got = kernels.skinny_linear(x, w, out=out)

    torch.testing.assert_close(got, F.linear(x, w), **CLOSE)
    assert wide_out[:, :4].isnan().all() and wide_out[:, 24:].isnan().all(), "only out's columns written"


@pytest.mark.parametrize("config_name", ["fma", "fma-split", "fma-split-uneven", "dot-split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows", [1, 3])
def test_partials_sum_to_the_reduced_projection_exactly(
    kernels: ModuleType, config_name: str, dtype: torch.dtype, rows: int
) -> None:
    """`skinny_linear_partials`: fp32 slabs whose slab-order sum, rounded, is skinny_linear's output bit
    for bit (what a consumer that sums them must reproduce); an unsplit config gives the output itself."""
    block_n, block_k, split_k, use_dot, unroll = INTERPRETER_CONFIGS[config_name]
    config = kernels.SkinnyConfig(
        block_n=block_n, block_k=block_k, split_k=split_k, use_dot=use_dot, unroll=unroll
    )
    gen = torch.Generator().manual_seed(split_k * 10 + block_k + rows)
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    w = torch.randn(33, 40, generator=gen).to(dtype)

    partials = kernels.skinny_linear_partials(x, w, config=config)
    want = kernels.skinny_linear(x, w, config=config)

    if split_k == 1:
        assert partials.shape == (1, rows, 33) and partials.dtype == dtype
        assert torch.equal(partials[0], want)
        return
    assert partials.shape == (split_k, rows, 33) and partials.dtype == torch.float32
    total = partials[0].clone()
    for slab in partials[1:]:
        total += slab
    assert torch.equal(total.to(dtype), want)
    torch.testing.assert_close(want.float(), F.linear(x.float(), w.float()), rtol=2e-3, atol=2e-3)


class _LaunchSpy:
    """Stands in for the elementwise kernel: records each launch's EARLY_STEPS, then launches it."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.early = kernel, []

    def __getitem__(self, grid: tuple[int, ...]):  # noqa: ANN204
        launch = self.kernel[grid]  # type: ignore[index]

        def run(*args: object, **kwargs: object) -> object:
            self.early.append(kwargs["EARLY_STEPS"])
            return launch(*args, **kwargs)

        return run


@pytest.mark.parametrize("config_name", ["fma", "fma-unroll", "fma-split-uneven"])
@pytest.mark.parametrize("k", [10, 16, 40])
def test_early_first_tile_gives_the_same_bits(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch, config_name: str, k: int
) -> None:
    """One row of a static weight in one wave: the first weight tiles (up to _EARLY_STEPS_MAX) loaded
    before the PDL wait and their steps peeled off the loop add the same products in the same order as
    the plain loop (bit-equal), single-step splits, K < block_k, more steps than the cap and unrolled
    steps included; a weight not marked static never loads early; in more than one wave only programs
    whose whole K range fits in the cap load early."""
    block_n, block_k, split_k, use_dot, unroll = INTERPRETER_CONFIGS[config_name]
    config = kernels.SkinnyConfig(
        block_n=block_n, block_k=block_k, split_k=split_k, use_dot=use_dot, unroll=unroll
    )
    gen = torch.Generator().manual_seed(k + unroll)
    x = torch.randn(1, k, generator=gen).half()
    w = torch.randn(33, k, generator=gen).half()
    spy = _LaunchSpy(kernels._skinny_fma_kernel)
    monkeypatch.setattr(kernels, "_skinny_fma_kernel", spy)

    early = kernels.skinny_linear(x, w, config=config, static_weight=True)
    plain = kernels.skinny_linear(x, w, config=config)
    monkeypatch.setattr(kernels, "_EARLY_TILE_WARPS_PER_SM", 0)
    too_many = kernels.skinny_linear(x, w, config=config, static_weight=True)

    steps_per_split = math.ceil(math.ceil(k / split_k) / block_k)  # whole steps per split, as the host
    capped = min(kernels._EARLY_STEPS_MAX, steps_per_split)
    whole = steps_per_split if steps_per_split <= kernels._EARLY_STEPS_MAX else 0
    assert spy.early == [capped, 0, whole]
    assert torch.equal(early, plain) and torch.equal(too_many, plain)
    torch.testing.assert_close(early.float(), F.linear(x.float(), w.float()), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("config_name", ["fma", "fma-unroll", "fma-split-uneven", "dot", "dot-split"])
@pytest.mark.parametrize("rows", [1, 3])
def test_float32_out_holds_the_rounded_projection(kernels: ModuleType, config_name: str, rows: int) -> None:
    """An fp32 ``out`` of an fp16 projection (the logits) holds exactly `skinny_linear(x, w).float()`: the
    result rounded to x's dtype, then widened, split-K's reduce launch included."""
    block_n, block_k, split_k, use_dot, unroll = INTERPRETER_CONFIGS[config_name]
    config = kernels.SkinnyConfig(
        block_n=block_n, block_k=block_k, split_k=split_k, use_dot=use_dot, unroll=unroll
    )
    gen = torch.Generator().manual_seed(rows + split_k)
    x, w = torch.randn(rows, 40, generator=gen).half(), torch.randn(33, 40, generator=gen).half()
    out = torch.full((rows, 33), float("nan"))
    got = kernels.skinny_linear(x, w, out=out, config=config, static_weight=True)
    assert got is out
    assert torch.equal(out, kernels.skinny_linear(x, w, config=config).float())


def test_empty_projections_launch_nothing(kernels: ModuleType) -> None:
    """N = 0, M = 0 and K = 0 (zeros) without a config: no shape heuristic, no launch."""
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    assert kernels.skinny_linear(x, torch.randn(0, 16)).shape == (2, 0)
    assert kernels.skinny_linear_partials(x, torch.randn(0, 16)).shape == (1, 2, 0)
    assert kernels.skinny_linear(torch.randn(0, 16), w).shape == (0, 8)
    assert torch.equal(kernels.skinny_linear(torch.randn(2, 0), torch.randn(8, 0)), torch.zeros(2, 8))
    assert torch.equal(
        kernels.skinny_linear_partials(torch.randn(2, 0), torch.randn(8, 0)), torch.zeros(1, 2, 8)
    )


def test_skinny_linear_rejects_bad_inputs(kernels: ModuleType) -> None:
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="at most 16 rows"):
        kernels.skinny_linear(torch.randn(17, 16), w)
    with pytest.raises(ValueError, match="share a dtype"):
        kernels.skinny_linear(torch.randn(1, 16, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="unit stride along K"):
        kernels.skinny_linear(torch.randn(1, 8), torch.randn(8, 16).t())
    with pytest.raises(ValueError, match="need x"):
        kernels.skinny_linear(torch.randn(1, 15), w)
    with pytest.raises(ValueError, match="out must be"):
        kernels.skinny_linear(torch.randn(1, 16), w, out=torch.empty(1, 9))
    with pytest.raises(ValueError, match="out must be"):
        bf16_out = torch.empty(1, 8, dtype=torch.bfloat16)
        kernels.skinny_linear(torch.randn(1, 16).half(), w.half(), out=bf16_out)
    with pytest.raises(ValueError, match="dot kernel needs"):
        kernels.skinny_linear(torch.randn(1, 16), w, config=kernels.SkinnyConfig(block_n=8, use_dot=True))


# ---- the GDN conv step in the epilogue ------------------------------------------------------------


def _conv_reference(
    y: torch.Tensor, channels: int, pool: torch.Tensor, weight: torch.Tensor, state_in: torch.Tensor,
    state_out: torch.Tensor, fresh: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(projection with the conv step on its first C columns, pool after the step), as the unfused path
    (the projection, then `causal_conv1d_update` over the gathered windows) computes them."""
    valid_in = state_in.clamp_min(0)
    window_in = torch.where((fresh | (state_in < 0))[:, None, None], 0, pool.index_select(0, valid_in))
    conv_out, new_window = causal_conv1d_update(y[:, :channels], window_in, weight)
    pool_after = pool.clone()
    keep = state_out >= 0
    pool_after.index_copy_(0, state_out[keep], new_window[keep].to(pool.dtype))
    return torch.cat([conv_out, y[:, channels:]], dim=-1), pool_after


@pytest.mark.parametrize("config_name", ["fma", "fma-unroll", "fma-split", "dot", "dot-split"])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("settled", [False, True], ids=["plain", "settled"])
def test_conv_epilogue_matches_projection_then_conv(
    kernels: ModuleType, config_name: str, rows: int, dtype: torch.dtype, settled: bool
) -> None:
    """C = 20 of N = 33 columns (no block divides either); rows that move slots, update in place, start
    fresh, or are padding (state_in / state_out < 0); split-K configs run unsplit; settled conv inputs
    (loaded before the PDL wait) give the same results."""
    block_n, block_k, split_k, use_dot, unroll = INTERPRETER_CONFIGS[config_name]
    config = kernels.SkinnyConfig(
        block_n=block_n, block_k=block_k, split_k=split_k, use_dot=use_dot, unroll=unroll
    )
    gen = torch.Generator().manual_seed(rows + 7 * len(config_name))
    n, k, channels, width, slots = 33, 40, 20, 4, 9
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    pool = torch.randn(slots, channels, width - 1, generator=gen).to(dtype)
    conv_weight = (torch.randn(channels, width, generator=gen) * 0.5).to(dtype)
    state_in = torch.tensor([7, 2, -1, 0][:rows])
    state_out = torch.tensor([7, 4, -1, 1][:rows])
    fresh = torch.tensor([False, True, False, False][:rows])
    unsplit = kernels.SkinnyConfig(block_n=block_n, block_k=block_k, use_dot=use_dot, unroll=unroll)
    want, pool_want = _conv_reference(
        kernels.skinny_linear(x, w, config=unsplit), channels, pool, conv_weight, state_in, state_out, fresh
    )
    step = kernels.ConvStep(
        pool=pool, weight=conv_weight, state_in=state_in, state_out=state_out, fresh=fresh, settled=settled
    )
    out = torch.full((rows, n), float("nan"), dtype=dtype)

    got = kernels.skinny_linear(x, w, out=out, config=config, conv=step)

    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got[:, channels:], want[:, channels:])
    # the 4-tap sum's order may differ from torch's by an fp32 ulp, which fp16 rounding rarely shows
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-3, "atol": 1e-3}
    torch.testing.assert_close(got[:, :channels], want[:, :channels], **tolerance)
    assert torch.equal(pool, pool_want), "the new windows are copies of the rounded projection"


def test_conv_epilogue_rejects_bad_steps(kernels: ModuleType) -> None:
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    slots = torch.tensor([0, 1])
    fresh = torch.tensor([False, False])

    def step(pool: torch.Tensor, weight: torch.Tensor, state_in: torch.Tensor = slots) -> object:
        return kernels.ConvStep(pool=pool, weight=weight, state_in=state_in, state_out=slots, fresh=fresh)

    with pytest.raises(ValueError, match="conv.pool"):
        kernels.skinny_linear(x, w, conv=step(torch.zeros(2, 9, 3), torch.zeros(9, 4)))  # C > N
    with pytest.raises(ValueError, match="conv.pool"):
        kernels.skinny_linear(x, w, conv=step(torch.zeros(2, 4, 2), torch.zeros(4, 4)))  # K - 1 != 2
    with pytest.raises(ValueError, match="conv.weight"):
        kernels.skinny_linear(x, w, conv=step(torch.zeros(2, 4, 3), torch.zeros(5, 4)))
    with pytest.raises(ValueError, match="conv.state_in"):
        kernels.skinny_linear(x, w, conv=step(torch.zeros(2, 4, 3), torch.zeros(4, 4), slots[:1]))
    with pytest.raises(ValueError, match="integer slot indices"):
        kernels.skinny_linear(x, w, conv=step(torch.zeros(2, 4, 3), torch.zeros(4, 4), slots.float()))
    with pytest.raises(ValueError, match="K >= 1"):
        kernels.skinny_linear(x[:, :0], w[:, :0], conv=step(torch.zeros(2, 4, 3), torch.zeros(4, 4)))


def test_default_config_shapes(kernels: ModuleType) -> None:
    """M = 1 takes the elementwise kernel, more rows the dot one; few column blocks split K."""
    decode = kernels.default_config(1, 14336, 5120)
    assert not decode.use_dot and decode.split_k == 1
    batched = kernels.default_config(8, 14336, 5120)
    assert batched.use_dot and batched.block_n >= 16 and batched.block_k >= 16
    narrow = kernels.default_config(8, 1280, 2048)
    assert narrow.split_k > 1, "20 column blocks on 132 SMs must split K"
    for m in (1, 3, 8, 16):
        for n, k in ((5120, 17408), (256, 2048), (248320, 5120), (5, 7)):
            kernels.default_config(m, n, k).check()


def test_tuned_configs_and_cublas_choice(kernels: ModuleType) -> None:
    """Tuned entries are valid and are what `default_config` returns; 2..8 rows leave cuBLAS only for
    the shapes tuned at 8 rows, one row always does."""
    for (bucket, n, k), config in kernels._TUNED.items():
        config.check()
        for m in (1,) if bucket == 1 else (2, 5, 8):
            assert kernels.default_config(m, n, k) == config
    assert kernels.prefers_skinny(1, 5, 7)
    assert kernels.prefers_skinny(3, 248320, 5120) and kernels.prefers_skinny(8, 5120, 17408)
    assert not kernels.prefers_skinny(8, 14336, 5120), "attn_qkv at 8 rows measured slower than cuBLAS"
    assert not kernels.prefers_skinny(9, 248320, 5120) and not kernels.prefers_skinny(0, 248320, 5120)


# ---- GPU, real shapes ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (name, N, K) of every decode projection of Qwen3.6-27B and -35B-A3B (stacked as the binder stacks them)
REAL_SHAPES = [
    ("27b-attn-qkv", 14336, 5120),
    ("27b-attn-o", 5120, 6144),
    ("27b-gdn-in", 16480, 5120),
    ("27b-gdn-out", 5120, 6144),
    ("27b-mlp-gate-up", 34816, 5120),
    ("27b-mlp-down", 5120, 17408),
    ("27b-lm-head", 248320, 5120),
    ("35b-gdn-in", 12352, 2048),
    ("35b-gdn-out", 2048, 4096),
    ("35b-attn-qkv", 9216, 2048),
    ("35b-attn-o", 2048, 4096),
    ("35b-router-shared-gate-up", 1280, 2048),
    ("35b-shared-down", 2048, 512),
    ("35b-lm-head", 248320, 2048),
]
BF16_BOUND = 1e-2


def _check_bf16(
    rows: int, n: int, k: int, seed: int, config: SkinnyConfig | None = None, x_stride_pad: int = 0
) -> None:
    from ninfer.ops.triton.skinny_gemm import skinny_linear

    gen = torch.Generator(device="cuda").manual_seed(seed)
    wide = torch.randn(rows, k + x_stride_pad, generator=gen, device="cuda").to(torch.bfloat16)
    x = wide[:, x_stride_pad:]
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16)
    want = F.linear(x.float(), w.float())  # fp32 reference of the same bf16 inputs
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")

    skinny_linear(x, w, out=out, config=config)

    assert not out.isnan().any()
    error = max_rel_error(out, want)
    assert error <= BF16_BOUND, f"M={rows} N={n} K={k} {config}: max rel error {error:.2e}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 3, 5, 8])
@pytest.mark.parametrize(("name", "n", "k"), REAL_SHAPES, ids=[s[0] for s in REAL_SHAPES])
def test_skinny_linear_cuda_real_shapes(name: str, n: int, k: int, rows: int) -> None:
    _check_bf16(rows, n, k, seed=rows * 7 + n, x_stride_pad=256 if rows == 3 else 0)


# (block_n, block_k, split_k, num_warps, num_stages, use_dot, unroll): every code path, compiled
# (the elementwise accumulator is M x block_n x block_k: these stay within registers up to M = 8)
GPU_CONFIGS = {
    "fma": (8, 256, 1, 4, 1, False, 1),
    "fma-unroll-stages": (4, 256, 1, 4, 2, False, 2),
    "fma-split": (8, 128, 4, 4, 1, False, 2),
    "dot": (64, 128, 1, 4, 4, True, 1),
    "dot-narrow": (16, 256, 1, 4, 3, True, 1),
    "dot-wide-split": (128, 128, 3, 8, 4, True, 1),
}
# N and K that no block divides (K still a multiple of 8, so rows stay 16-byte aligned), and an odd K
ODD_SHAPES = [(5000 + 7, 2056), (257, 1030 + 8), (1031, 999)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config_name", list(GPU_CONFIGS))
@pytest.mark.parametrize("rows", [1, 5, 8, 16])
@pytest.mark.parametrize(("n", "k"), ODD_SHAPES)
def test_skinny_linear_cuda_configs_odd_shapes(config_name: str, rows: int, n: int, k: int) -> None:
    from ninfer.ops.triton.skinny_gemm import SkinnyConfig

    fields = ("block_n", "block_k", "split_k", "num_warps", "num_stages", "use_dot", "unroll")
    config = SkinnyConfig(**dict(zip(fields, GPU_CONFIGS[config_name])))
    if rows > 8 and not config.use_dot:
        pytest.skip("elementwise configs are meant for M <= 8 (16 rows would spill the accumulator)")
    _check_bf16(rows, n, k, seed=rows + n + k, config=config, x_stride_pad=8)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("use_dot", [False, True], ids=["fma", "dot"])
def test_skinny_linear_cuda_other_dtypes(dtype: torch.dtype, use_dot: bool) -> None:
    from ninfer.ops.triton.skinny_gemm import SkinnyConfig, skinny_linear

    gen = torch.Generator(device="cuda").manual_seed(3)
    rows, n, k = 4, 5120, 6144
    x = torch.randn(rows, k, generator=gen, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(dtype)
    config = SkinnyConfig(block_n=64 if use_dot else 8, block_k=128, split_k=2, use_dot=use_dot, num_stages=2)
    got = skinny_linear(x, w, config=config)
    assert got.dtype == dtype and not got.isnan().any()
    bound = 1e-4 if dtype == torch.float32 else 2e-3
    assert max_rel_error(got, F.linear(x.double(), w.double())) <= bound


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize(
    ("name", "n", "k"),
    [("35b-attn-o", 2048, 4096), ("27b-mlp-down", 5120, 17408), ("odd", 1031, 999)],
    ids=["35b-attn-o", "27b-mlp-down", "odd"],
)
def test_partials_into_add_rms_norm_cuda_equal_the_reduce(name: str, n: int, k: int, rows: int) -> None:
    """The decode path of `linear_add_rms_norm` at the split-K shapes: the norm kernel summing the GEMV's
    partials gives the same residual stream, bit for bit, as the GEMV's reduce launch followed by
    `add_rms_norm` (outputs poisoned first), and the same normed row up to the order of its fp32 sum of
    squares; the odd shape runs a split config that no block divides."""
    from ninfer.ops.triton.norm import add_rms_norm, add_rms_norm_partials
    from ninfer.ops.triton.skinny_gemm import SkinnyConfig, skinny_linear, skinny_linear_partials

    config = None
    if name == "odd":
        config = SkinnyConfig(block_n=64, block_k=128, split_k=3, num_stages=3, use_dot=True)
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16)
    residual = torch.randn(rows, n, generator=gen, device="cuda").to(torch.bfloat16)
    weight = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)
    poisoned = [torch.full_like(residual, float("nan")) for _ in range(2)]

    partials = skinny_linear_partials(x, w, config=config)
    normed, summed = add_rms_norm_partials(
        partials, residual, weight, 1e-6, out=poisoned[0], summed_out=poisoned[1]
    )
    want_normed, want_summed = add_rms_norm(skinny_linear(x, w, config=config), residual, weight, 1e-6)

    assert partials.shape[0] > 1 or rows == 1
    assert torch.equal(summed, want_summed)
    # normed: the same up to the sum of squares' fp32 order (the norm kernel's warps follow the slabs)
    assert max_rel_error(normed, want_normed) <= 2**-7
    assert max_rel_error(summed, F.linear(x.float(), w.float()) + residual.float()) <= BF16_BOUND


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_skinny_linear_cuda_graph_replay_is_deterministic(rows: int) -> None:
    """Captured (split-K partials allocated in the capture), replayed on new x: right, bitwise stable."""
    from ninfer.ops.triton.skinny_gemm import SkinnyConfig, skinny_linear

    n, k = 2048, 4096
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(torch.bfloat16)
    out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
    config = SkinnyConfig(block_n=64, block_k=128, split_k=4, use_dot=True, num_stages=3)
    skinny_linear(x, w, out=out, config=config)  # compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        skinny_linear(x, w, out=out, config=config)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(x, w, out=out, config=config)

    x.copy_(torch.randn(rows, k, device="cuda").to(torch.bfloat16))
    out.fill_(float("nan"))
    graph.replay()
    first = out.clone()
    assert max_rel_error(first, F.linear(x.float(), w.float())) <= BF16_BOUND
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, first), "split-K must reduce in a fixed order"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize(
    ("name", "n", "k", "channels"), [("27b", 16480, 5120, 10240), ("35b", 12352, 2048, 8192)]
)
@pytest.mark.parametrize("settled", [False, True], ids=["plain", "settled"])
def test_conv_epilogue_cuda_gdn_in_shapes(
    name: str, n: int, k: int, channels: int, rows: int, settled: bool
) -> None:
    """The GDN input projection with the conv step inside (default tiles, bf16) against the projection
    and then the conv step kernel over the same pool, slots moved, in place, fresh and padding; its conv
    inputs loaded before the PDL wait or after it."""
    from ninfer.ops.triton.conv_update import causal_conv1d_update_slots
    from ninfer.ops.triton.skinny_gemm import ConvStep, skinny_linear

    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16)
    pool = torch.randn(2 * rows + 1, channels, 3, generator=gen, device="cuda").to(torch.bfloat16)
    conv_weight = (torch.randn(channels, 4, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    state_in = torch.arange(rows, device="cuda")
    state_out = torch.arange(rows, 2 * rows, device="cuda")
    state_out[0] = 0  # in place
    state_in[-1], state_out[-1] = (-1, -1) if rows > 1 else (0, 0)  # a padding row
    fresh = torch.zeros(rows, dtype=torch.bool, device="cuda")
    fresh[rows // 2] = True
    pool_want = pool.clone()
    projected = skinny_linear(x, w, config=_unsplit_default(rows, n, k))
    conv_want = causal_conv1d_update_slots(
        projected[:, :channels], pool_want, conv_weight, state_in, state_out, fresh
    )
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    step = ConvStep(
        pool=pool, weight=conv_weight, state_in=state_in, state_out=state_out, fresh=fresh, settled=settled
    )

    got = skinny_linear(x, w, out=out, conv=step)

    assert torch.equal(got[:, channels:], projected[:, channels:])
    assert max_rel_error(got[:, :channels], conv_want) <= BF16_BOUND
    assert (got[:, :channels] != conv_want).float().mean() < 0.01, "more than rounding differs"
    assert torch.equal(pool, pool_want)


def _unsplit_default(rows: int, n: int, k: int) -> SkinnyConfig:
    import dataclasses

    from ninfer.ops.triton.skinny_gemm import default_config

    return dataclasses.replace(default_config(rows, n, k), split_k=1)
