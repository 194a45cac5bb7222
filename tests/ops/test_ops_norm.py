"""Reference norms vs transformers' Qwen3_5RMSNorm / Qwen3_5RMSNormGated / l2norm, values and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from ninfer.ops.norm import gated_rms_norm, l2norm, rms_norm

torch.set_num_threads(1)
EPS = 1e-6


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    """fp32: rounding-level; bf16: bit-exact, because the rounding steps are the same as HF's."""
    return {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0.0, "atol": 0.0}


def _hf_rms_norm(dim: int, weight: torch.Tensor) -> hf.Qwen3_5RMSNorm:
    module = hf.Qwen3_5RMSNorm(dim, eps=EPS).to(weight.dtype)
    module.weight.data.copy_(weight)
    return module


def _hf_gated_norm(dim: int, weight: torch.Tensor) -> hf.Qwen3_5RMSNormGated:
    module = hf.Qwen3_5RMSNormGated(dim, eps=EPS).to(weight.dtype)
    module.weight.data.copy_(weight)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf_zero_centred(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 3, 48, generator=gen) * 3).to(dtype)
    weight = (torch.randn(48, generator=gen) * 0.5).to(dtype)  # randomised: a (1+w) vs w slip shows
    expected = _hf_rms_norm(48, weight)(x)
    got = rms_norm(x, weight, EPS)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **_tolerance(dtype))
    plain_weight_result = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)) * weight
    assert not torch.allclose(got.float(), plain_weight_result.float(), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_hf_rounding_order(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(11, 40, generator=gen) * 2).to(dtype)
    z = torch.randn(11, 40, generator=gen).to(dtype)
    weight = (1 + torch.randn(40, generator=gen) * 0.5).to(dtype)
    expected = _hf_gated_norm(40, weight)(x, z)
    got = gated_rms_norm(x, weight, z, EPS)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **_tolerance(dtype))


def test_l2norm_matches_hf_and_unit_norm() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 4, 24, generator=gen) * 4
    got = l2norm(x)
    torch.testing.assert_close(got, hf.l2norm(x, dim=-1, eps=1e-6), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(5, 4), rtol=1e-5, atol=1e-5)
    assert l2norm(x.bfloat16()).dtype == torch.bfloat16


def test_norm_gradients_match_hf() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 32, generator=gen)
    z = torch.randn(6, 32, generator=gen)
    w_zero_centred = torch.randn(32, generator=gen) * 0.3
    w_plain = 1 + torch.randn(32, generator=gen) * 0.3
    upstream = torch.randn(6, 32, generator=gen)

    def grads(fn, *inputs: torch.Tensor) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        (fn(*leaves) * upstream).sum().backward()
        return [leaf.grad for leaf in leaves]

    ours = grads(lambda a, w: rms_norm(a, w, EPS), x, w_zero_centred)
    theirs = grads(lambda a, w: _hf_functional_rms(a, w), x, w_zero_centred)
    for g_ours, g_hf in zip(ours, theirs, strict=True):
        torch.testing.assert_close(g_ours, g_hf, rtol=1e-5, atol=1e-6)

    ours = grads(lambda a, w, g: gated_rms_norm(a, w, g, EPS), x, w_plain, z)
    theirs = grads(lambda a, w, g: _hf_functional_gated(a, w, g), x, w_plain, z)
    for g_ours, g_hf in zip(ours, theirs, strict=True):
        torch.testing.assert_close(g_ours, g_hf, rtol=1e-5, atol=1e-6)

    g_ours = grads(l2norm, x)[0]
    g_hf = grads(lambda a: hf.l2norm(a, dim=-1, eps=1e-6), x)[0]
    torch.testing.assert_close(g_ours, g_hf, rtol=1e-5, atol=1e-6)


def _hf_functional_rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """HF's module forward with the weight as a graph input (so its gradient is comparable)."""
    module = hf.Qwen3_5RMSNorm(x.shape[-1], eps=EPS)
    del module.weight
    module.weight = weight
    return module(x)


def _hf_functional_gated(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    module = hf.Qwen3_5RMSNormGated(x.shape[-1], eps=EPS)
    del module.weight
    module.weight = weight
    return module(x, z)
