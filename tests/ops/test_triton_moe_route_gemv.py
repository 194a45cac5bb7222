"""Router GEMV + routing in one launch (`ninfer.ops.triton.moe_route_gemv`) against the two-kernel path
`moe_route_topk(F.linear(x, router), ...)` and the reference router `moe_route_logits`.

CPU tests run the kernel in the Triton interpreter in a child process (tiny E, H, T, fp32). Most use
inputs that are small multiples of powers of two, so every dot is exact in fp32 whatever the summation
order: the logits then equal F.linear's bit for bit, ties among them happen, and the ids must equal the
two-kernel path's exactly. `gpu` tests run the compiled kernel at the Qwen3.6-35B-A3B shapes (E=256,
K=8, H=2048) in bf16, also replayed 50 times from one CUDA graph with fresh inputs to shake out ordering
races between the GEMV programs and the last program that routes.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import interpreted_kernels, run_interpreter_child

from ninfer.ops.moe import moe_route_logits

torch.set_num_threads(1)


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.moe_route_gemv")


@pytest.fixture(scope="module")
def routing() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.moe_routing")


def _exact_inputs(
    tokens: int, num_experts: int, hidden: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, router, gate with values in {-2..2}/2, /4, /8: every dot of H <= 64 terms is exact in fp32."""

    def small(*shape: int, scale: float) -> torch.Tensor:
        return torch.randint(-2, 3, shape, generator=gen).float() * scale

    return (
        small(tokens, hidden, scale=0.5),
        small(num_experts, hidden, scale=0.25),
        small(hidden, scale=0.125),
    )


def _ticket_count(kernels: ModuleType) -> int:
    counter = kernels._TICKET_COUNTERS.get(torch.device("cpu"))
    return 0 if counter is None else int(counter.item())


# block_rows 8 over E = 20 / 40 (a partial last row block), H = 48 in 2 splits of 32 (the last one
# partial: the K mask), and one split of 3 x 16
SPLIT = {"block_rows": 8, "split_k": 2, "block_k": 16}
SPLIT3 = {"block_rows": 4, "split_k": 3, "block_k": 16, "num_warps": 2}


@pytest.mark.parametrize("config", [None, SPLIT, SPLIT3], ids=["default", "split2", "split3"])
@pytest.mark.parametrize(("num_experts", "top_k"), [(20, 2), (40, 4), (20, 3)])
@pytest.mark.parametrize("tokens", [1, 3])
def test_matches_two_kernel_path_exactly(
    kernels: ModuleType,
    routing: ModuleType,
    tokens: int,
    num_experts: int,
    top_k: int,
    config: dict[str, int] | None,
) -> None:
    gen = torch.Generator().manual_seed(1000 * tokens + 10 * num_experts + top_k)
    hidden = 48
    x, router, gate = _exact_inputs(tokens, num_experts, hidden, gen)
    logits_out = torch.full((tokens, num_experts), float("nan"))
    route_config = kernels.RouteGemvConfig(**config) if config is not None else None

    weights, ids, shared_weight = kernels.moe_route_gemv(
        x, router, top_k, shared_expert_gate=gate, logits_out=logits_out, config=route_config
    )

    logits = F.linear(x, router)
    assert torch.equal(logits_out, logits), "exact dots: the logits must equal F.linear's"
    ref_weights, ref_ids, ref_shared = routing.moe_route_topk(logits, top_k, x=x, shared_expert_gate=gate)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and shared_weight is not None
    assert weights.shape == ids.shape == (tokens, top_k) and shared_weight.shape == (tokens,)
    assert torch.equal(ids, ref_ids), "ids (ties included) must equal the two-kernel path's"
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)
    torch.testing.assert_close(shared_weight, ref_shared, rtol=1e-6, atol=0)
    # and the torch reference router (its order among tied logits is unspecified: compare the weights)
    torch.testing.assert_close(weights, moe_route_logits(logits, top_k)[0], rtol=1e-5, atol=0)
    assert _ticket_count(kernels) == 0, "the last program must reset the ticket counter"


@pytest.mark.parametrize("tokens", [1, 3])
def test_random_inputs_match_reference_router(kernels: ModuleType, tokens: int) -> None:
    """Gaussian inputs (dots rounded differently from F.linear's by an fp32 ulp at most): the same ids
    as the torch reference router and the same weights up to fp32 rounding."""
    gen = torch.Generator().manual_seed(5 + tokens)
    num_experts, hidden, top_k = 40, 48, 4
    x = torch.randn(tokens, hidden, generator=gen)
    router = torch.randn(num_experts, hidden, generator=gen) * hidden**-0.5

    weights, ids, shared_weight = kernels.moe_route_gemv(
        x, router, top_k, config=kernels.RouteGemvConfig(**SPLIT)
    )

    ref_weights, ref_ids = moe_route_logits(F.linear(x, router), top_k)
    assert shared_weight is None
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=0)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_strided_inputs_and_poisoned_out_buffers(
    kernels: ModuleType, routing: ModuleType, x_dtype: torch.dtype
) -> None:
    """The router a row block of a stacked projection (as [router; shared gate; shared up]) in fp32; x a
    column slice; a [1, H] gate; outputs into poisoned strided buffers. x holds 11-bit values in [1, 2),
    so the dots are still exact in fp32 but the logits need rounding in fp16: the weights must come from
    the rounded logits (bf16 is left to the gpu tests: the interpreter truncates bf16 casts instead of
    rounding them)."""
    gen = torch.Generator().manual_seed(11)
    tokens, num_experts, hidden, top_k = 3, 20, 48, 3
    _, stacked, gate = _exact_inputs(tokens, num_experts + 7, hidden + 5, gen)
    signs = torch.randint(0, 2, (tokens, hidden + 5), generator=gen).float() * 2 - 1
    x_wide = signs * (1 + torch.randint(0, 1024, (tokens, hidden + 5), generator=gen).float() / 1024)
    x = x_wide.to(x_dtype)[:, 2 : 2 + hidden]
    router = stacked[:num_experts, :hidden]
    gate = gate[:hidden].reshape(1, hidden)
    weights_out = torch.full((tokens, 2 * top_k), float("nan"))[:, ::2]
    ids_out = torch.full((tokens, top_k + 1), -1, dtype=torch.int32)[:, 1:]
    shared_out = torch.full((tokens, 2), float("nan"))[:, 1]
    logits_out = torch.full((num_experts, tokens), float("nan"), dtype=x_dtype).t()

    weights, ids, shared_weight = kernels.moe_route_gemv(
        x, router, top_k, shared_expert_gate=gate, weights_out=weights_out, ids_out=ids_out,
        shared_weight_out=shared_out, logits_out=logits_out, config=kernels.RouteGemvConfig(**SPLIT),
    )  # fmt: skip

    assert weights is weights_out and ids is ids_out and shared_weight is shared_out
    exact = x.float() @ router.t()  # exact in fp32, rounded once to x's dtype as F.linear's output is
    logits = exact.to(x_dtype)
    assert torch.equal(logits_out, logits)
    if x_dtype != torch.float32:
        assert not torch.equal(logits.float(), exact), "the test needs logits that the rounding changes"
    ref_weights, ref_ids, ref_shared = routing.moe_route_topk(logits, top_k, x=x, shared_expert_gate=gate)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)
    torch.testing.assert_close(shared_weight, ref_shared, rtol=1e-6, atol=0)
    assert torch.equal(weights, weights.to(x_dtype).float()), "not rounded to x's dtype"


def test_router_is_cast_to_x_dtype_before_the_dot(kernels: ModuleType) -> None:
    """An fp32 router whose rows are +-0.5 (summing to 0 against x = 1) plus a per-expert tail below half
    an fp16 ulp: cast to fp16 first (the reference's `router.to(x.dtype)`) every logit is exactly 0, so all
    tie and the first k experts win; without the cast the tails would rank the last experts first."""
    num_experts, hidden, top_k = 20, 48, 3
    x = torch.ones(1, hidden, dtype=torch.float16)
    pattern = torch.tensor([0.5, -0.5]).repeat(hidden // 2)
    tails = (torch.arange(num_experts, dtype=torch.float32) + 1) / num_experts * 2.0**-14
    router = pattern[None, :] + tails[:, None]
    assert torch.equal(router.half().float(), pattern.expand(num_experts, hidden))
    logits_out = torch.full((1, num_experts), float("nan"), dtype=torch.float16)

    weights, ids, _ = kernels.moe_route_gemv(x, router, top_k, logits_out=logits_out)

    assert torch.equal(logits_out, torch.zeros_like(logits_out))
    assert ids.tolist() == [[0, 1, 2]]
    assert torch.equal(weights, torch.full((1, top_k), 1.0 / top_k).half().float())


def test_ties_pick_the_lowest_expert_index(kernels: ModuleType) -> None:
    """Three identical router rows make the three largest logits equal: ids in index order, then the
    next largest; and the all-zero logits of a zero x tie everywhere: the first k experts."""
    gen = torch.Generator().manual_seed(2)
    num_experts, hidden, top_k = 20, 48, 4
    x, router, _ = _exact_inputs(2, num_experts, hidden, gen)
    x[1] = 0.0
    router[[3, 11, 17]] = torch.sign(x[0]) * 0.5  # the largest logit of token 0, three times
    router[6] = torch.sign(x[0]) * 0.25  # the next one

    weights, ids, _ = kernels.moe_route_gemv(x, router, top_k)

    assert ids.tolist() == [[3, 11, 17, 6], [0, 1, 2, 3]]
    logits = F.linear(x, router)
    torch.testing.assert_close(weights, moe_route_logits(logits, top_k)[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(weights[1], torch.full((top_k,), 1.0 / top_k), rtol=1e-6, atol=0)


def test_negative_zero_logits_tie_with_positive_zero(kernels: ModuleType, routing: ModuleType) -> None:
    """fp16 logits of +-2^-26 round to +-0.0, which compare equal: they tie, so the lowest index wins
    (as in `moe_route_topk`), not the +0.0 ones first."""
    num_experts, hidden, top_k = 8, 16, 3
    x = torch.full((1, hidden), 2.0**-24, dtype=torch.float16)  # the smallest fp16 subnormal
    signs = torch.tensor([-1.0, 1.0]).repeat(num_experts // 2)  # even experts -0.0, odd +0.0
    router = signs[:, None] * torch.full((num_experts, hidden), 2.0**-6)
    logits_out = torch.full((1, num_experts), float("nan"), dtype=torch.float16)

    weights, ids, _ = kernels.moe_route_gemv(x, router, top_k, logits_out=logits_out)

    assert torch.equal(torch.signbit(logits_out[0]), signs < 0) and (logits_out == 0).all()
    assert ids.tolist() == [[0, 1, 2]]
    assert torch.equal(ids, routing.moe_route_topk(logits_out, top_k)[1])
    torch.testing.assert_close(weights, torch.full((1, top_k), 1.0 / top_k), rtol=1e-3, atol=0)


def test_large_logits_do_not_overflow(kernels: ModuleType) -> None:
    """Logits in the hundreds: the softmax must subtract the row max (exp(100) overflows fp32)."""
    gen = torch.Generator().manual_seed(8)
    num_experts, hidden, top_k = 40, 48, 4
    x, router, _ = _exact_inputs(3, num_experts, hidden, gen)
    x = x * 128  # still exact: the logits are multiples of 1/2 up to a few hundred
    logits = F.linear(x, router)
    assert logits.max() > 200

    weights, ids, _ = kernels.moe_route_gemv(x, router, top_k)

    ref_weights, _ = moe_route_logits(logits, top_k)
    assert not weights.isnan().any()
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)
    assert torch.equal(logits.gather(1, ids.long()), logits.topk(top_k, dim=-1).values)


def test_all_experts_and_counter_reset_between_calls(kernels: ModuleType, routing: ModuleType) -> None:
    """Calls in a row with different shapes and grids share the counter: each must find it at 0. K = E:
    every expert, in descending logit order."""
    gen = torch.Generator().manual_seed(4)
    for tokens, num_experts, top_k, config in [(3, 20, 20, SPLIT), (1, 40, 2, None), (3, 40, 3, SPLIT3)]:
        x, router, gate = _exact_inputs(tokens, num_experts, 48, gen)
        route_config = kernels.RouteGemvConfig(**config) if config is not None else None

        weights, ids, shared_weight = kernels.moe_route_gemv(
            x, router, top_k, shared_expert_gate=gate, config=route_config
        )

        ref_weights, ref_ids, ref_shared = routing.moe_route_topk(
            F.linear(x, router), top_k, x=x, shared_expert_gate=gate
        )
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)
        torch.testing.assert_close(shared_weight, ref_shared, rtol=1e-6, atol=0)
        assert _ticket_count(kernels) == 0


def test_default_config_real_shape(kernels: ModuleType) -> None:
    """35B-A3B: 16 row blocks x 8 splits of 256 columns = 128 GEMV programs (one wave on 132 SMs)."""
    for tokens in (1, 8):
        config = kernels.default_config(tokens, 256, 2048)
        assert (config.block_rows, config.split_k, config.block_k) == (16, 8, 64)
    assert kernels.default_config(16, 256, 2048).block_k == 32
    tiny = kernels.default_config(3, 20, 48)
    assert tiny.split_k >= 1 and tiny.block_rows == 16


def test_no_tokens_and_bad_arguments(kernels: ModuleType) -> None:
    router = torch.randn(8, 16)
    weights, ids, shared = kernels.moe_route_gemv(torch.empty(0, 16), router, 2)
    assert weights.shape == ids.shape == (0, 2) and shared is None
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        kernels.moe_route_gemv(torch.randn(17, 16), router, 2)
    with pytest.raises(ValueError, match="top_k"):
        kernels.moe_route_gemv(x, router, 9)
    with pytest.raises(ValueError, match="top_k"):
        kernels.moe_route_gemv(x, router, 0)
    with pytest.raises(ValueError, match="router must be"):
        kernels.moe_route_gemv(x, torch.randn(8, 12), 2)
    with pytest.raises(ValueError, match="unit stride"):
        kernels.moe_route_gemv(x, torch.randn(16, 8).t(), 2)
    with pytest.raises(ValueError, match="x must be"):
        kernels.moe_route_gemv(x.double(), router, 2)
    with pytest.raises(ValueError, match="shared_expert_gate"):
        kernels.moe_route_gemv(x, router, 2, shared_expert_gate=torch.randn(2, 16))
    with pytest.raises(ValueError, match="needs shared_expert_gate"):
        kernels.moe_route_gemv(x, router, 2, shared_weight_out=torch.empty(3))
    with pytest.raises(ValueError, match="ids_out"):
        kernels.moe_route_gemv(x, router, 2, ids_out=torch.empty(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="weights_out"):
        kernels.moe_route_gemv(x, router, 2, weights_out=torch.empty(3, 3))
    with pytest.raises(ValueError, match="logits_out"):
        kernels.moe_route_gemv(x, router, 2, logits_out=torch.empty(3, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="block_rows"):
        kernels.moe_route_gemv(x, router, 2, config=kernels.RouteGemvConfig(block_rows=3))
    assert _ticket_count(kernels) == 0, "a rejected call must not launch"


# ---- GPU, real shapes ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
REAL_E, REAL_K, REAL_H = 256, 8, 2048


def _ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each value's magnitude (normal range)."""
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    exponent = torch.floor(torch.log2(values.float().abs().clamp_min(2.0**-60)))
    return torch.exp2(exponent - mantissa_bits)


class _Outputs:
    """Poisonable output buffers of one call (weights, ids, shared weight, logits)."""

    def __init__(self, tokens: int, num_experts: int, top_k: int, dtype: torch.dtype) -> None:
        self.weights = torch.empty(tokens, top_k, device="cuda")
        self.ids = torch.empty(tokens, top_k, dtype=torch.int32, device="cuda")
        self.shared = torch.empty(tokens, device="cuda")
        self.logits = torch.empty(tokens, num_experts, dtype=dtype, device="cuda")
        self.poison()

    def poison(self) -> None:
        self.weights.fill_(float("nan"))
        self.ids.fill_(-1)
        self.shared.fill_(float("nan"))
        self.logits.fill_(float("nan"))

    def kwargs(self) -> dict[str, torch.Tensor]:
        return {
            "weights_out": self.weights,
            "ids_out": self.ids,
            "shared_weight_out": self.shared,
            "logits_out": self.logits,
        }


class _Agreement:
    """Checks one call's outputs; counts the values that are not bit-equal (allowed: a few, one ulp off)."""

    def __init__(self) -> None:
        self.logits_total = self.logits_differ = 0
        self.weights_total = self.weights_differ = 0
        self.shared_total = self.shared_differ = 0

    def check(
        self, x: torch.Tensor, router: torch.Tensor, gate: torch.Tensor, top_k: int, out: _Outputs
    ) -> None:
        from ninfer.ops.triton.moe_routing import moe_route_topk

        dtype = x.dtype
        assert not out.weights.isnan().any() and not out.shared.isnan().any() and not out.logits.isnan().any()
        assert out.ids.min() >= 0 and out.ids.max() < router.shape[0]
        assert (out.ids.sort(dim=-1).values.diff(dim=-1) > 0).all(), "an expert twice in a token's top-k"

        # the GEMV: the fp32 sum order may round a logit to the neighbouring value of the model dtype (near
        # zero, where that ulp is tiny, the fp32 error bound ~ eps * sum|x w| takes over)
        w = router.to(dtype).double()
        exact = (x.double() @ w.t()).to(dtype)  # fp64: no TF32, one rounding
        logit_tol = _ulp(exact, dtype) + 2.0**-20 * (x.double().abs() @ w.abs().t()).float()
        logit_diff = (out.logits.float() - exact.float()).abs()
        assert (logit_diff <= logit_tol).all(), "a logit more than one ulp off"
        self.logits_total += exact.numel()
        self.logits_differ += int((logit_diff > 0).sum())

        # the routing, on the kernel's own logits: the ids exactly (ranking and ties are exact integer
        # logic); the weights up to the fp32 sum order of the softmax, which can move a rounding by one ulp
        ref_weights, ref_ids, ref_shared = moe_route_topk(out.logits, top_k, x=x, shared_expert_gate=gate)
        assert torch.equal(out.ids, ref_ids)
        weight_diff = (out.weights - ref_weights).abs()
        assert (weight_diff <= _ulp(ref_weights, dtype)).all(), "a weight more than one ulp off"
        self.weights_total += ref_weights.numel()
        self.weights_differ += int((weight_diff > 1e-6).sum())
        assert torch.allclose(out.weights.sum(dim=-1), torch.ones_like(out.shared), rtol=0, atol=2e-2)

        # the gate: sigmoid of the rounded fp32 dot; a one-ulp logit rounding moves it by < ulp / 4
        g = gate.reshape(-1).to(dtype).double()
        gate_logit = (x.double() @ g).to(dtype)
        gate_tol = 1e-6 + 0.25 * (_ulp(gate_logit, dtype) + 2.0**-20 * (x.double().abs() @ g.abs()).float())
        shared_diff = (out.shared - torch.sigmoid(gate_logit.float())).abs()
        assert (shared_diff <= gate_tol).all()
        assert ((out.shared - ref_shared).abs() <= 2 * gate_tol).all()
        self.shared_total += shared_diff.numel()
        self.shared_differ += int((shared_diff > 1e-6).sum())

    def assert_mostly_bit_equal(self) -> None:
        assert self.logits_differ <= max(2, 0.01 * self.logits_total), (self.logits_differ, self.logits_total)
        assert self.weights_differ <= max(2, 0.01 * self.weights_total), (
            self.weights_differ,
            self.weights_total,
        )
        assert self.shared_differ <= max(2, 0.01 * self.shared_total), (self.shared_differ, self.shared_total)


def _real_inputs(
    tokens: int, gen: torch.Generator, num_experts: int = REAL_E, hidden: int = REAL_H
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
    router = (torch.randn(num_experts, hidden, generator=gen, device="cuda") * hidden**-0.5).bfloat16()
    gate = (torch.randn(1, hidden, generator=gen, device="cuda") * hidden**-0.5).bfloat16()
    return x, router, gate


def _ticket_count_cuda() -> int:
    from ninfer.ops.triton import moe_route_gemv as module

    return int(module._TICKET_COUNTERS[torch.device("cuda", torch.cuda.current_device())].item())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 3, 5, 8, 16])
def test_cuda_real_shapes_bf16(tokens: int) -> None:
    """Poisoned outputs; the fused launch against the fp32 oracle's logits, `moe_route_topk` on its own
    logits, and the whole two-kernel path (cuBLAS + `moe_route_topk`) on the tokens whose cuBLAS logits
    equal its logits bit for bit."""
    from ninfer.ops.triton.moe_route_gemv import moe_route_gemv
    from ninfer.ops.triton.moe_routing import moe_route_topk

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    agreement = _Agreement()
    for _ in range(4):
        x, router, gate = _real_inputs(tokens, gen)
        out = _Outputs(tokens, REAL_E, REAL_K, torch.bfloat16)

        weights, ids, shared = moe_route_gemv(x, router, REAL_K, shared_expert_gate=gate, **out.kwargs())

        assert weights is out.weights and ids is out.ids and shared is out.shared
        agreement.check(x, router, gate, REAL_K, out)
        cublas_logits = F.linear(x, router)
        two_kernel = moe_route_topk(cublas_logits, REAL_K, x=x, shared_expert_gate=gate)
        same_rows = (cublas_logits == out.logits).all(dim=-1)
        assert torch.equal(out.ids[same_rows], two_kernel[1][same_rows])
        diff = (out.weights[same_rows] - two_kernel[0][same_rows]).abs()
        assert diff.numel() == 0 or diff.max() <= 2.0**-8
        assert _ticket_count_cuda() == 0
    agreement.assert_mostly_bit_equal()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("tokens", "config"),
    [(3, (8, 4, 128)), (8, (32, 4, 32)), (8, (16, 1, 64)), (2, (4, 16, 128))],
    ids=["8x4x128", "32x4x32", "16-nosplit", "4x16x128"],
)
def test_cuda_other_configs(tokens: int, config: tuple[int, int, int]) -> None:
    from ninfer.ops.triton.moe_route_gemv import RouteGemvConfig, moe_route_gemv

    gen = torch.Generator(device="cuda").manual_seed(100 + tokens)
    block_rows, split_k, block_k = config
    route_config = RouteGemvConfig(block_rows=block_rows, split_k=split_k, block_k=block_k)
    agreement = _Agreement()
    for _ in range(4):
        x, router, gate = _real_inputs(tokens, gen)
        out = _Outputs(tokens, REAL_E, REAL_K, torch.bfloat16)
        moe_route_gemv(x, router, REAL_K, shared_expert_gate=gate, config=route_config, **out.kwargs())
        agreement.check(x, router, gate, REAL_K, out)
    agreement.assert_mostly_bit_equal()


@pytest.mark.gpu
@gpu
def test_cuda_odd_shapes() -> None:
    """E, H not multiples of the blocks (masked rows, a partial last K split), K = 6, T = 5, an fp32 router
    and gate cast to bf16 in the kernel, x a column slice, strided poisoned outputs."""
    from ninfer.ops.triton.moe_route_gemv import moe_route_gemv

    gen = torch.Generator(device="cuda").manual_seed(9)
    tokens, num_experts, hidden, top_k = 5, 200, 1000, 6
    wide = torch.randn(tokens, hidden + 24, generator=gen, device="cuda").bfloat16()
    x = wide[:, 8 : 8 + hidden]
    router = torch.randn(num_experts, hidden, generator=gen, device="cuda") * hidden**-0.5
    gate = torch.randn(hidden, generator=gen, device="cuda") * hidden**-0.5
    out = _Outputs(tokens, num_experts, top_k, torch.bfloat16)
    weights_out = torch.full((tokens, 2 * top_k), float("nan"), device="cuda")[:, 1::2]
    out.weights = weights_out

    moe_route_gemv(x, router, top_k, shared_expert_gate=gate, **out.kwargs())

    agreement = _Agreement()
    agreement.check(x, router, gate, top_k, out)
    agreement.assert_mostly_bit_equal()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_cuda_graph_replays_with_fresh_inputs(tokens: int) -> None:
    """One capture, 50 replays: fresh x and router each time, outputs poisoned before each replay. The
    scratch sits at the same address every replay, so a last program that read a partial before its
    owner stored it would route on the previous replay's logits and fail the checks."""
    from ninfer.ops.triton.moe_route_gemv import moe_route_gemv

    gen = torch.Generator(device="cuda").manual_seed(50 + tokens)
    x, router, gate = _real_inputs(tokens, gen)
    out = _Outputs(tokens, REAL_E, REAL_K, torch.bfloat16)

    def step() -> None:
        moe_route_gemv(x, router, REAL_K, shared_expert_gate=gate, **out.kwargs())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles, and allocates the ticket counter outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    agreement = _Agreement()
    for _ in range(50):
        fresh_x, fresh_router, fresh_gate = _real_inputs(tokens, gen)
        x.copy_(fresh_x)
        router.copy_(fresh_router)
        gate.copy_(fresh_gate)
        out.poison()
        graph.replay()
        torch.cuda.synchronize()
        agreement.check(x, router, gate, REAL_K, out)
    agreement.assert_mostly_bit_equal()
    assert _ticket_count_cuda() == 0
