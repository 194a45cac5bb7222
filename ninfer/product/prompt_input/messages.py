"""Chat messages with OpenAI content parts -> the Frontend's message shape, images acquired and decoded.

Accepted content parts (in a message whose ``content`` is a list):
- ``{"type": "text", "text": str}`` (kept as is);
- ``{"type": "image_url", "image_url": {"url": str, "detail": ...}}`` or ``{"type": "image_url",
  "image_url": str}``: the URL (``data:``, ``http(s)``, or a path under the media root) is acquired
  under the `MediaPolicy`, decoded, and the part becomes ``{"type": "image", "image": DecodedImage}``;
  ``detail`` is accepted and ignored (the model's preprocessor decides the resolution);
- ``{"type": "image", "image": DecodedImage | str}`` (already decoded, or a reference as above).
Any other part type (``input_audio``, ``video_url``, ``file``, ...) is refused, naming it. String
content and messages without content pass through. The caller's messages are never modified.

Every refusal is a `MediaError` (`PromptInputError` for a malformed part, `MediaAcquisitionError` /
`MediaDecodeError` for the media) whose message says which message and part it was: a gateway maps them
all to a 400 and nothing reaches the Engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ninfer.media.decode import DecodedImage, DecodeLimits, decode_image
from ninfer.media.errors import MediaError
from ninfer.product.media_acquire import MediaPolicy, acquire_image

# Per request. Each image costs preprocessing time and at least 64 vision tokens (Qwen3.6's minimum
# of 256 x 256 pixels); the Program's vision-token limit bounds the rest.
DEFAULT_MAX_IMAGES = 32


class PromptInputError(MediaError):
    """A message or content part has a shape this adapter does not accept."""


def image_part(reference: str, policy: MediaPolicy, limits: DecodeLimits | None = None) -> dict[str, Any]:
    """One image reference (URL or path) acquired and decoded into the Frontend's part shape.

    For the CLI's ``--image PATH`` / ``/image PATH``: pass a policy whose media root holds the path."""
    acquired = acquire_image(reference, policy)
    return {"type": "image", "image": decode_image(acquired.data, limits)}


def acquire_message_media(
    messages: Sequence[Mapping[str, Any]],
    policy: MediaPolicy,
    *,
    limits: DecodeLimits | None = None,
    max_images: int = DEFAULT_MAX_IMAGES,
) -> list[dict[str, Any]]:
    """New messages in which every image part is a decoded ``{"type": "image", "image": DecodedImage}``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise PromptInputError("bad_messages", "messages must be a list of message objects")
    out: list[dict[str, Any]] = []
    count = 0
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise PromptInputError("bad_message", f"messages[{i}] is not an object")
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            converted = _convert_part(part, where, policy, limits)
            if converted.get("type") == "image":
                count += 1
                if count > max_images:
                    raise PromptInputError(
                        "too_many_images", f"{where}: more than {max_images} images in one request"
                    )
            parts.append(converted)
        out.append({**message, "content": parts})
    return out


def _convert_part(part: Any, where: str, policy: MediaPolicy, limits: DecodeLimits | None) -> dict[str, Any]:
    if not isinstance(part, Mapping):
        raise PromptInputError("bad_part", f"{where} is not an object (a content part needs a 'type')")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise PromptInputError("bad_part", f"{where}: a text part needs a string 'text'")
        return dict(part)
    if kind == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, Mapping) else spec
        if not isinstance(url, str):
            raise PromptInputError("bad_part", f"{where}: image_url needs a string 'url'")
        return _image(url, where, policy, limits)
    if kind == "image" or (kind is None and "image" in part):
        image = part.get("image")
        if isinstance(image, DecodedImage):
            return {"type": "image", "image": image}
        if isinstance(image, str):
            return _image(image, where, policy, limits)
        raise PromptInputError("bad_part", f"{where}: an image part needs a decoded image or a URL")
    raise PromptInputError("unsupported_part", f"{where}: content parts of type {kind!r} are not supported")


def _image(reference: str, where: str, policy: MediaPolicy, limits: DecodeLimits | None) -> dict[str, Any]:
    try:
        return image_part(reference, policy, limits)
    except MediaError as e:
        # same type and kind, the message says which part it was
        raise type(e)(e.kind, f"{where}: {e}") from e
