"""Oracles and inputs of the vision tests: transformers' image processor, processor, get_rope_index and
vision tower, built from the same resources and weights as NInfer's, plus test images.

transformers is imported lazily (the GPU machine may have another version). The image processor is
``Qwen2VLImageProcessorPil``: the class transformers 5 picks for the Qwen3.6 preprocessor config
(``Qwen2VLImageProcessorFast``) when torchvision is absent, as here (ninfer/targets/qwen3_6/frontend/
vision.py explains why this is the one to equal). ``Qwen3VLProcessor`` is built without its video
processor (which needs torchvision); only its image path runs.
"""

from __future__ import annotations

import copy
import functools
import io
import json
from collections.abc import Mapping, Sequence
from typing import Any
from unittest import mock

import numpy as np
import torch
from PIL import Image

from ninfer.targets.qwen3_6.frontend import Frontend, FrontendResources, SpecialTokens
from ninfer.targets.qwen3_6.frontend.vision import FAMILY_DEFAULTS
from ninfer.targets.qwen3_6.resources import chat_template, tokenizer_json

# a small-image config for model tests: min 4 merge blocks' worth of pixels, max 4096 pixels
SMALL_CONFIG: dict[str, Any] = {
    **FAMILY_DEFAULTS,
    "size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 6},
}


def processor_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    # a deep copy: transformers writes top-level min/max_pixels into the ``size`` dict it is given, which
    # a config built as {**FAMILY_DEFAULTS, ...} shares with the library's defaults
    kept = {k: v for k, v in config.items() if k not in ("processor_class", "image_processor_type")}
    return copy.deepcopy(kept)


def hf_image_processor(config: Mapping[str, Any] = FAMILY_DEFAULTS) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**processor_kwargs(config))


def hf_preprocess(
    images: Sequence[Image.Image], config: Mapping[str, Any] = FAMILY_DEFAULTS
) -> tuple[Any, Any]:
    """(pixel_values [P, 1536] float32, image_grid_thw [N, 3]) from transformers' PIL image processor."""
    out = hf_image_processor(config)(images=list(images), return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


@functools.cache
def hf_tokenizer() -> Any:
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer_json().decode()))


def hf_processor(config: Mapping[str, Any] = FAMILY_DEFAULTS) -> Any:
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    # the class check would import the video processor, which needs torchvision
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        return Qwen3VLProcessor(image_processor=hf_image_processor(config), tokenizer=hf_tokenizer())


def hf_process(text: str, images: Sequence[Image.Image], config: Mapping[str, Any] = FAMILY_DEFAULTS) -> Any:
    """transformers' Qwen3VLProcessor on the rendered chat text: input_ids, mm_token_type_ids, pixels."""
    return hf_processor(config)(text=[text], images=list(images) or None, return_tensors="pt")


def frontend(config: Mapping[str, Any] | None = FAMILY_DEFAULTS, template: str = "qwen3_6") -> Frontend:
    """The real Qwen3.6 Frontend with this preprocessor config (None: no preprocessor_config.json).
    Cached per (config, template): building one parses the 13 MB tokenizer; a Frontend is immutable."""
    return _frontend(json.dumps(config, sort_keys=True), template)


@functools.cache
def _frontend(config_json: str, template: str) -> Frontend:
    config = json.loads(config_json)
    resources = FrontendResources(
        tokenizer_json=tokenizer_json(),
        chat_template=chat_template(template),
        generation_config={},
        preprocessor_config=dict(config) if config is not None else None,
    )
    return Frontend.from_resources(resources, SpecialTokens())


def rope_index_model() -> Any:
    """A Qwen3_5Model on the meta device: get_rope_index needs its config only, no weights."""
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    from ninfer.targets.registry import PACKAGES

    with torch.device("meta"):
        return Qwen3_5Model(Qwen3_5Config(**PACKAGES["qwen3_6_tiny"].hf_config()))


def hf_rope_index(
    input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, grids: torch.Tensor
) -> tuple[Any, Any]:
    """(positions [3, L], delta) from transformers' get_rope_index for one sequence."""
    positions, delta = rope_index_model().get_rope_index(
        input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=grids
    )
    return positions[:, 0], int(delta.item())


# ---- test images -------------------------------------------------------------------------------------


def noise(width: int, height: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    """Smooth gradients plus noise (resampling artefacts show, unlike in flat images)."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, width)[None, :, None]
    y = np.linspace(0, 255, height)[:, None, None]
    base = (x * 0.6 + y * 0.4) * np.ones((1, 1, channels))
    return np.clip(base + rng.normal(0, 40, (height, width, channels)), 0, 255).astype(np.uint8)


def pattern(width: int, height: int) -> np.ndarray:
    """A busy but cheap RGB pattern for large images (noise() would take seconds there)."""
    y, x = np.ogrid[:height, :width]
    r = (x * 7 + y * 13) & 255
    g = (x * y) & 255
    b = (x ^ y) & 255
    return np.stack(np.broadcast_arrays(r, g, b), axis=-1).astype(np.uint8)


def encode(image: Image.Image, fmt: str = "PNG", **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def png(width: int, height: int, seed: int = 0) -> bytes:
    return encode(Image.fromarray(noise(width, height, seed)))


def oracle_image(data: bytes) -> Image.Image:
    """What transformers' load_image does before the processor: open and apply EXIF orientation.
    (load_image would then convert("RGB"), dropping alpha; the processor itself composites onto white,
    which is what NInfer matches, so the oracle hands the processor the image with its alpha.)"""
    from PIL import ImageOps

    return ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
