"""Reference gated GQA attention vs torch SDPA, transformers' Qwen3_5Attention, and paged == dense."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from ninfer.ops.attention import (
    causal_attention,
    gated_attention_output,
    kv_write,
    paged_attention,
    split_q_gate,
)
from ninfer.ops.norm import rms_norm
from ninfer.ops.rope import apply_partial_rope, mrope_cos_sin

torch.set_num_threads(1)
N_HEADS, N_KV, HEAD_DIM = 6, 2, 16
SCALE = HEAD_DIM**-0.5


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch's own causal GQA attention on [N, heads, D] tensors."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=SCALE, enable_gqa=True
    )
    return out.transpose(0, 1)


def _qkv(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.randn(n, N_HEADS, HEAD_DIM, generator=gen),
        torch.randn(n, N_KV, HEAD_DIM, generator=gen),
        torch.randn(n, N_KV, HEAD_DIM, generator=gen),
    )


def test_causal_attention_matches_sdpa_and_naive_gqa_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(19, gen)
    got = causal_attention(q, k, v, SCALE)
    torch.testing.assert_close(got, _sdpa(q, k, v), rtol=1e-5, atol=1e-6)
    group = N_HEADS // N_KV
    for i in (0, 7, 18):
        for h in range(N_HEADS):
            scores = (k[: i + 1, h // group] @ q[i, h]) * SCALE
            expected = torch.softmax(scores.double(), 0) @ v[: i + 1, h // group].double()
            torch.testing.assert_close(got[i, h].double(), expected, rtol=1e-5, atol=1e-6)


def test_causal_attention_bf16_close_to_fp32() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(12, gen)
    got = causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), SCALE)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), causal_attention(q, k, v, SCALE), rtol=2e-2, atol=2e-2)


def test_causal_attention_gradients_match_sdpa() -> None:
    gen = torch.Generator().manual_seed(2)
    inputs = _qkv(9, gen)
    upstream = torch.randn(9, N_HEADS, HEAD_DIM, generator=gen)

    def grads(fn) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        (fn(*leaves) * upstream).sum().backward()
        return [leaf.grad for leaf in leaves]

    for ours, theirs in zip(
        grads(lambda q, k, v: causal_attention(q, k, v, SCALE)), grads(_sdpa), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_split_q_gate_is_interleaved_per_head() -> None:
    n_tokens = 3
    q_proj_out = torch.arange(n_tokens * N_HEADS * 2 * HEAD_DIM, dtype=torch.float32).view(n_tokens, -1)
    q, gate = split_q_gate(q_proj_out, N_HEADS, HEAD_DIM)
    assert q.shape == (n_tokens, N_HEADS, HEAD_DIM) and gate.shape == (n_tokens, N_HEADS * HEAD_DIM)
    for h in range(N_HEADS):
        start = h * 2 * HEAD_DIM
        assert torch.equal(q[:, h], q_proj_out[:, start : start + HEAD_DIM])
        assert torch.equal(
            gate[:, h * HEAD_DIM : (h + 1) * HEAD_DIM], q_proj_out[:, start + HEAD_DIM : start + 2 * HEAD_DIM]
        )


def test_attention_layer_composed_from_ops_matches_hf_module() -> None:
    """split -> q/k norm -> partial M-RoPE -> causal GQA -> output gate -> o_proj == HF Qwen3_5Attention."""
    torch.manual_seed(3)
    hidden, head_dim, n_tokens = 48, 32, 11
    config = Qwen3_5TextConfig(
        hidden_size=hidden,
        head_dim=head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    )
    config._attn_implementation = "eager"
    module = hf.Qwen3_5Attention(config, layer_idx=3).eval()
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0, 0.3)  # includes the (zero-initialised) q/k norm weights
    x = torch.randn(1, n_tokens, hidden)
    positions = torch.stack([torch.arange(n_tokens), torch.arange(n_tokens) * 2, torch.arange(n_tokens) + 5])
    cos, sin = hf.Qwen3_5TextRotaryEmbedding(config)(x, positions[:, None])
    mask = torch.full((n_tokens, n_tokens), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = module(x, (cos, sin), mask)

        q, gate = split_q_gate(F.linear(x[0], module.q_proj.weight), 4, head_dim)
        k = F.linear(x[0], module.k_proj.weight).view(n_tokens, 2, head_dim)
        v = F.linear(x[0], module.v_proj.weight).view(n_tokens, 2, head_dim)
        q, k = rms_norm(q, module.q_norm.weight, 1e-6), rms_norm(k, module.k_norm.weight, 1e-6)
        our_cos, our_sin = mrope_cos_sin(positions, head_dim // 4, 1e7, (2, 1, 1))
        q, k = apply_partial_rope(q, our_cos, our_sin), apply_partial_rope(k, our_cos, our_sin)
        attn = causal_attention(q, k, v, head_dim**-0.5)
        got = F.linear(gated_attention_output(attn, gate), module.o_proj.weight)
    torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-5)


def test_gated_attention_output_formula() -> None:
    gen = torch.Generator().manual_seed(4)
    o, gate = (
        torch.randn(5, N_HEADS, HEAD_DIM, generator=gen),
        torch.randn(5, N_HEADS * HEAD_DIM, generator=gen),
    )
    expected = o.reshape(5, -1).double() / (1 + torch.exp(-gate.double()))
    torch.testing.assert_close(gated_attention_output(o, gate).double(), expected, rtol=1e-6, atol=1e-7)


def test_kv_write_places_tokens_in_their_slots() -> None:
    page_size, n_pages = 3, 4
    k_pages = torch.zeros(n_pages, page_size, N_KV, HEAD_DIM)
    v_pages = torch.zeros_like(k_pages)
    k, v = torch.randn(5, N_KV, HEAD_DIM), torch.randn(5, N_KV, HEAD_DIM)
    slots = torch.tensor([11, 0, 4, 5, 6])
    kv_write(k_pages, v_pages, k, v, slots)
    for n, slot in enumerate(slots.tolist()):
        assert torch.equal(k_pages[slot // page_size, slot % page_size], k[n])
        assert torch.equal(v_pages[slot // page_size, slot % page_size], v[n])
    assert int((k_pages.abs().sum((-1, -2)) > 0).sum()) == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_equals_dense_causal_per_row(dtype: torch.dtype) -> None:
    """Rows of different lengths and query counts (prefill, decode, chunked prefill, verify) over shuffled
    pages of a size that divides none of the context lengths."""
    gen = torch.Generator().manual_seed(5)
    page_size, n_pages_total = 5, 24
    context_lens = [13, 1, 22, 9, 17]
    query_counts = [13, 1, 6, 1, 4]
    sequences = [_qkv(n, gen) for n in context_lens]
    sequences = [tuple(t.to(dtype) for t in seq) for seq in sequences]
    k_pages = torch.zeros(n_pages_total, page_size, N_KV, HEAD_DIM, dtype=dtype)
    v_pages = torch.zeros_like(k_pages)
    free_pages = torch.randperm(n_pages_total, generator=gen).tolist()
    max_pages = max(-(-n // page_size) for n in context_lens)
    block_table = torch.full((len(context_lens), max_pages + 1), -1, dtype=torch.int32)  # unused tail = -1
    queries, query_start = [], [0]
    for row, (n, (q, k, v)) in enumerate(zip(context_lens, sequences, strict=True)):
        pages = [free_pages.pop() for _ in range(-(-n // page_size))]
        block_table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        positions = torch.arange(n)
        slots = torch.tensor(pages)[positions // page_size] * page_size + positions % page_size
        kv_write(k_pages, v_pages, k, v, slots)
        queries.append(q[n - query_counts[row] :])
        query_start.append(query_start[-1] + query_counts[row])
    got = paged_attention(
        torch.cat(queries),
        k_pages,
        v_pages,
        block_table,
        torch.tensor(query_start, dtype=torch.int32),
        torch.tensor(context_lens, dtype=torch.int32),
        SCALE,
    )
    assert got.dtype == dtype
    for row, (q, k, v) in enumerate(sequences):
        expected = causal_attention(q, k, v, SCALE)[context_lens[row] - query_counts[row] :]
        torch.testing.assert_close(
            got[query_start[row] : query_start[row + 1]], expected, rtol=1e-5, atol=1e-6
        )
