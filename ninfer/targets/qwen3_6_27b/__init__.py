"""Qwen3.6-27B: dense, 64 layers (48 GDN + 16 gated attention), 248,320-token vocabulary."""

from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.variant import DFlashDims, Variant, VisionDims

# z-lab/Qwen3.6-27B-DFlash (config.json fields as published: five Qwen3 layers, four of them causal
# sliding-window, taps spread over the target's layers 1..61, block 16). `ninfer convert --dflash`
# refuses a drafter checkpoint whose config differs in any field, naming it.
DFLASH = DFlashDims(
    num_layers=5,
    num_attention_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=17408,
    layer_types=("sliding_attention",) * 4 + ("full_attention",),
    target_layer_ids=(1, 16, 31, 46, 61),
    mask_token_id=248070,
    block_size=16,
    sliding_window=2048,
    rope_theta=1e7,
)

VARIANT = Variant(
    hidden_size=5120,
    num_layers=64,
    vocab_size=248320,
    num_attention_heads=24,
    num_kv_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    intermediate_size=17408,
    vision=VisionDims(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=5120),
)

PACKAGE = Package(name="qwen3_6_27b", variant=VARIANT, description="Qwen3.6-27B (dense)", drafter=DFLASH)
