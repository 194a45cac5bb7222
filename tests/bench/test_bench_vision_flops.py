"""The vision tower's FLOP count against a hand count for a tiny config, and the 27B tower's at 1024^2."""

from __future__ import annotations

import pytest

from ninfer.bench.roofline import vision_flops
from ninfer.targets.qwen3_6.variant import VisionDims
from ninfer.targets.registry import get_package

# depth 2, hidden 32 (2 heads), MLP 64, out 64, patch 16, temporal 2, merge 2, 3 channels
TINY = VisionDims(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)


def test_tiny_tower_flops_equal_the_hand_count() -> None:
    # one 4 x 4-patch frame: 16 patches of 3 * 2 * 16 * 16 = 1536 values, 4 merge blocks of 128
    got = vision_flops(TINY, [(1, 4, 4)])
    assert got.patches == 16
    assert got.patch_embed == 2 * 16 * 1536 * 32 == 1_572_864
    assert got.qkv == 2 * (2 * 16 * 32 * 96) == 196_608  # two blocks
    assert got.proj == 2 * (2 * 16 * 32 * 32) == 65_536
    assert got.attention == 2 * (4 * 32 * 16 * 16) == 65_536  # QK^T + PV over 16 x 16 patch pairs
    assert got.mlp == 2 * (2 * 16 * 32 * 64 * 2) == 262_144
    assert got.merger == 2 * 4 * 128 * 128 + 2 * 4 * 128 * 64 == 196_608
    assert got.total == 1_572_864 + 196_608 + 65_536 + 65_536 + 262_144 + 196_608 == 2_359_296


def test_attention_is_per_frame_and_images_add_up() -> None:
    one = vision_flops(TINY, [(1, 4, 4)])
    two_frames = vision_flops(TINY, [(2, 4, 4)])  # attention within each frame: twice, not four times
    assert two_frames.attention == 2 * one.attention
    assert two_frames.total == 2 * one.total
    wide = vision_flops(TINY, [(1, 4, 8)])  # 32 patches in one frame: attention 4x, the rest 2x
    assert wide.attention == 4 * one.attention
    assert wide.total - wide.attention == 2 * (one.total - one.attention)
    both = vision_flops(TINY, [(1, 4, 4), (1, 4, 8)])
    assert both.total == one.total + wide.total and both.patches == 48
    with pytest.raises(ValueError):
        vision_flops(TINY, [(1, 3, 3)])


def test_27b_tower_at_1024_squared() -> None:
    dims = get_package("qwen3_6_27b").variant.vision
    assert dims is not None
    n, c = 64 * 64, 1152  # a 1024 x 1024 image: 64 x 64 patches of 16 pixels, 1,024 image tokens
    linear_per_patch = 2 * 1536 * c + 27 * (2 * c * 3 * c + 2 * c * c + 4 * c * 4304)
    merger_per_block = 2 * (4 * c) ** 2 + 2 * 4 * c * 5120
    expected = n * linear_per_patch + 27 * 4 * c * n * n + n // 4 * merger_per_block
    got = vision_flops(dims, [(1, 64, 64)])
    assert got.total == expected
    assert 5.5e12 < got.total < 5.6e12  # 3.4 TFLOP in the linear layers, 2.1 in attention over 4,096 patches
