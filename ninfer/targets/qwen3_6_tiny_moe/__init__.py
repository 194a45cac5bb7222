"""Tiny MoE test package: the real 3:1 pattern, head ratios (16:2 attention, 16:32 GDN), partial
M-RoPE, 8 experts top-2 with a shared expert, MTP and vision weights, real 248,320-token vocabulary."""

import dataclasses

from ninfer.targets import qwen3_6_tiny
from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.variant import Variant, VisionDims

VARIANT = Variant(
    hidden_size=64,
    num_layers=4,
    vocab_size=248320,
    num_attention_heads=8,
    num_kv_heads=1,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    moe=True,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    mrope_section=(2, 1, 1),
    max_position_embeddings=16384,
    vision=VisionDims(
        depth=2,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=64,
        num_position_embeddings=16,
    ),
)

# the tiny dense package's drafter, its taps on this package's four layers
DRAFTER = dataclasses.replace(qwen3_6_tiny.DRAFTER, target_layer_ids=(1, 3))

PACKAGE = Package(
    name="qwen3_6_tiny_moe",
    variant=VARIANT,
    description="tiny MoE test package",
    hf_model_type="qwen3_5_moe",
    test_only=True,
    drafter=DRAFTER,
)
