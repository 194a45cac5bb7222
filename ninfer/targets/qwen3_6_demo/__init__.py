"""Bundled demo package: a ~11M-parameter Qwen3.6-family model trained on Python standard-library source.

The family architecture at toy width (tools/train_demo trains it): 8 layers in the 3:1 GDN / gated
attention pattern, the real head ratios (attention 6 q : 1 kv heads, GDN 1 key : 3 value heads, attention
and GDN value width 1.2x hidden, GDN key width 0.4x hidden), partial M-RoPE, zero-centred norms, a dense
SwiGLU MLP, one MTP layer and no vision tower. Its own 8,192-token byte-level BPE vocabulary ends with
the 33 Qwen3.6 special tokens in the Qwen order, so the special ids below differ from the real ones.
Embeddings are tied to the output head to keep the bf16 artifact under 24 MB.
"""

from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.variant import DFlashDims, SpecialTokens, Variant

# the 33 Qwen3.6 special tokens occupy ids 8159..8191, in tokenizer_config.json's added_tokens order
FIRST_SPECIAL_ID = 8159

SPECIAL = SpecialTokens(
    endoftext=FIRST_SPECIAL_ID + 0,  # <|endoftext|>
    im_start=FIRST_SPECIAL_ID + 1,  # <|im_start|>
    im_end=FIRST_SPECIAL_ID + 2,  # <|im_end|>
    vision_start=FIRST_SPECIAL_ID + 9,  # <|vision_start|>
    vision_end=FIRST_SPECIAL_ID + 10,  # <|vision_end|>
    image_pad=FIRST_SPECIAL_ID + 12,  # <|image_pad|>
    video_pad=FIRST_SPECIAL_ID + 13,  # <|video_pad|>
    think_open=FIRST_SPECIAL_ID + 24,  # <think>
    think_close=FIRST_SPECIAL_ID + 25,  # </think>
    eos=(FIRST_SPECIAL_ID + 2, FIRST_SPECIAL_ID + 0),  # <|im_end|>, <|endoftext|>
)

VARIANT = Variant(
    hidden_size=320,
    num_layers=8,
    vocab_size=8192,
    num_attention_heads=6,
    num_kv_heads=1,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    intermediate_size=512,
    mrope_section=(3, 3, 2),  # rotary_dim 16 = 0.25 * head_dim 64; sections cover rotary_dim / 2
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    mtp_num_hidden_layers=1,
    vision=None,
    special=SPECIAL,
)

# a two-layer DFlash drafter (tools/train_demo/dflash.py trains it; not in the bundled artifact)
DRAFTER = DFlashDims(
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=1,
    head_dim=64,
    intermediate_size=512,
    layer_types=("sliding_attention", "full_attention"),
    target_layer_ids=(1, 3, 5),
    mask_token_id=FIRST_SPECIAL_ID + 26,  # <|audio_start|>, the Qwen3.6 drafters' mask (248070)
    block_size=16,
    sliding_window=256,
)

PACKAGE = Package(
    name="qwen3_6_demo",
    variant=VARIANT,
    description="bundled demo model (~11M params, trained on Python stdlib source; tools/train_demo)",
    drafter=DRAFTER,
)
