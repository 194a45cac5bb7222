"""The vision tower equals transformers' Qwen3_5(Moe)VisionModel, and the whole multimodal path (Frontend
prompt, tower, splice at the pads, M-RoPE prefill, decode at cache_len + delta) equals
Qwen3_5(Moe)ForConditionalGeneration: image features, positions, logits (fp32, rel <= 1e-4) and greedy
tokens, on the tiny dense and MoE packages with random weights (norms and biases randomised)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from qwen3_6_model_harness import TINY_PACKAGES, rel_err, tiny_view
from vision_model_oracle import (
    check_against_transformers,
    hf_inputs,
    hf_vision_model,
    hf_vlm,
    prefill_batch,
    tower,
)
from vision_oracle import FAMILY_DEFAULTS, SMALL_CONFIG, frontend, png

from ninfer.media.decode import decode_image
from ninfer.targets.qwen3_6.frontend.types import PreparedPrompt
from ninfer.targets.qwen3_6.model import StateStore, forward
from ninfer.targets.qwen3_6.vision import check_grids, image_pad_rows, vision_embeddings, vision_tokens

torch.set_num_threads(1)
TOLERANCE = 1e-4
GRIDS = [(1, 4, 6), (1, 16, 16), (1, 2, 28), (2, 4, 4), (1, 4, 6)]  # equal sizes, a 2-frame grid, repeats


def pixel_values(grids: list[tuple[int, int, int]], seed: int = 0) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("package_name", TINY_PACKAGES)
@pytest.mark.parametrize("grids", [GRIDS[:1], GRIDS], ids=["one image", "mixed sizes"])
def test_tower_matches_transformers(package_name: str, grids: list[tuple[int, int, int]]) -> None:
    view = tiny_view(package_name)
    assert view.vision is not None and view.variant.vision is not None
    # the weights really are random where a zero or one init would hide a bug
    block = view.vision.blocks[0]
    assert block.norm1_bias.abs().min() > 0 and (block.norm1_weight - 1).abs().max() > 0.1
    pv = pixel_values(grids)
    with torch.no_grad():
        expected = hf_vision_model(package_name)(pv, grid_thw=torch.tensor(grids)).pooler_output
        ours = vision_embeddings(view.vision, view.variant.vision, pv, grids)
    assert ours.shape == (vision_tokens(grids, view.variant.vision), view.variant.vision.out_hidden_size)
    err = rel_err(ours, expected)
    print(f"{package_name} {len(grids)} grids: tower rel err {err:.2e}")
    assert err <= 1e-5


def test_images_are_independent() -> None:
    """Attention stays inside each image's frames: one image's rows do not depend on another's."""
    view = tiny_view("qwen3_6_tiny")
    assert view.vision is not None and view.variant.vision is not None
    pv = pixel_values(GRIDS)
    alone = vision_embeddings(view.vision, view.variant.vision, pv[:24], GRIDS[:1])
    together = vision_embeddings(view.vision, view.variant.vision, pv, GRIDS)
    assert rel_err(together[:6], alone) <= 1e-6


def test_bad_inputs_are_refused() -> None:
    dims = tiny_view("qwen3_6_tiny").variant.vision
    assert dims is not None
    with pytest.raises(ValueError, match=r"pixel_values is \(10, 1536\), the grids need \(24, 1536\)"):
        check_grids(torch.zeros(10, 1536), [(1, 4, 6)], dims)
    with pytest.raises(ValueError, match="multiples of the merge size 2"):
        check_grids(torch.zeros(15, 1536), [(1, 3, 5)], dims)
    assert image_pad_rows([(3, 2), (10, 3)]).tolist() == [3, 4, 10, 11, 12]


def _images_prompt(config: dict, count: int) -> PreparedPrompt:
    sizes = [(70, 40), (33, 90), (300, 200)]
    parts = [{"type": "image", "image": decode_image(png(*sizes[i], seed=i))} for i in range(count)]
    messages: list[dict] = [{"role": "system", "content": "Describe images."}]
    for i, part in enumerate(parts):
        messages.append({"role": "user", "content": [{"type": "text", "text": f"Picture {i}?"}, part]})
        if i < count - 1:
            messages.append({"role": "assistant", "content": f"Answer {i}."})
    return frontend(config).prepare_chat(messages)


@pytest.mark.parametrize("package_name", TINY_PACKAGES)
@pytest.mark.parametrize("count", [1, 2, 3])
def test_multimodal_prompt_matches_transformers(package_name: str, count: int) -> None:
    """Small images (SMALL_CONFIG: 2-6 tokens each) keep the [L, 248320] logits small."""
    result = check_against_transformers(package_name, _images_prompt(SMALL_CONFIG, count), steps=6)
    print(package_name, count, {k: v for k, v in result.items() if "err" in k})
    assert result["positions_equal"] and result["delta_equal"]
    assert result["feature_err"] <= 1e-5
    assert result["logits_err"] <= TOLERANCE
    assert result["ours_tokens"] == result["hf_tokens"]


@pytest.mark.parametrize("package_name", TINY_PACKAGES)
def test_family_sized_images_match_transformers(package_name: str) -> None:
    """The real preprocessor config (at least 256 x 256 pixels per image): features and positions."""
    result = check_against_transformers(package_name, _images_prompt(FAMILY_DEFAULTS, 3))
    assert result["positions_equal"] and result["delta_equal"]
    assert result["feature_err"] <= 1e-5


def test_negative_control_wrong_splice_is_caught() -> None:
    """Embeddings placed one row late change the logits far beyond the tolerance."""
    view = tiny_view("qwen3_6_tiny")
    prompt = _images_prompt(SMALL_CONFIG, 1)
    shifted = dataclasses.replace(
        prompt,
        images=tuple(dataclasses.replace(img, token_offset=img.token_offset + 1) for img in prompt.images),
    )
    store = StateStore.allocate(view.variant, 2, 8, 16, torch.float32, "cpu")
    with torch.no_grad():
        out = forward(
            view, view.variant, prefill_batch(view, shifted, list(range(1, 8))), store, logits="all"
        )
        hf = hf_vlm("qwen3_6_tiny")
        hf.model.rope_deltas = None
        expected = hf(**hf_inputs(prompt, view.variant.special.image_pad), use_cache=False).logits[0]
    assert out.logits is not None and rel_err(out.logits, expected) > 100 * TOLERANCE
    assert tower(view, prompt).shape[0] == prompt.images[0].num_tokens
