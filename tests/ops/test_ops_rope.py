"""Reference M-RoPE vs transformers' Qwen3_5TextRotaryEmbedding / apply_rotary_pos_emb and a naive loop."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from ninfer.ops.rope import apply_partial_rope, mrope_cos_sin

torch.set_num_threads(1)

# (head_dim, theta, mrope_section): the real Qwen3.6 setting, a small one, and an uneven one in which
# the H and W section limits cut different frequencies (so swapping them shows).
ROPE_CASES = [(256, 1e7, (11, 11, 10)), (64, 1e4, (3, 3, 2)), (64, 1e4, (4, 1, 3))]


def _hf_rotary(head_dim: int, theta: float, section: tuple[int, int, int]) -> hf.Qwen3_5TextRotaryEmbedding:
    config = Qwen3_5TextConfig(
        hidden_size=64,
        head_dim=head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": theta,
            "partial_rotary_factor": 0.25,
            "mrope_section": list(section),
            "mrope_interleaved": True,
        },
    )
    return hf.Qwen3_5TextRotaryEmbedding(config)


def _random_positions(n: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct T/H/W rows (as image tokens have), including large positions."""
    base = torch.randint(0, 200_000, (n,), generator=gen)
    return torch.stack([base, base + torch.randint(0, 50, (n,), generator=gen), base - 7 * torch.arange(n)])


@pytest.mark.parametrize(("head_dim", "theta", "section"), ROPE_CASES)
def test_mrope_cos_sin_matches_hf(head_dim: int, theta: float, section: tuple[int, int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    positions = _random_positions(37, gen)
    rotary_dim = head_dim // 4
    cos, sin = mrope_cos_sin(positions, rotary_dim, theta, section)
    assert cos.shape == sin.shape == (37, rotary_dim) and cos.dtype == torch.float32
    hf_cos, hf_sin = _hf_rotary(head_dim, theta, section)(
        torch.zeros(1, dtype=torch.float32), positions[:, None]
    )
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=0)


@pytest.mark.parametrize(("head_dim", "theta", "section"), ROPE_CASES)
def test_mrope_cos_sin_matches_naive_axis_rule(
    head_dim: int, theta: float, section: tuple[int, int, int]
) -> None:
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 500, (3, 9), generator=gen)  # small: float64 vs fp32 angles stay close
    rotary_dim = head_dim // 4
    half = rotary_dim // 2
    cos, sin = mrope_cos_sin(positions, rotary_dim, theta, section)
    for n in range(positions.shape[1]):
        for j in range(half):
            axis = (
                1 if (j % 3 == 1 and j < 3 * section[1]) else 2 if (j % 3 == 2 and j < 3 * section[2]) else 0
            )
            angle = positions[axis, n].item() * theta ** (-2 * j / rotary_dim)
            for col in (j, j + half):
                assert math.isclose(cos[n, col].item(), math.cos(angle), abs_tol=2e-4)
                assert math.isclose(sin[n, col].item(), math.sin(angle), abs_tol=2e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_partial_rope_matches_hf(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    head_dim, n_tokens, heads = 64, 13, 3
    positions = _random_positions(n_tokens, gen)
    cos, sin = mrope_cos_sin(positions, head_dim // 4, 1e7, (3, 3, 2))
    x = torch.randn(n_tokens, heads, head_dim, generator=gen).to(dtype)
    got = apply_partial_rope(x, cos, sin)
    assert got.dtype == dtype
    # HF layout [B, T, heads, D] with unsqueeze_dim=2; run HF in fp32 so both round once at the end.
    x32 = x.float()[None]
    expected, _ = hf.apply_rotary_pos_emb(x32, x32, cos[None], sin[None], unsqueeze_dim=2)
    torch.testing.assert_close(got.float(), expected[0].to(dtype).float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[..., head_dim // 4 :], x[..., head_dim // 4 :], rtol=0, atol=0)


def test_rope_scores_depend_only_on_relative_text_position() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 32, generator=gen)
    k = torch.randn(1, 2, 32, generator=gen)

    def score(pos_q: int, pos_k: int) -> torch.Tensor:
        cos_q, sin_q = mrope_cos_sin(torch.full((3, 1), pos_q), 16, 1e4, (3, 3, 2))
        cos_k, sin_k = mrope_cos_sin(torch.full((3, 1), pos_k), 16, 1e4, (3, 3, 2))
        return (apply_partial_rope(q, cos_q, sin_q) * apply_partial_rope(k, cos_k, sin_k)).sum(-1)

    torch.testing.assert_close(score(10, 3), score(107, 100), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(10, 3), score(10, 4), atol=1e-3)
