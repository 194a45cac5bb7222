"""A prompt's images inside the Program: the vision tower runs before the prefill chunk that first needs
an image's features, and the chunk takes them at the image's pad tokens (the step's embedding splice).

Features are computed once per image, on the device, and dropped as soon as the prefill has passed the
image's pads, so a long prompt with many images holds only the features of the images its current chunk
touches. The tower is `ninfer.targets.qwen3_6.vision.vision_embeddings` (attention over each image's
patches by frame, no CUDA graph: it runs once per image).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ninfer.targets.qwen3_6.kernels import Kernels
from ninfer.targets.qwen3_6.variant import Variant
from ninfer.targets.qwen3_6.view import ModelView
from ninfer.targets.qwen3_6.vision import vision_embeddings


def prompt_images(prompt: Any) -> tuple[Any, ...]:
    """The family prompt's `PreparedImage`s (none for a text prompt or a prompt of another shape)."""
    return tuple(getattr(prompt, "images", ()) or ())


class PromptImages:
    """The images of one sequence's prompt and the features computed for them so far."""

    def __init__(self, images: Sequence[Any]) -> None:
        self.images = tuple(images)
        self._features: dict[int, torch.Tensor] = {}  # image index -> [num_tokens, H] on the device

    def splice(
        self, start: int, end: int, view: ModelView, variant: Variant, kernels: Kernels
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(chunk-relative token indices [M], their embeddings [M, H]) for the image pads among prompt
        positions ``start..end-1``, running the tower (on the op table ``kernels``) for images not computed
        yet; None without any."""
        needed = [
            i for i, image in enumerate(self.images)
            if image.token_offset < end and image.token_offset + image.num_tokens > start
        ]  # fmt: skip
        if not needed:
            return None
        self._compute([i for i in needed if i not in self._features], view, variant, kernels)
        indices, embeds = [], []
        for i in needed:
            image = self.images[i]
            first = max(start, image.token_offset)
            last = min(end, image.token_offset + image.num_tokens)
            rows = self._features[i][first - image.token_offset : last - image.token_offset]
            indices.append(torch.arange(first - start, last - start, device=rows.device))
            embeds.append(rows)
        for i in needed:  # a chunk that reaches an image's last pad is the last one to need it
            image = self.images[i]
            if image.token_offset + image.num_tokens <= end:
                del self._features[i]
        return torch.cat(indices), torch.cat(embeds)

    def _compute(self, which: Sequence[int], view: ModelView, variant: Variant, kernels: Kernels) -> None:
        if not which:
            return
        if view.vision is None or variant.vision is None:
            raise ValueError("the prompt has images but the package has no vision tower")
        images = [self.images[i] for i in which]
        device = view.vision.patch_embed_weight.device
        # the prompt's arrays are read-only (it owns them); the tower reads a device copy
        pixels = torch.cat([torch.tensor(image.pixel_values) for image in images]).to(device)
        features = vision_embeddings(
            view.vision, variant.vision, pixels, [image.grid_thw for image in images], kernels
        )
        offset = 0
        for i, image in zip(which, images):
            self._features[i] = features[offset : offset + image.num_tokens]
            offset += image.num_tokens
