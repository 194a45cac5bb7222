"""The roofline counts against hand computations from the published dims (not from the weight schema).

Qwen3.6-27B at B=1, context 2048, bf16: the text model is 26,895,998,464 parameters (the 27.78B of the
full checkpoint also holds 0.42B MTP and 0.46B vision parameters, which a plain decode step never
reads); a step reads all of them in bf16 except the GDN decay vectors (fp32) and all embedding rows but
one, plus 144 MiB of fp32 recurrent state and the conv state, plus 64 KiB of K/V per position.
"""

from __future__ import annotations

import math

import pytest
import torch

from ninfer.bench.roofline import (
    active_matrix_params,
    decode_step_bytes,
    kv_bytes_per_position,
    moe_experts_read,
    prefill_flops,
    state_bytes_per_sequence,
)
from ninfer.targets.qwen3_6.weights import weight_schema
from ninfer.targets.registry import get_package

MiB = 1 << 20
BF16 = torch.bfloat16

# Qwen3.6-27B, from its config.json
H, V, INTER = 5120, 248320, 17408
N_ATTN, N_GDN = 16, 48
Q_HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256
K_HEADS, V_HEADS, DK, DV, CONV_K = 16, 48, 128, 128, 4
KEY_DIM, VALUE_DIM = K_HEADS * DK, V_HEADS * DV
CONV_DIM = 2 * KEY_DIM + VALUE_DIM

ATTN_MATRICES = (2 * Q_HEADS * HEAD_DIM) * H + 2 * (KV_HEADS * HEAD_DIM) * H + H * (Q_HEADS * HEAD_DIM)
GDN_MATRICES = CONV_DIM * H + VALUE_DIM * H + 2 * V_HEADS * H + H * VALUE_DIM + CONV_DIM * CONV_K
MLP_MATRICES = 3 * INTER * H
ATTN_VECTORS = 2 * HEAD_DIM  # q_norm, k_norm
GDN_VECTORS_BF16 = DV  # gated norm
GDN_VECTORS_FP32 = 2 * V_HEADS  # dt_bias, A_log
LAYER_NORMS = 2 * H
FINAL_NORM = H


def test_27b_text_parameter_count_is_the_published_one() -> None:
    text = (
        N_ATTN * (ATTN_MATRICES + ATTN_VECTORS)
        + N_GDN * (GDN_MATRICES + GDN_VECTORS_BF16 + GDN_VECTORS_FP32)
        + 64 * (MLP_MATRICES + LAYER_NORMS)
        + FINAL_NORM
        + 2 * V * H  # embedding and untied output head
    )
    assert text == 26_895_998_464


def test_27b_decode_bytes_b1_context_2048_equal_the_hand_computation() -> None:
    bf16_params = (
        N_ATTN * (ATTN_MATRICES + ATTN_VECTORS)
        + N_GDN * (GDN_MATRICES + GDN_VECTORS_BF16)
        + 64 * (MLP_MATRICES + LAYER_NORMS)
        + FINAL_NORM
        + V * H  # output head, in full
        + 1 * H  # the one embedding row the step's token selects
    )
    weights = 2 * bf16_params + 4 * N_GDN * GDN_VECTORS_FP32
    recurrent = N_GDN * V_HEADS * DK * DV * 4
    conv = N_GDN * CONV_DIM * (CONV_K - 1) * 2
    kv = 2048 * N_ATTN * 2 * KV_HEADS * HEAD_DIM * 2
    assert recurrent == 144 * MiB
    assert kv == 2048 * 64 * 1024  # 64 KiB per position

    got = decode_step_bytes(get_package("qwen3_6_27b").variant, 1, 2048, BF16)
    assert got.weights + got.embedding_rows == weights == 51_249_219_584
    assert got.embedding_rows == H * 2
    assert got.state == recurrent + conv
    assert got.kv == kv
    assert got.total == weights + recurrent + conv + kv
    assert got.experts_per_layer == 0
    # the 27.78B checkpoint parameters minus the text model: MTP + vision, resident but not read
    assert got.not_read == 2 * (27_781_427_952 - 26_895_998_464)


def test_27b_decode_bytes_scale_with_batch_and_context_only_in_state_embedding_and_kv() -> None:
    variant = get_package("qwen3_6_27b").variant
    one = decode_step_bytes(variant, 1, 2048, BF16)
    eight = decode_step_bytes(variant, 8, 2048, BF16)
    assert eight.weights == one.weights
    assert eight.embedding_rows == 8 * one.embedding_rows
    assert eight.state == 8 * one.state
    assert eight.kv == 8 * one.kv
    longer = decode_step_bytes(variant, 1, 4096, BF16)
    assert longer.total - one.total == 2048 * kv_bytes_per_position(variant, BF16)
    # fp32 compute: every non-pinned weight, the conv state and KV double; the recurrent state does not
    fp32 = decode_step_bytes(variant, 1, 2048, torch.float32)
    assert fp32.kv == 2 * one.kv
    assert fp32.state - one.state == N_GDN * CONV_DIM * (CONV_K - 1) * 2


def test_moe_expert_count_rule() -> None:
    assert moe_experts_read(256, 8, 1) == 8
    assert moe_experts_read(256, 8, 8) == 64
    assert moe_experts_read(256, 8, 32) == 256
    assert moe_experts_read(256, 8, 33) == 256  # never more experts than the layer has
    assert moe_experts_read(4, 2, 3) == 4
    with pytest.raises(ValueError):
        moe_experts_read(256, 8, 0)


def test_moe_decode_bytes_count_only_the_routed_experts_read() -> None:
    variant = get_package("qwen3_6_35b_a3b").variant
    layers, experts, inter, hidden = 40, 256, 512, 2048  # Qwen3.6-35B-A3B's config.json
    expert_bytes = (2 * inter * hidden + hidden * inter) * 2  # gate_up + down of one expert, bf16
    one = decode_step_bytes(variant, 1, 0, BF16)
    two = decode_step_bytes(variant, 2, 0, BF16)
    assert (one.experts_per_layer, two.experts_per_layer) == (8, 16)
    assert two.weights - one.weights == layers * 8 * expert_bytes
    assert two.total - one.total == layers * 8 * expert_bytes + hidden * 2 + one.state
    # saturated: at 32 tokens x top-8 every expert is read, one more token adds no expert bytes
    full = decode_step_bytes(variant, 32, 0, BF16)
    more = decode_step_bytes(variant, 33, 0, BF16)
    assert full.experts_per_layer == more.experts_per_layer == experts
    assert more.weights == full.weights
    assert full.weights - one.weights == layers * (experts - 8) * expert_bytes
    # the 35B-A3B floor at B=1 is ~6 GB (peers.md: "~2.9 B active, 5.9 GB/step at c1")
    assert 5.5e9 < one.total < 6.5e9


def test_demo_tied_head_is_read_in_full_and_embedding_rows_apart() -> None:
    variant = get_package("qwen3_6_demo").variant
    assert variant.tie_word_embeddings
    fp32 = torch.float32
    got = decode_step_bytes(variant, 2, 64, fp32)
    text_params = 10_120_712  # the demo text model (its embedding is its output head)
    assert got.weights == 4 * text_params
    assert got.embedding_rows == 2 * variant.hidden_size * 4
    n_gdn, n_attn = 6, 2
    state = n_gdn * (6 * 64 * 64 * 4 + variant.conv_dim * 3 * 4)
    assert state_bytes_per_sequence(variant, fp32) == state
    assert got.state == 2 * state
    assert got.kv == 2 * 64 * n_attn * 2 * 1 * 64 * 4


def test_27b_prefill_flops_equal_the_hand_computation() -> None:
    tokens = 8192
    matrices = N_ATTN * ATTN_MATRICES + N_GDN * GDN_MATRICES + 64 * MLP_MATRICES
    assert active_matrix_params(get_package("qwen3_6_27b").variant) == matrices
    linear = 2 * matrices * tokens + 2 * V * H  # output head for the last position only
    attention = N_ATTN * 2 * 2 * Q_HEADS * HEAD_DIM * (tokens * (tokens + 1) // 2)
    recurrence = N_GDN * 6 * V_HEADS * DK * DV * tokens
    got = prefill_flops(get_package("qwen3_6_27b").variant, tokens)
    assert (got.linear, got.attention, got.recurrence) == (linear, attention, recurrence)
    assert got.total == linear + attention + recurrence
    assert math.isclose(got.total, 414.05e12, rel_tol=1e-3)


def test_moe_prefill_counts_top_k_of_the_experts() -> None:
    variant = get_package("qwen3_6_35b_a3b").variant
    dense_part = active_matrix_params(variant)
    per_expert = 3 * variant.moe_intermediate_size * variant.hidden_size
    routed_all = variant.num_layers * variant.num_experts * per_expert
    routed_active = variant.num_layers * variant.num_experts_per_tok * per_expert
    text_matrices = sum(
        math.prod(s.shape)
        for s in weight_schema(variant)
        if s.group == "text" and len(s.shape) >= 2 and s.name not in ("embed_tokens.weight", "lm_head.weight")
    )
    assert dense_part == text_matrices - routed_all + routed_active
    assert 2.0e9 < dense_part < 3.5e9  # "A3B": about 3B active parameters per token
