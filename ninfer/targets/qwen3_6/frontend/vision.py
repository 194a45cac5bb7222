"""Qwen3.6 image preprocessing, equal to transformers' ``Qwen2VLImageProcessorPil``.

The artifact's ``preprocessor_config.json`` names ``Qwen2VLImageProcessorFast``; transformers 5 maps
that name to its torchvision backend when torchvision is installed and to the PIL backend
(``Qwen2VLImageProcessorPil``) otherwise. The PIL backend resamples with Pillow, which is what NInfer
uses, so this module equals that one to the bit; the torchvision backend resizes with
``torch.nn.functional.interpolate`` and differs from both by a few 1/255 levels near edges.

Steps for one RGB image (``DecodedImage``, already upright and composited onto white):
1. ``smart_resize``: height and width become multiples of ``patch_size * merge_size`` (32) near the
   original aspect ratio, with the pixel count inside ``[min_pixels, max_pixels]``; an aspect ratio
   above 200 is refused, as transformers refuses it;
2. resample with Pillow (``resample``, bicubic by default) on the uint8 image;
3. ``x * rescale_factor`` in float64, then float32; ``(x - mean) / std`` in float32;
4. the still image is repeated over ``temporal_patch_size`` frames and cut into patches: row order
   (block_row, block_col, in_row, in_col) over 2 x 2 merge blocks, each row (c, t, py, px), i.e.
   ``[h*w, 3 * temporal * patch * patch]`` with ``grid_thw = (1, h, w)`` in patches.

The configuration comes from ``preprocessor_config.json``; without one the family's published values
are used (`FAMILY_DEFAULTS`, what the Qwen3.5/3.6 checkpoints ship) and `ImageProcessorConfig.source`
says so.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ninfer.media.decode import DecodedImage
from ninfer.targets.qwen3_6.variant import VisionDims

__all__ = [
    "FAMILY_DEFAULTS",
    "ImageProcessorConfig",
    "ImagePreprocessError",
    "ProcessedImage",
    "preprocess_image",
    "smart_resize",
]

# preprocessor_config.json of the Qwen3.5 / Qwen3.6 checkpoints (all sizes share it)
FAMILY_DEFAULTS: dict[str, Any] = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
# the image processor classes whose preprocessing this module is
_KNOWN_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
_MAX_ASPECT_RATIO = 200
_DIGEST_DOMAIN = b"ninfer.qwen3_6.image.v1\0"


class ImagePreprocessError(ValueError):
    """The image cannot be preprocessed (aspect ratio over 200, or the config is unusable)."""


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The preprocessing parameters (transformers' names). ``source`` tells where they came from."""

    min_pixels: int = 65536
    max_pixels: int = 16777216
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL.Image.Resampling.BICUBIC (Pillow is imported only to resample)
    do_rescale: bool = True
    do_normalize: bool = True
    source: str = "family defaults (no preprocessor_config.json)"

    @classmethod
    def from_json(
        cls, config: Mapping[str, Any] | None, vision: VisionDims | None = None
    ) -> ImageProcessorConfig:
        """Read a ``preprocessor_config.json`` (None: `FAMILY_DEFAULTS`). ``vision``: the package's tower
        dims, which patch, temporal patch and merge sizes must match. Raises ValueError naming the key."""
        source = "preprocessor_config.json"
        if config is None:
            config, source = FAMILY_DEFAULTS, cls.source
        kind = config.get("image_processor_type")
        if kind is not None and kind not in _KNOWN_TYPES:
            raise ValueError(
                f"preprocessor_config.json: image_processor_type {kind!r} is not one of {_KNOWN_TYPES}"
            )
        for key in ("do_resize", "do_convert_rgb"):
            if config.get(key, True) is not True:
                raise ValueError(
                    f"preprocessor_config.json: {key}={config[key]!r} is not supported (must be true)"
                )
        size = config.get("size") or {}
        if not isinstance(size, Mapping):
            raise ValueError(f"preprocessor_config.json: size must be an object, got {size!r}")
        # transformers: top-level min_pixels/max_pixels override size (older configs carry them)
        min_pixels = config.get("min_pixels", size.get("shortest_edge", cls.min_pixels))
        max_pixels = config.get("max_pixels", size.get("longest_edge", cls.max_pixels))
        out = cls(
            min_pixels=_int(min_pixels, "min_pixels"),
            max_pixels=_int(max_pixels, "max_pixels"),
            patch_size=_int(config.get("patch_size", cls.patch_size), "patch_size"),
            temporal_patch_size=_int(
                config.get("temporal_patch_size", cls.temporal_patch_size), "temporal_patch_size"
            ),
            merge_size=_int(config.get("merge_size", cls.merge_size), "merge_size"),
            image_mean=_triple(config.get("image_mean", cls.image_mean), "image_mean"),
            image_std=_triple(config.get("image_std", cls.image_std), "image_std"),
            rescale_factor=float(config.get("rescale_factor", cls.rescale_factor)),
            resample=_int(config.get("resample", cls.resample), "resample"),
            do_rescale=bool(config.get("do_rescale", True)),
            do_normalize=bool(config.get("do_normalize", True)),
            source=source,
        )
        out.check(vision)
        return out

    def check(self, vision: VisionDims | None = None) -> None:
        problems = []
        if not 0 < self.min_pixels <= self.max_pixels:
            problems.append(f"need 0 < min_pixels ({self.min_pixels}) <= max_pixels ({self.max_pixels})")
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1:
            problems.append("patch_size, temporal_patch_size and merge_size must be positive")
        if any(s == 0 for s in self.image_std):
            problems.append("image_std has a zero")
        if self.resample not in range(6):  # NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING
            problems.append(f"resample {self.resample} is not a Pillow resampling filter")
        if vision is not None:
            for ours, theirs, name in (
                (self.patch_size, vision.patch_size, "patch_size"),
                (self.temporal_patch_size, vision.temporal_patch_size, "temporal_patch_size"),
                (self.merge_size, vision.spatial_merge_size, "merge_size"),
            ):
                if ours != theirs:
                    problems.append(f"{name} {ours} differs from the vision tower's {theirs}")
        if problems:
            raise ValueError("preprocessor_config.json: " + "; ".join(problems))

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Elements of one pixel_values row: 3 channels x temporal x patch x patch (1536 for Qwen3.6)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def identity(self) -> bytes:
        """Canonical bytes of everything that changes pixel values or the grid (not ``source``)."""
        fields = asdict(self)
        del fields["source"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """``pixel_values`` [h*w, patch_dim] float32 (read-only), ``grid_thw`` in patches, ``digest`` the
    identity of (decoded pixels, preprocessing parameters)."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    digest: str

    def num_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' ``smart_resize`` (Python's ``round``, i.e. half to even, as there)."""
    if max(height, width) / min(height, width) > _MAX_ASPECT_RATIO:
        raise ImagePreprocessError(
            f"the image is {width} x {height}: an aspect ratio of "
            f"{max(height, width) / min(height, width):.0f}, over the limit of {_MAX_ASPECT_RATIO}; "
            "crop or pad it"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(width: int, height: int, config: ImageProcessorConfig) -> tuple[int, int, int]:
    """The ``grid_thw`` `preprocess_image` gives an image of ``width`` x ``height`` pixels (its resize to
    the processor's grid, in patches); raises ImagePreprocessError for an aspect ratio it refuses."""
    h, w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    return (1, h // config.patch_size, w // config.patch_size)


def image_digest(image: DecodedImage, config: ImageProcessorConfig) -> str:
    """sha256 over the decoded pixels' digest and the preprocessing parameters."""
    h = hashlib.sha256(_DIGEST_DOMAIN)
    h.update(bytes.fromhex(image.digest))
    h.update(config.identity())
    return h.hexdigest()


def preprocess_image(image: DecodedImage, config: ImageProcessorConfig) -> ProcessedImage:
    """The image's pixel_values and grid (module docstring); raises ImagePreprocessError."""
    if not isinstance(image, DecodedImage):
        raise TypeError(f"preprocess_image takes a DecodedImage, got {type(image).__name__}")
    _, grid_h, grid_w = image_grid(image.width, image.height, config)
    height, width = grid_h * config.patch_size, grid_w * config.patch_size
    resized = image.to_pil().resize((width, height), resample=config.resample)
    x: np.ndarray = np.asarray(resized)  # [H, W, 3] uint8
    # steps 3 and 4 in the other order: the patches are cut from the uint8 pixels (a quarter of the bytes
    # to move), and each value then looked up in a table of step 3 applied to every (channel, level)
    # pair: the same float operations on the same inputs, so the same floats
    patches = _patchify(x, config)  # [N, C, P, P] uint8
    channels = patches.shape[1]
    levels = patches.astype(np.uint16)
    levels += (np.arange(channels, dtype=np.uint16) * 256)[:, None, None]
    values = _normalized_levels(config, channels).reshape(-1)[levels]  # [N, C, P, P] float32
    n, t, p = len(values), config.temporal_patch_size, config.patch_size
    frames = np.broadcast_to(values[:, :, None], (n, channels, t, p, p))  # the still image over T frames
    pixel_values = np.ascontiguousarray(frames.reshape(n, channels * t * p * p))
    pixel_values.setflags(write=False)
    return ProcessedImage(pixel_values, (1, grid_h, grid_w), image_digest(image, config))


def _normalized_levels(config: ImageProcessorConfig, channels: int) -> np.ndarray:
    """[C, 256] float32: step 3 of every uint8 level in each channel (module docstring)."""
    x = np.broadcast_to(np.arange(256, dtype=np.uint8), (channels, 256)).T  # [256, C], as pixels are
    if config.do_rescale:
        y = (x.astype(np.float64) * config.rescale_factor).astype(np.float32)
    else:
        y = x.astype(np.float32)
    if config.do_normalize:
        mean = np.asarray(config.image_mean, dtype=np.float32)
        std = np.asarray(config.image_std, dtype=np.float32)
        y = (y - mean) / std
    return np.ascontiguousarray(y.T, dtype=np.float32)


def _patchify(x: np.ndarray, config: ImageProcessorConfig) -> np.ndarray:
    """[H, W, C] -> [gh*gw, C, P, P] in merge-block row order (block_row, block_col, in_row, in_col)."""
    height, width, channels = x.shape
    p, m = config.patch_size, config.merge_size
    gh, gw = height // p, width // p
    blocks = x.reshape(gh // m, m, p, gw // m, m, p, channels)
    # (block_row, block_col, in_row, in_col, c, py, px)
    blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)
    return np.ascontiguousarray(blocks.reshape(gh * gw, channels, p, p))


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"preprocessor_config.json: {name} must be an integer, got {value!r}")
    return int(value)


def _triple(value: Any, name: str) -> tuple[float, float, float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * 3
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError(f"preprocessor_config.json: {name} must be 3 numbers, got {value!r}")
    return (float(value[0]), float(value[1]), float(value[2]))
