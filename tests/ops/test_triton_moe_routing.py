"""Triton MoE routing (`ninfer.ops.triton.moe_routing`) against the reference router `moe_route_logits` and
the shared-expert gate sigmoid(F.linear(x, w_sg).float()).

CPU tests run the kernel in the Triton interpreter in a child process (tiny E, K, T). `gpu` tests run the
compiled kernel at the Qwen3.6-35B-A3B shapes (E=256, K=8, H=2048) in bf16 on random logits, where ties
among bf16 logits do happen: ids are compared exactly on the tokens without ties, the chosen logits on all.
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
    return interpreted_kernels("ninfer.ops.triton.moe_routing")


def _distinct_logits(tokens: int, num_experts: int, gen: torch.Generator, **kw: object) -> torch.Tensor:
    """Logits without ties in any dtype: a random permutation of multiples of 1/32 in [-4, 4) (exact in
    bf16), so the top-k order is unique and ids compare exactly."""
    rows = [torch.randperm(num_experts, generator=gen) for _ in range(tokens)]
    return ((torch.stack(rows).float() - num_experts / 2) / 32).to(**kw)  # type: ignore[arg-type]


def _reference_shared_weight(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(F.linear(x, gate.reshape(1, -1).to(x.dtype)).float()).reshape(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 2), (12, 3), (16, 4)])
@pytest.mark.parametrize("tokens", [1, 3, 5])
def test_routing_matches_reference(
    kernels: ModuleType, tokens: int, num_experts: int, top_k: int, dtype: torch.dtype
) -> None:
    """E = 12: not a power of two (masked tile). fp16 logits: the weights are rounded to fp16 (the
    interpreter truncates casts to bf16 instead of rounding them, so bf16 is left to the gpu tests)."""
    gen = torch.Generator().manual_seed(100 * tokens + num_experts)
    logits = _distinct_logits(tokens, num_experts, gen, dtype=dtype)

    weights, ids, shared_weight = kernels.moe_route_topk(logits, top_k)

    ref_weights, ref_ids = moe_route_logits(logits, top_k)
    assert shared_weight is None
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (tokens, top_k)
    assert torch.equal(ids.long(), ref_ids)
    # the kernel's fp32 probs may differ from torch's by an ulp of fp32 (exp): rounded, nearly all equal
    torch.testing.assert_close(
        weights, ref_weights.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=0
    )
    assert torch.equal(weights, weights.to(dtype).float()), "not rounded to the logits' dtype"
    if dtype != torch.float32:
        assert (weights != ref_weights.float()).float().mean() <= 0.1


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("tokens", [1, 3, 5])
def test_routing_with_shared_gate_strided_logits_and_out_buffers(
    kernels: ModuleType, tokens: int, x_dtype: torch.dtype
) -> None:
    """Logits a column slice of one projection output (as the model splits router | shared gate/up), H
    not a power of two and spanning no whole block, [1, H] gate in fp32 cast to x's dtype, outputs into
    poisoned strided buffers."""
    gen = torch.Generator().manual_seed(7 + tokens)
    num_experts, top_k, hidden = 12, 3, 45
    projection = torch.randn(tokens, num_experts + 10, generator=gen)
    projection[:, :num_experts] = _distinct_logits(tokens, num_experts, gen)
    logits = projection[:, :num_experts]
    x = torch.randn(tokens, hidden, generator=gen).to(x_dtype)
    gate = torch.randn(1, hidden, generator=gen) * hidden**-0.5
    weights_out = torch.full((tokens, 2 * top_k), float("nan"))[:, ::2]
    ids_out = torch.full((tokens, top_k + 1), -1, dtype=torch.int32)[:, 1:]
    shared_out = torch.full((tokens, 2), float("nan"))[:, 1]

    weights, ids, shared_weight = kernels.moe_route_topk(
        logits, top_k, x=x, shared_expert_gate=gate, weights_out=weights_out, ids_out=ids_out,
        shared_weight_out=shared_out,
    )  # fmt: skip

    assert weights is weights_out and ids is ids_out and shared_weight is shared_out
    ref_weights, ref_ids = moe_route_logits(logits, top_k)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights.float(), rtol=1e-5, atol=0)
    expected = _reference_shared_weight(x, gate)
    torch.testing.assert_close(
        shared_weight, expected, rtol=0, atol=1e-5 if x_dtype == torch.float32 else 2e-3
    )


def test_routing_fp16_shared_gate_rounds_its_logit(kernels: ModuleType) -> None:
    """fp16 x: the gate logit is rounded to fp16 before the sigmoid (rounded at the same point as the
    reference, the sigmoids match up to the dot's fp32 summation order)."""
    gen = torch.Generator().manual_seed(3)
    tokens, hidden = 5, 64
    x = (torch.randn(tokens, hidden, generator=gen) * 3).half()
    gate = torch.randn(hidden, generator=gen).half()
    logits = _distinct_logits(tokens, 8, gen, dtype=torch.float16)

    _, _, shared_weight = kernels.moe_route_topk(logits, 2, x=x, shared_expert_gate=gate)

    expected = _reference_shared_weight(x, gate)
    torch.testing.assert_close(shared_weight, expected, rtol=0, atol=1e-3)
    assert (shared_weight == expected).float().mean() >= 0.8
    unrounded = torch.sigmoid(x.float() @ gate.float())
    assert not torch.allclose(shared_weight, unrounded, rtol=0, atol=1e-6), "logit not rounded"


def test_routing_ties_pick_the_lowest_expert_index(kernels: ModuleType) -> None:
    logits = torch.tensor(
        [
            [0.0, 2.0, 1.0, 2.0, 2.0, -1.0, 0.5, 0.25],  # three tied maxima: 1, 3, 4 in index order
            [3.0, 1.0, 1.0, 0.0, 1.0, 1.0, -2.0, 0.0],  # a tie at the top-k boundary: 1 and 2 of {1, 2, 4, 5}
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # all equal: the first k
        ]
    )

    weights, ids, _ = kernels.moe_route_topk(logits, 3)

    assert ids.tolist() == [[1, 3, 4], [0, 1, 2], [0, 1, 2]]
    ref_weights, _ = moe_route_logits(logits, 3)  # weights agree whatever order torch gives the ties
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)


def test_routing_all_experts_and_negative_infinite_logits(kernels: ModuleType) -> None:
    """K = E (every expert, all masked out by the last round) and -inf logits (never a NaN, never an index
    out of range)."""
    logits = torch.tensor([[0.5, float("-inf"), 2.0, float("-inf"), -1.0]])

    weights, ids, _ = kernels.moe_route_topk(logits, 5)

    assert ids.tolist() == [[2, 0, 4, 1, 3]]
    assert not weights.isnan().any() and weights[0, 3:].eq(0).all()
    torch.testing.assert_close(weights, moe_route_logits(logits, 5)[0], rtol=1e-6, atol=0)


def test_routing_no_tokens_and_bad_arguments(kernels: ModuleType) -> None:
    weights, ids, shared = kernels.moe_route_topk(torch.empty(0, 8), 2)
    assert weights.shape == ids.shape == (0, 2) and shared is None
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="top_k"):
        kernels.moe_route_topk(logits, 9)
    with pytest.raises(ValueError, match="both"):
        kernels.moe_route_topk(logits, 2, x=torch.randn(3, 16))
    with pytest.raises(ValueError, match="shared_expert_gate"):
        kernels.moe_route_topk(logits, 2, x=torch.randn(3, 16), shared_expert_gate=torch.randn(2, 16))
    with pytest.raises(ValueError, match="ids_out"):
        kernels.moe_route_topk(logits, 2, ids_out=torch.empty(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="weights_out"):
        kernels.moe_route_topk(logits, 2, weights_out=torch.empty(3, 3))


# ---- GPU, real shapes ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
REAL_E, REAL_K, REAL_H = 256, 8, 2048


def _bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    exponent = torch.floor(torch.log2(values.float().abs().clamp_min(2.0**-126)))
    return torch.exp2(exponent - 7)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 3, 8, 37, 4096])
def test_routing_cuda_real_shapes_bf16(tokens: int) -> None:
    """Random bf16 logits as the router GEMM makes them (ties among bf16 values happen at this size)."""
    from ninfer.ops.triton.moe_routing import moe_route_topk

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, REAL_H, generator=gen, device="cuda").bfloat16()
    router = (torch.randn(REAL_E, REAL_H, generator=gen, device="cuda") * REAL_H**-0.5).bfloat16()
    gate = (torch.randn(1, REAL_H, generator=gen, device="cuda") * REAL_H**-0.5).bfloat16()
    logits = F.linear(x, router)
    weights_out = torch.full((tokens, REAL_K), float("nan"), device="cuda")
    ids_out = torch.full((tokens, REAL_K), -1, dtype=torch.int32, device="cuda")
    shared_out = torch.full((tokens,), float("nan"), device="cuda")

    weights, ids, shared_weight = moe_route_topk(
        logits, REAL_K, x=x, shared_expert_gate=gate, weights_out=weights_out, ids_out=ids_out,
        shared_weight_out=shared_out,
    )  # fmt: skip

    assert not weights.isnan().any() and not shared_weight.isnan().any()
    assert ids.min() >= 0 and ids.max() < REAL_E
    ref_weights, ref_ids = moe_route_logits(logits, REAL_K)
    chosen, ref_chosen = logits.gather(1, ids.long()), logits.gather(1, ref_ids)
    assert torch.equal(chosen, ref_chosen), "not the k largest logits in descending order"
    top = torch.topk(logits.float(), REAL_K + 1, dim=-1).values
    tie_free = (top[:, 1:] != top[:, :-1]).all(dim=-1)
    assert torch.equal(ids[tie_free].long(), ref_ids[tie_free])
    torch.testing.assert_close(weights, ref_weights.float(), rtol=1e-2, atol=0)
    assert (weights == ref_weights.float()).float().mean() >= 0.99
    assert (ids.sort(dim=-1).values.diff(dim=-1) > 0).all(), "an expert twice in a token's top-k"

    gate_logit = F.linear(x, gate)
    expected = torch.sigmoid(gate_logit.float()).reshape(-1)
    err = (shared_weight - expected).abs()
    # the GEMM's fp32 sum order may round the logit to the neighbouring bf16 value (rarely): one ulp
    assert (err <= 1e-3 + 0.25 * _bf16_ulp(gate_logit.reshape(-1))).all()
    assert (err <= 1e-5).float().mean() >= 0.99
