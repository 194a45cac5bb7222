"""Qwen3.6-35B-A3B: MoE (256 experts, top-8, width 512, shared expert), 40 layers (30 GDN + 10 attn)."""

from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.variant import Variant, VisionDims

VARIANT = Variant(
    hidden_size=2048,
    num_layers=40,
    vocab_size=248320,
    num_attention_heads=16,
    num_kv_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    moe=True,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    vision=VisionDims(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=2048),
)

PACKAGE = Package(
    name="qwen3_6_35b_a3b", variant=VARIANT, description="Qwen3.6-35B-A3B (MoE)", hf_model_type="qwen3_5_moe"
)
