"""Reference SwiGLU MLP and MoE block vs transformers' Qwen3_5MLP / Qwen3_5MoeSparseMoeBlock."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from ninfer.ops.mlp import swiglu_mlp
from ninfer.ops.moe import moe_block, moe_experts, moe_route

torch.set_num_threads(1)
HIDDEN, EXPERTS, TOP_K, MOE_I, SHARED_I = 32, 8, 3, 16, 24


def _randomised(module: torch.nn.Module, seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return module.to(dtype).eval()


def _hf_moe_block(seed: int, dtype: torch.dtype = torch.float32) -> hf_moe.Qwen3_5MoeSparseMoeBlock:
    config = Qwen3_5MoeTextConfig(
        hidden_size=HIDDEN,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=MOE_I,
        shared_expert_intermediate_size=SHARED_I,
    )
    return _randomised(hf_moe.Qwen3_5MoeSparseMoeBlock(config), seed, dtype)


def _our_moe_block(block: hf_moe.Qwen3_5MoeSparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    shared = block.shared_expert
    return moe_block(
        x,
        block.gate.weight,
        block.experts.gate_up_proj,
        block.experts.down_proj,
        shared.gate_proj.weight,
        shared.up_proj.weight,
        shared.down_proj.weight,
        block.shared_expert_gate.weight,
        TOP_K,
    )


def test_swiglu_mlp_matches_hf() -> None:
    config = Qwen3_5TextConfig(hidden_size=HIDDEN, intermediate_size=40)
    mlp = _randomised(hf.Qwen3_5MLP(config, intermediate_size=40), seed=0)
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = swiglu_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        torch.testing.assert_close(got, mlp(x), rtol=1e-5, atol=1e-6)


def test_moe_route_matches_hf_router() -> None:
    block = _hf_moe_block(seed=2)
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        weights, expert_ids = moe_route(x, block.gate.weight, TOP_K)
        _, hf_weights, hf_ids = block.gate(x)
    assert expert_ids.dtype == torch.long and torch.equal(expert_ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weights.sum(-1), torch.ones(13), rtol=1e-6, atol=1e-6)


def test_moe_experts_match_naive_per_token_loop() -> None:
    gen = torch.Generator().manual_seed(4)
    n_tokens = 9
    x = torch.randn(n_tokens, HIDDEN, generator=gen)
    gate_up = torch.randn(EXPERTS, 2 * MOE_I, HIDDEN, generator=gen) * 0.2
    down = torch.randn(EXPERTS, HIDDEN, MOE_I, generator=gen) * 0.2
    expert_ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(n_tokens)])
    weights = torch.rand(n_tokens, TOP_K, generator=gen)
    got = moe_experts(x, weights, expert_ids, gate_up, down)
    for n in range(n_tokens):
        expected = torch.zeros(HIDDEN, dtype=torch.float64)
        for slot in range(TOP_K):
            e = int(expert_ids[n, slot])
            gate = gate_up[e, :MOE_I].double() @ x[n].double()
            up = gate_up[e, MOE_I:].double() @ x[n].double()
            expected += weights[n, slot].double() * (down[e].double() @ (F.silu(gate) * up))
        torch.testing.assert_close(got[n].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_tokens", [1, 6, 23])
def test_moe_block_matches_hf(n_tokens: int) -> None:
    block = _hf_moe_block(seed=5)
    x = torch.randn(1, n_tokens, HIDDEN, generator=torch.Generator().manual_seed(n_tokens))
    with torch.no_grad():
        torch.testing.assert_close(_our_moe_block(block, x[0]), block(x)[0], rtol=1e-5, atol=1e-6)


def test_moe_block_bf16_close_to_hf() -> None:
    block = _hf_moe_block(seed=6, dtype=torch.bfloat16)
    x = torch.randn(1, 10, HIDDEN, generator=torch.Generator().manual_seed(7)).bfloat16()
    with torch.no_grad():
        got = _our_moe_block(block, x[0])
        expected = block(x)[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_moe_block_is_differentiable() -> None:
    block = _hf_moe_block(seed=8)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9))
    params = list(block.parameters())
    x_ours = x.clone().requires_grad_(True)
    _our_moe_block(block, x_ours).pow(2).sum().backward()
    ours = [x_ours.grad] + [p.grad.clone() for p in params]
    block.zero_grad()
    x_hf = x.clone().requires_grad_(True)
    block(x_hf[None]).pow(2).sum().backward()
    theirs = [x_hf.grad] + [p.grad for p in params]
    for g_ours, g_hf in zip(ours, theirs, strict=True):
        torch.testing.assert_close(g_ours, g_hf, rtol=1e-5, atol=1e-6)
