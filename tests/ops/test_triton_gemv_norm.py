"""Fused one-row GEMV + residual add + RMSNorm (`ninfer.ops.triton.gemv_norm`) against the composition.

CPU tests run the kernel (elementwise and dot GEMV, with and without split-K, one and several epilogue
tiles) in the Triton interpreter, fp32, on tiny shapes whose sizes the blocks do not divide; the oracle
is F.linear + the add + `ninfer.ops.norm.rms_norm`. `gpu` tests run the compiled kernel at the real
Qwen3.6 decode shapes in bf16 against `skinny_linear` + `ninfer.ops.triton.norm.add_rms_norm`, and
replay it many times (eagerly and in a CUDA graph) to shake out ordering races of the last-program
epilogue.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import interpreted_kernels, run_interpreter_child

from ninfer.ops.norm import rms_norm

torch.set_num_threads(1)

EPS = 1e-6


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.gemv_norm")


def _max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _inputs(
    n: int, k: int, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(act [1, K], w [N, K], residual [1, N], norm_weight [N]) at decode-like scales."""
    gen = torch.Generator(device=device).manual_seed(seed)
    act = torch.randn(1, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype)
    residual = (torch.randn(1, n, generator=gen, device=device) * 2.0).to(dtype)
    norm_weight = (torch.randn(n, generator=gen, device=device) * 0.5).to(dtype)
    return act, w, residual, norm_weight


def _oracle(
    act: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, x) of the composition, fp32 GEMV: the reference ops."""
    x = (F.linear(act.float(), w.float()) + residual.float()).to(act.dtype)
    return rms_norm(x, norm_weight, EPS), x


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


def _config(kernels: ModuleType, name: str) -> object:
    block_n, block_k, split_k, use_dot, unroll = INTERPRETER_CONFIGS[name]
    return kernels.SkinnyConfig(
        block_n=block_n, block_k=block_k, split_k=split_k, use_dot=use_dot, unroll=unroll
    )


@pytest.mark.parametrize("config_name", list(INTERPRETER_CONFIGS))
@pytest.mark.parametrize("n", [5, 33])
@pytest.mark.parametrize("k", [16, 40])
def test_linear_add_rms_norm_matches_composition(
    kernels: ModuleType, config_name: str, n: int, k: int
) -> None:
    act, w, residual, norm_weight = _inputs(n, k, seed=n * 100 + k)
    residual_before = residual.clone()
    out_h = torch.full((1, n), float("nan"))
    out_x = torch.full((1, n), float("nan"))

    h, x = kernels.linear_add_rms_norm(
        act, w, residual, norm_weight, EPS, out_h=out_h, out_x=out_x, config=_config(kernels, config_name)
    )

    assert h.data_ptr() == out_h.data_ptr() and x.data_ptr() == out_x.data_ptr()
    want_h, want_x = _oracle(act, w, residual, norm_weight)
    torch.testing.assert_close(x, want_x, **CLOSE)
    torch.testing.assert_close(h, want_h, **CLOSE)
    assert torch.equal(residual, residual_before), "residual is read only unless it is out_x"
    assert kernels._ticket_counter(torch.device("cpu")).item() == 0, "the last program resets the counter"


@pytest.mark.parametrize("in_place", [False, True], ids=["out-x", "in-place"])
@pytest.mark.parametrize("config_name", ["fma", "fma-split-uneven", "dot-split"])
def test_epilogue_over_several_tiles(
    kernels: ModuleType, config_name: str, in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Epilogue tiles of 8 over N = 37: the two-pass loop, five tiles, the last one partly masked."""
    monkeypatch.setattr(kernels, "_EPILOGUE_TILE", 8)
    act, w, residual, norm_weight = _inputs(37, 40, seed=3)
    want_h, want_x = _oracle(act, w, residual, norm_weight)

    h, x = kernels.linear_add_rms_norm(
        act, w, residual, norm_weight, EPS, out_x=residual if in_place else None,
        config=_config(kernels, config_name),
    )  # fmt: skip

    assert (x.data_ptr() == residual.data_ptr()) == in_place
    torch.testing.assert_close(x, want_x, **CLOSE)
    torch.testing.assert_close(h, want_h, **CLOSE)
    assert kernels._ticket_counter(torch.device("cpu")).item() == 0


@pytest.mark.parametrize("config_name", ["fma", "fma-split-uneven"])
def test_half_precision_rounding_order(kernels: ModuleType, config_name: str) -> None:
    """y is rounded to the model dtype BEFORE the residual add (two roundings), as the two ops round.

    Dyadic inputs with few bits make every fp32 product and sum exact, so y is the same exact number in
    the kernel and in the oracle, and x must match bit for bit; skipping y's rounding would change x.
    fp16, not bf16: the interpreter converts fp32 to bf16 by truncation (the GPU rounds to nearest even).
    """
    gen = torch.Generator().manual_seed(17)
    n, k = 33, 40
    act = (torch.randint(-64, 65, (1, k), generator=gen) / 8).half()
    w = (torch.randint(-64, 65, (n, k), generator=gen) / 64).half()
    residual = (torch.randn(1, n, generator=gen) * 100).half()
    norm_weight = (torch.randn(n, generator=gen) * 0.5).half()
    y = F.linear(act.float(), w.float())
    assert not torch.equal((y + residual.float()).half(), y.half() + residual), (
        "the inputs must tell one rounding from two"
    )

    h, x = kernels.linear_add_rms_norm(
        act, w, residual, norm_weight, EPS, config=_config(kernels, config_name)
    )

    want_x = y.half() + residual
    assert torch.equal(x, want_x)
    torch.testing.assert_close(h, rms_norm(want_x, norm_weight, EPS))


def test_in_place_residual_and_repeated_calls(kernels: ModuleType) -> None:
    """out_x = residual updates the stream in place; repeated calls (counter reset) give the same bits."""
    act, w, residual, norm_weight = _inputs(33, 40, seed=7)
    config = _config(kernels, "fma-split")
    want_h, want_x = _oracle(act, w, residual, norm_weight)

    first_h, first_x = kernels.linear_add_rms_norm(act, w, residual, norm_weight, EPS, config=config)
    again_h, again_x = kernels.linear_add_rms_norm(act, w, residual, norm_weight, EPS, config=config)
    assert torch.equal(first_h, again_h) and torch.equal(first_x, again_x)

    stream = residual.clone()
    h, x = kernels.linear_add_rms_norm(act, w, stream, norm_weight, EPS, out_x=stream, config=config)
    assert x.data_ptr() == stream.data_ptr()
    torch.testing.assert_close(x, want_x, **CLOSE)
    torch.testing.assert_close(h, want_h, **CLOSE)
    assert torch.equal(x, first_x) and torch.equal(h, first_h)
    assert kernels._ticket_counter(torch.device("cpu")).item() == 0


def test_default_config_strided_act_and_weight_view(kernels: ModuleType) -> None:
    """No config: the shape's default; act a column slice of a wider row, w a row block of a wider buffer."""
    n, k = 24, 40
    gen = torch.Generator().manual_seed(11)
    wide_act = torch.randn(1, k + 8, generator=gen)
    wide_w = torch.randn(n, k + 16, generator=gen) * k**-0.5
    act, w = wide_act[:, 8:], wide_w[:, :k]
    residual = torch.randn(1, n, generator=gen)
    norm_weight = torch.randn(n, generator=gen) * 0.5

    h, x = kernels.linear_add_rms_norm(act, w, residual, norm_weight, EPS)

    want_h, want_x = _oracle(act, w, residual, norm_weight)
    torch.testing.assert_close(x, want_x, **CLOSE)
    torch.testing.assert_close(h, want_h, **CLOSE)


def test_linear_add_rms_norm_rejects_bad_inputs(kernels: ModuleType) -> None:
    act, w, residual, norm_weight = _inputs(8, 16, seed=1)
    op = kernels.linear_add_rms_norm
    with pytest.raises(ValueError, match="exactly one row"):
        op(torch.randn(2, 16), w, torch.randn(2, 8), norm_weight, EPS)
    with pytest.raises(ValueError, match="need act"):
        op(torch.randn(1, 15), w, residual, norm_weight, EPS)
    with pytest.raises(ValueError, match="share a dtype"):
        op(act.double(), w, residual, norm_weight, EPS)
    with pytest.raises(ValueError, match="unit stride along K"):
        op(torch.randn(1, 8), torch.randn(8, 16).t(), residual, norm_weight, EPS)
    with pytest.raises(ValueError, match="residual must be"):
        op(act, w, torch.randn(1, 9), norm_weight, EPS)
    with pytest.raises(ValueError, match="residual must be"):
        op(act, w, residual.double(), norm_weight, EPS)
    with pytest.raises(ValueError, match="norm_weight must be"):
        op(act, w, residual, torch.randn(9), EPS)
    with pytest.raises(ValueError, match="out_h must be"):
        op(act, w, residual, norm_weight, EPS, out_h=torch.empty(1, 9))
    with pytest.raises(ValueError, match="out_x must be"):
        op(act, w, residual, norm_weight, EPS, out_x=torch.empty(1, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="out_h must not overlap residual"):
        op(act, w, residual, norm_weight, EPS, out_h=residual)
    shared = torch.empty(1, 8)
    with pytest.raises(ValueError, match="out_h must not overlap out_x"):
        op(act, w, residual, norm_weight, EPS, out_h=shared, out_x=shared)
    with pytest.raises(ValueError, match="need N > 0 and K > 0"):
        op(torch.randn(1, 0), torch.randn(8, 0), residual, norm_weight, EPS)
    with pytest.raises(ValueError, match="dot kernel needs"):
        op(act, w, residual, norm_weight, EPS, config=kernels.SkinnyConfig(block_n=8, use_dot=True))
    assert kernels._ticket_counter(torch.device("cpu")).item() == 0, "a rejected call launches nothing"


# ---- GPU, real shapes ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (name, N, K) of the projections followed by the residual add + norm at decode
REAL_SHAPES = [
    ("27b-attn-o", 5120, 24 * 256),
    ("27b-gdn-out", 5120, 48 * 128),
    ("27b-mlp-down", 5120, 17408),
    ("35b-attn-o", 2048, 16 * 256),
    ("35b-gdn-out", 2048, 32 * 128),
]
BF16_BOUND = 1e-2


def _composition(
    act: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    config: object = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, x) of the two launches the fused op replaces."""
    from ninfer.ops.triton.norm import add_rms_norm
    from ninfer.ops.triton.skinny_gemm import skinny_linear

    y = skinny_linear(act, w, config=config)  # type: ignore[arg-type]
    return add_rms_norm(y, residual, norm_weight, EPS)


def _check_cuda(n: int, k: int, seed: int, dtype: torch.dtype, bound: float, config: object = None) -> None:
    from ninfer.ops.triton.gemv_norm import _ticket_counter, linear_add_rms_norm

    act, w, residual, norm_weight = _inputs(n, k, seed, dtype, "cuda")
    want_h, want_x = _composition(act, w, residual, norm_weight, config)
    oracle_h, oracle_x = _oracle(act, w, residual, norm_weight)
    out_h = torch.full((1, n), float("nan"), dtype=dtype, device="cuda")
    out_x = torch.full((1, n), float("nan"), dtype=dtype, device="cuda")

    linear_add_rms_norm(act, w, residual, norm_weight, EPS, out_h=out_h, out_x=out_x, config=config)  # type: ignore[arg-type]

    assert not out_h.isnan().any() and not out_x.isnan().any()
    for got, want, oracle, name in ((out_x, want_x, oracle_x, "x"), (out_h, want_h, oracle_h, "h")):
        error = _max_rel_error(got, want)
        assert error <= bound, f"N={n} K={k} {config}: {name} vs the composition, max rel error {error:.2e}"
        error = _max_rel_error(got, oracle)
        assert error <= bound, f"N={n} K={k} {config}: {name} vs the fp32 oracle, max rel error {error:.2e}"
    assert _ticket_counter(act.device).item() == 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("name", "n", "k"), REAL_SHAPES, ids=[s[0] for s in REAL_SHAPES])
def test_linear_add_rms_norm_cuda_real_shapes(name: str, n: int, k: int) -> None:
    _check_cuda(n, k, seed=n + k, dtype=torch.bfloat16, bound=BF16_BOUND)


# (block_n, block_k, split_k, num_warps, num_stages, use_dot, unroll): every code path, compiled
GPU_CONFIGS = {
    "fma": (8, 256, 1, 4, 1, False, 1),
    "fma-unroll": (4, 512, 1, 4, 1, False, 2),
    "fma-split": (8, 128, 4, 4, 1, False, 2),
    "fma-w8": (16, 512, 1, 8, 1, False, 1),
    "dot": (64, 128, 1, 4, 4, True, 1),
    "dot-split": (32, 256, 3, 4, 3, True, 1),
}
# N and K that no block divides (K still a multiple of 8, so rows stay 16-byte aligned), and an odd K
ODD_SHAPES = [(5000 + 7, 2056), (257, 1030 + 8), (1031, 999), (9000, 512)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config_name", list(GPU_CONFIGS))
@pytest.mark.parametrize(("n", "k"), ODD_SHAPES)
def test_linear_add_rms_norm_cuda_configs_odd_shapes(config_name: str, n: int, k: int) -> None:
    from ninfer.ops.triton.skinny_gemm import SkinnyConfig

    fields = ("block_n", "block_k", "split_k", "num_warps", "num_stages", "use_dot", "unroll")
    config = SkinnyConfig(**dict(zip(fields, GPU_CONFIGS[config_name])))
    _check_cuda(n, k, seed=n * 3 + k, dtype=torch.bfloat16, bound=BF16_BOUND, config=config)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_linear_add_rms_norm_cuda_other_dtypes(dtype: torch.dtype) -> None:
    _check_cuda(5120, 6144, seed=5, dtype=dtype, bound=1e-4 if dtype == torch.float32 else 2e-3)


@pytest.mark.gpu
@gpu
def test_linear_add_rms_norm_cuda_in_place_residual() -> None:
    from ninfer.ops.triton.gemv_norm import linear_add_rms_norm

    act, w, residual, norm_weight = _inputs(5120, 6144, 9, torch.bfloat16, "cuda")
    want_h, want_x = _composition(act, w, residual, norm_weight)
    h, x = linear_add_rms_norm(act, w, residual, norm_weight, EPS, out_x=residual)
    assert x.data_ptr() == residual.data_ptr()
    assert _max_rel_error(x, want_x) <= BF16_BOUND and _max_rel_error(h, want_h) <= BF16_BOUND


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("name", "n", "k"), [REAL_SHAPES[2], REAL_SHAPES[3]], ids=["27b-down", "35b-o-split"]
)
def test_linear_add_rms_norm_cuda_repeated_eager_and_graph(name: str, n: int, k: int) -> None:
    """50 eager launches and 50 graph replays on poisoned outputs: the same bits every time, no NaN."""
    from ninfer.ops.triton.gemv_norm import _ticket_counter, linear_add_rms_norm

    act, w, residual, norm_weight = _inputs(n, k, 13, torch.bfloat16, "cuda")
    out_h = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    out_x = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")

    def step() -> None:
        linear_add_rms_norm(act, w, residual, norm_weight, EPS, out_h=out_h, out_x=out_x)

    step()  # compiles and allocates the counter outside the capture
    first_h, first_x = out_h.clone(), out_x.clone()
    want_h, want_x = _composition(act, w, residual, norm_weight)
    assert _max_rel_error(first_x, want_x) <= BF16_BOUND and _max_rel_error(first_h, want_h) <= BF16_BOUND
    for _ in range(50):
        out_h.fill_(float("nan"))
        out_x.fill_(float("nan"))
        step()
        assert torch.equal(out_h, first_h) and torch.equal(out_x, first_x), "eager launch differs"

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(50):
        out_h.fill_(float("nan"))
        out_x.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out_h, first_h) and torch.equal(out_x, first_x), "graph replay differs"
    assert _ticket_counter(act.device).item() == 0

    # the graph reads its inputs at replay: a new act gives the new (right) result
    act.copy_(torch.randn_like(act))
    graph.replay()
    want_h, want_x = _composition(act, w, residual, norm_weight)
    assert _max_rel_error(out_x, want_x) <= BF16_BOUND and _max_rel_error(out_h, want_h) <= BF16_BOUND
