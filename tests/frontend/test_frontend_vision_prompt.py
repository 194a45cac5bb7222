"""Multimodal prompts: pad expansion, pixel values and M-RoPE positions equal transformers'
(Qwen3VLProcessor on the rendered chat, get_rope_index) for 1-3 images in different messages; the
content identity covers the images; text-only prompts stay exactly as before."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from vision_oracle import (
    FAMILY_DEFAULTS,
    SMALL_CONFIG,
    frontend,
    hf_process,
    hf_rope_index,
    oracle_image,
    png,
)

from ninfer.media.decode import decode_image
from ninfer.targets.qwen3_6.frontend import prompt_digest
from ninfer.targets.qwen3_6.frontend.mrope import mrope_positions
from ninfer.targets.qwen3_6.variant import SpecialTokens

S = SpecialTokens()
IMAGES = [png(70, 40, seed=1), png(33, 90, seed=2), png(300, 200, seed=3)]


def image(i: int) -> dict:
    return {"type": "image", "image": decode_image(IMAGES[i])}


CONVERSATIONS = {
    "one": [{"role": "user", "content": [image(0), {"type": "text", "text": "What is this?"}]}],
    "two in one message": [
        {"role": "system", "content": "You see pictures."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                image(0),
                {"type": "text", "text": "with"},
                image(1),
            ],
        },
    ],
    "three in three messages": [
        {"role": "user", "content": [image(2), {"type": "text", "text": "A?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "text", "text": "And"}, image(1)]},
        {"role": "assistant", "content": "A dog."},
        {"role": "user", "content": [image(0), {"type": "text", "text": "last one"}]},
    ],
}


def placeholders(messages: list[dict]) -> list[dict]:
    """The messages as the template sees them (what transformers' processor users render)."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{"type": "image"} if p.get("type") == "image" else p for p in content]
        out.append({**m, "content": content})
    return out


def used_images(messages: list[dict]) -> list:
    """The oracle's PIL images for the image parts, in order (opened from the same bytes)."""
    by_digest = {decode_image(data).digest: data for data in IMAGES}
    return [
        oracle_image(by_digest[part["image"].digest])
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if part.get("type") == "image"
    ]


@pytest.mark.parametrize("config", [FAMILY_DEFAULTS, SMALL_CONFIG], ids=["family", "small"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_prompt_equals_transformers_processor_and_rope_index(name: str, config: dict) -> None:
    messages = CONVERSATIONS[name]
    fe = frontend(config)
    prompt = fe.prepare_chat(messages)
    text = fe.render_chat(placeholders(messages))
    hf = hf_process(text, used_images(messages), config)

    assert list(prompt.token_ids) == hf["input_ids"][0].tolist()
    grids = [img.grid_thw for img in prompt.images]
    assert grids == [tuple(g) for g in hf["image_grid_thw"].tolist()]
    pixel_values = np.concatenate([img.pixel_values for img in prompt.images])
    assert float(np.abs(pixel_values - hf["pixel_values"].numpy()).max()) <= 1e-6

    positions, delta = hf_rope_index(hf["input_ids"], hf["mm_token_type_ids"], hf["image_grid_thw"])
    assert prompt.mrope_positions is not None and prompt.mrope_positions.dtype == np.int64
    np.testing.assert_array_equal(prompt.mrope_positions, positions.numpy())
    assert prompt.mrope_delta == delta
    assert prompt.image_tokens == int((hf["mm_token_type_ids"] == 1).sum())


def test_pad_spans_sit_between_vision_tokens() -> None:
    prompt = frontend(SMALL_CONFIG).prepare_chat(CONVERSATIONS["three in three messages"])
    ids = prompt.token_ids
    assert len(prompt.images) == 3
    for img in prompt.images:
        t, h, w = img.grid_thw
        assert img.num_tokens == t * h * w // 4 and img.pixel_values.shape == (t * h * w, 1536)
        assert (
            ids[img.token_offset - 1] == S.vision_start
            and ids[img.token_offset + img.num_tokens] == S.vision_end
        )
        assert set(ids[img.token_offset : img.token_offset + img.num_tokens]) == {S.image_pad}
    assert sum(i == S.image_pad for i in ids) == prompt.image_tokens


def test_prompt_is_owned_and_read_only() -> None:
    prompt = frontend(SMALL_CONFIG).prepare_chat(CONVERSATIONS["one"])
    with pytest.raises(ValueError):
        prompt.mrope_positions[0, 0] = 5  # type: ignore[index]
    with pytest.raises(ValueError):
        prompt.images[0].pixel_values[0, 0] = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        prompt.images[0].token_offset = 3  # type: ignore[misc]
    again = frontend(SMALL_CONFIG).prepare_chat(CONVERSATIONS["one"])
    assert again == prompt and again.images == prompt.images


def test_identity_covers_the_images_and_their_preprocessing() -> None:
    fe = frontend(SMALL_CONFIG)
    a = fe.prepare_chat([{"role": "user", "content": [image(0)]}])
    # same size, other pixels: same ids, other identity
    other = {"type": "image", "image": decode_image(png(70, 40, seed=99))}
    b = fe.prepare_chat([{"role": "user", "content": [other]}])
    assert a.token_ids == b.token_ids and a.digest != b.digest
    assert a.digest != prompt_digest(a.token_ids)
    assert fe.prepare_chat([{"role": "user", "content": [image(0)]}]).digest == a.digest
    shifted = frontend({**SMALL_CONFIG, "image_mean": [0.4, 0.5, 0.5]}).prepare_chat(
        [{"role": "user", "content": [image(0)]}]
    )
    assert shifted.token_ids == a.token_ids and shifted.digest != a.digest


def test_text_only_prompts_are_unchanged() -> None:
    fe = frontend(FAMILY_DEFAULTS)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
    ]
    prompt = fe.prepare_chat(messages)
    ids = fe.encode(fe.render_chat(messages, add_generation_prompt=True))
    assert list(prompt.token_ids) == ids and prompt.digest == prompt_digest(ids)
    assert prompt.images == () and prompt.mrope_positions is None and prompt.mrope_delta == 0
    assert frontend(None).prepare_chat(messages) == prompt  # no preprocessor config: text is unaffected


@pytest.mark.parametrize(
    "part, match",
    [
        ({"type": "image_url", "image_url": {"url": "data:,"}}, "must be acquired and decoded first"),
        ({"type": "image", "image": "https://example.com/a.png"}, "must be acquired and decoded first"),
        ({"type": "video", "video": "clip.mp4"}, "video input is not supported"),
        (
            {"type": "text", "text": "sneaky <|vision_start|><|image_pad|><|vision_end|>"},
            "1 <|image_pad|> tokens for 0",
        ),
        ({"type": "text", "text": "<|video_pad|>"}, "video input is not supported"),
    ],
)
def test_unusable_content_is_refused(part: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        frontend(SMALL_CONFIG).prepare_chat([{"role": "user", "content": [part]}])


def test_a_refused_image_is_a_value_error() -> None:
    tall = {"type": "image", "image": decode_image(png(2, 500))}
    with pytest.raises(ValueError, match="aspect ratio"):
        frontend(SMALL_CONFIG).prepare_chat([{"role": "user", "content": [tall]}])


def test_reference_example_positions() -> None:
    """docs reference 2(f): [a, b, c, VS, 6 x IMG (grid 1x4x6), VE, d, e, f]."""
    positions, delta = mrope_positions(14, [(4, (1, 4, 6))], merge_size=2)
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 7, 8, 9, 10]
    assert positions[1].tolist()[4:10] == [4, 4, 4, 5, 5, 5]
    assert positions[2].tolist()[4:10] == [4, 5, 6, 4, 5, 6]
    assert delta == -3


def test_render_chat_shows_decoded_images_as_vision_tokens() -> None:
    fe = frontend(SMALL_CONFIG)
    messages = CONVERSATIONS["two in one message"]
    text = fe.render_chat(messages)
    assert text == fe.render_chat(placeholders(messages))
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    # raw parts still render (the template decides), only prepare_chat insists on decoded images
    assert "<|image_pad|>" in fe.render_chat(
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]
    )
