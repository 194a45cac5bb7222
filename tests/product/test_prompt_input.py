"""OpenAI content parts -> the Frontend's message shape: images acquired and decoded, text kept, every
refusal a MediaError naming the message and part; the caller's messages untouched."""

from __future__ import annotations

import base64
import copy
from pathlib import Path

import numpy as np
import pytest
from vision_oracle import png

from ninfer.media import MediaError
from ninfer.media.decode import DecodedImage, DecodeLimits, MediaDecodeError
from ninfer.product.media_acquire import MediaAcquisitionError, MediaPolicy
from ninfer.product.prompt_input import PromptInputError, acquire_message_media, image_part

A, B = png(20, 10, seed=1), png(12, 30, seed=2)


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_parts_are_converted_in_order_and_input_untouched() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": url(A), "detail": "high"}},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": url(B)},  # the plain-string form
            ],
        },
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url(A)}}]},
    ]
    before = copy.deepcopy(messages)
    out = acquire_message_media(messages, MediaPolicy())
    assert messages == before
    assert out[0] == messages[0] and out[2] == messages[2]
    parts = out[1]["content"]
    assert [p["type"] for p in parts] == ["text", "image", "text", "image"]
    assert isinstance(parts[1]["image"], DecodedImage) and (
        parts[1]["image"].width,
        parts[1]["image"].height,
    ) == (20, 10)
    assert (parts[3]["image"].width, parts[3]["image"].height) == (12, 30)
    assert out[3]["content"][0]["image"] == parts[1]["image"]  # same pixels, same identity


def test_already_decoded_and_hf_style_image_parts() -> None:
    decoded = DecodedImage(np.zeros((4, 4, 3), np.uint8))
    out = acquire_message_media(
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": decoded}, {"type": "image", "image": url(A)}],
            }
        ],
        MediaPolicy(),
    )
    assert out[0]["content"][0]["image"] is decoded and out[0]["content"][1]["image"].width == 20


@pytest.mark.parametrize(
    "part, kind, match",
    [
        ({"type": "input_audio", "input_audio": {}}, "unsupported_part", "'input_audio' are not supported"),
        ({"type": "video_url", "video_url": {"url": "x"}}, "unsupported_part", "'video_url'"),
        ({"type": "image_url", "image_url": {}}, "bad_part", "needs a string 'url'"),
        ({"type": "text", "text": 3}, "bad_part", "string 'text'"),
        ("just a string", "bad_part", "not an object"),
        ({"type": "image", "image": 7}, "bad_part", "decoded image or a URL"),
    ],
)
def test_malformed_parts_name_the_message_and_part(part: object, kind: str, match: str) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "x"}, part]},
    ]
    with pytest.raises(PromptInputError, match=match) as e:
        acquire_message_media(messages, MediaPolicy())
    assert e.value.kind == kind and "messages[1].content[1]" in str(e.value)


def test_media_refusals_keep_their_type_and_name_the_part(tmp_path: Path) -> None:
    bad = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
        }
    ]
    with pytest.raises(MediaAcquisitionError, match=r"messages\[0\]\.content\[0\]: remote image URLs") as e:
        acquire_message_media(bad, MediaPolicy())
    assert e.value.kind == "remote_disabled"
    truncated = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url(A[: len(A) // 2])}}]}
    ]
    with pytest.raises(MediaDecodeError, match=r"content\[0\]: the PNG image is truncated") as e2:
        acquire_message_media(truncated, MediaPolicy())
    assert isinstance(e2.value, MediaError) and e2.value.kind == "corrupt"
    with pytest.raises(MediaDecodeError, match="over the limit of 100 pixels"):
        acquire_message_media(
            [{"role": "user", "content": [{"type": "image_url", "image_url": url(A)}]}],
            MediaPolicy(),
            limits=DecodeLimits(max_pixels=100),
        )


def test_image_count_limit_and_bad_messages() -> None:
    parts = [{"type": "image_url", "image_url": url(A)}] * 3
    with pytest.raises(PromptInputError, match="more than 2 images") as e:
        acquire_message_media([{"role": "user", "content": parts}], MediaPolicy(), max_images=2)
    assert e.value.kind == "too_many_images"
    with pytest.raises(PromptInputError, match="list of message objects"):
        acquire_message_media("hello", MediaPolicy())  # type: ignore[arg-type]
    with pytest.raises(PromptInputError, match=r"messages\[0\] is not an object"):
        acquire_message_media(["hello"], MediaPolicy())  # type: ignore[list-item]


def test_image_part_for_cli_paths(tmp_path: Path) -> None:
    (tmp_path / "x.png").write_bytes(A)
    part = image_part(str(tmp_path / "x.png"), MediaPolicy(media_root=tmp_path))
    assert part["type"] == "image" and part["image"].width == 20
