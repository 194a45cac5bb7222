"""Image input of the HTTP gateway: where ``image_url`` parts may come from, and their acquisition.

``ImageInput`` (``ServeConfig.images``) holds the `MediaPolicy` (``data:`` URLs always; local paths only
under ``--media-root``; ``http(s)`` only with ``--allow-remote-media``, never to loopback/private
addresses unless ``--allow-media-network`` names them), the decode limits and the per-request image
count. ``acquire`` runs on a worker thread (reading a file or fetching a URL blocks), bounded by its own
limiter so slow image hosts cannot take every worker thread from tokenization; each refusal becomes a
400 naming the part (``messages[i].content[j]``) and the cause, and nothing reaches the Engine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread

from ninfer.media.decode import DecodeLimits
from ninfer.media.errors import MediaError
from ninfer.product.media_acquire import MediaPolicy
from ninfer.product.prompt_input import DEFAULT_MAX_IMAGES, acquire_message_media
from ninfer.serve.errors import ServeError

# image acquisitions running at once (each may wait up to the policy's timeout on a remote host)
DEFAULT_MEDIA_WORKERS = 8
_WHERE = re.compile(r"^(messages\[\d+\]\.content\[\d+\])")


@dataclass(frozen=True)
class ImageInput:
    """``policy``: where images may come from and how large they may be; ``limits``: the decode limits
    (pixel count before decoding, animated images); ``max_images``: per request; ``vision``: whether the
    model has a vision tower (None: unknown here, the Engine refuses images it cannot take);
    ``workers``: acquisitions running at once."""

    policy: MediaPolicy = field(default_factory=MediaPolicy)
    limits: DecodeLimits = field(default_factory=DecodeLimits)
    max_images: int = DEFAULT_MAX_IMAGES
    vision: bool | None = None
    workers: int = DEFAULT_MEDIA_WORKERS

    def __post_init__(self) -> None:
        if self.max_images < 1:
            raise ValueError(f"the image count per request must be at least 1, got {self.max_images}")
        if self.workers < 1:
            raise ValueError(f"ImageInput.workers must be at least 1, got {self.workers}")


def image_parts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Where the request's image parts are (``messages[i].content[j]``), in order."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            out += [f"messages[{i}].content[{j}]" for j, p in enumerate(content) if _is_image(p)]
    return out


def _is_image(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "image_url"


class ImageAcquirer:
    """Acquires a request's images off the event loop under the server's ``ImageInput``."""

    def __init__(self, settings: ImageInput, model_name: str) -> None:
        self.settings = settings
        self.model_name = model_name
        self._limiter: anyio.CapacityLimiter | None = None  # made on the event loop, at first use

    async def acquire(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with every ``image_url`` part acquired and decoded (the same list when it has
        none); a ServeError 400 for the first part refused."""
        where = image_parts(messages)
        if not where:
            return messages
        if self.settings.vision is False:
            raise ServeError(
                400,
                f"{where[0]}: the model {self.model_name!r} has no vision tower, so it takes no images; "
                "send text parts only",
                code="unsupported_content",
                param=where[0],
            )
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.settings.workers)
        return await anyio.to_thread.run_sync(self._acquire, messages, limiter=self._limiter)

    def _acquire(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        s = self.settings
        try:
            return acquire_message_media(messages, s.policy, limits=s.limits, max_images=s.max_images)
        except MediaError as e:
            message = str(e)
            match = _WHERE.match(message)
            raise ServeError(
                400, message, code="invalid_image", param=match.group(1) if match else "messages"
            ) from None
