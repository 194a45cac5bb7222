"""Tiny dense test package: the real 3:1 layer pattern, head ratios (24:4 attention, 16:48 GDN),
partial M-RoPE, MTP and vision weights, and the real 248,320-token vocabulary, at toy width."""

from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.variant import DFlashDims, Variant, VisionDims

VARIANT = Variant(
    hidden_size=64,
    num_layers=8,
    vocab_size=248320,
    num_attention_heads=6,
    num_kv_heads=1,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    intermediate_size=128,
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

# a two-layer drafter (one sliding-window layer of 16 positions, one full), block 16
DRAFTER = DFlashDims(
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=96,
    layer_types=("sliding_attention", "full_attention"),
    target_layer_ids=(1, 5),
    mask_token_id=248070,
    block_size=16,
    sliding_window=16,
)

PACKAGE = Package(
    name="qwen3_6_tiny",
    variant=VARIANT,
    description="tiny dense test package",
    test_only=True,
    drafter=DRAFTER,
)
