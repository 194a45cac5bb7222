"""Reference causal conv1d vs transformers' causal_conv1d_fn / causal_conv1d_update and a naive loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from ninfer.ops.conv import causal_conv1d, causal_conv1d_update

torch.set_num_threads(1)
K = 4


def _naive_conv(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """y[t, c] = silu(sum_i w[c, i] * padded[t + i, c]) with padded = history ++ x, in float64."""
    padded = torch.cat((history.t().double(), x.double()), dim=0)  # [K-1+T, C]
    kernel = weight.shape[1]
    rows = [
        F.silu(sum(weight[:, i].double() * padded[t + i] for i in range(kernel))) for t in range(x.shape[0])
    ]
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1], dtype=torch.float64)


def test_causal_conv1d_matches_hf_without_state() -> None:
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(21, 10, generator=gen), torch.randn(10, K, generator=gen)
    y, final_state = causal_conv1d(x, weight, None)
    expected = hf.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(final_state, x[-(K - 1) :].t(), rtol=0, atol=0)


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 17])  # 1 and 2 are shorter than K-1
def test_causal_conv1d_with_initial_state_matches_naive(num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    x, weight = torch.randn(num_tokens, 6, generator=gen), torch.randn(6, K, generator=gen)
    initial_state = torch.randn(6, K - 1, generator=gen)
    state_before = initial_state.clone()
    y, final_state = causal_conv1d(x, weight, initial_state)
    torch.testing.assert_close(y.double(), _naive_conv(x, weight, initial_state), rtol=1e-5, atol=1e-6)
    expected_state = torch.cat((initial_state, x.t()), dim=1)[:, -(K - 1) :]
    torch.testing.assert_close(final_state, expected_state, rtol=0, atol=0)
    assert torch.equal(initial_state, state_before)


def test_causal_conv1d_update_matches_hf_and_is_pure() -> None:
    gen = torch.Generator().manual_seed(5)
    batch, channels = 3, 9  # B not a power of two
    x, weight = torch.randn(batch, channels, generator=gen), torch.randn(channels, K, generator=gen)
    state = torch.randn(batch, channels, K - 1, generator=gen)
    state_before = state.clone()
    y, new_state = causal_conv1d_update(x, state, weight)
    hf_state = state.clone()  # HF rolls its state in place
    expected = hf.causal_conv1d_update(x[..., None], hf_state, weight, None, "silu")[..., 0]
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_state, hf_state, rtol=0, atol=0)
    assert torch.equal(state, state_before)


@pytest.mark.parametrize("prefill_len", [2, 7])
def test_prefill_then_updates_equals_full_conv(prefill_len: int) -> None:
    gen = torch.Generator().manual_seed(10 + prefill_len)
    x, weight = torch.randn(12, 5, generator=gen), torch.randn(5, K, generator=gen)
    full_y, full_state = causal_conv1d(x, weight)
    y_prefill, state = causal_conv1d(x[:prefill_len], weight)
    outputs = [y_prefill]
    batched_state = state[None]
    for t in range(prefill_len, x.shape[0]):
        y_t, batched_state = causal_conv1d_update(x[t][None], batched_state, weight)
        outputs.append(y_t)
    torch.testing.assert_close(torch.cat(outputs), full_y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batched_state[0], full_state, rtol=0, atol=0)


def test_causal_conv1d_bf16_keeps_model_dtype_state() -> None:
    gen = torch.Generator().manual_seed(7)
    x, weight = torch.randn(9, 8, generator=gen).bfloat16(), torch.randn(8, K, generator=gen).bfloat16()
    y, state = causal_conv1d(x, weight)
    assert y.dtype == state.dtype == torch.bfloat16
    reference = _naive_conv(x.float(), weight.float(), torch.zeros(8, K - 1))
    torch.testing.assert_close(y.double(), reference, rtol=2e-2, atol=2e-2)
