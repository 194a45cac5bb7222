"""Decode owned image bytes into RGB pixels with Pillow, refusing anything unsafe or broken.

What a decoded image is, and why:
- **Format by content.** The bytes are sniffed (PNG, JPEG, GIF, WebP, BMP) and Pillow is told to open
  only that format, so a mislabeled file is read as what it is, and a non-image is refused.
- **Pixel-count limit before decoding.** Pillow's ``open`` reads only the header; the width x height it
  reports is checked against ``DecodeLimits.max_pixels`` before a single pixel is decoded, so a small
  file that expands to gigabytes (a decompression bomb) costs nothing. Pillow's own bomb error (at twice
  ``Image.MAX_IMAGE_PIXELS``) stays on as a second guard; no JPEG ``draft`` downscaling is used, since it
  would change the pixels the preprocessor sees.
- **EXIF orientation applied** (``ImageOps.exif_transpose``), as transformers' ``load_image`` does: the
  model sees the picture upright.
- **RGB the way the transformers image processor makes it** (``image_transforms.convert_to_rgb``): an
  image with an alpha band or a palette/grey transparency is composited onto white, anything else goes
  through Pillow's ``convert("RGB")`` (grey repeated, CMYK by Pillow's formula, palette looked up).
  One deliberate difference: 16-bit grey (``I;16*``, ``I``) is scaled to 8 bits (v * 255 / 65535);
  Pillow's convert (and so transformers) clips it at 255, which turns most such images white.
- **Animated images: the first frame** (``DecodeLimits.animated="first_frame"``, the default, which is
  also what transformers gets from an animated file), or refused with ``animated="refuse"``.
- **Truncated or corrupt data is refused** (Pillow never loads truncated images here).

Every refusal is a `MediaDecodeError` whose message names the cause.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from ninfer.media.decode.sniff import require_image_format
from ninfer.media.errors import MediaError

if TYPE_CHECKING:
    from PIL import Image

# Pillow is imported where pixels are decoded or resampled, not at import: text-only use of the Frontend
# (which imports DecodedImage) must not need it.

__all__ = ["DEFAULT_MAX_PIXELS", "DecodeLimits", "DecodedImage", "MediaDecodeError", "decode_image"]

# 8192 x 8192: above any camera a client sends (a 48 MP phone photo is 8000 x 6000) and, decoded as
# RGBA during conversion, at most 256 MiB of memory. The model itself sees at most the preprocessor's
# max_pixels (4096 x 4096 for Qwen3.6); larger pictures are scaled down.
DEFAULT_MAX_PIXELS = 8192 * 8192
_DIGEST_DOMAIN = b"ninfer.media.image.rgb8.v1\0"
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


class MediaDecodeError(MediaError):
    """The bytes are not an image NInfer decodes, or decoding them was refused (``kind`` says why)."""


@dataclass(frozen=True)
class DecodeLimits:
    """``max_pixels``: refuse images whose width x height exceeds it (checked before decoding).
    ``animated``: ``first_frame`` keeps frame 0 of an animated GIF/PNG/WebP, ``refuse`` refuses it."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    animated: Literal["first_frame", "refuse"] = "first_frame"

    def __post_init__(self) -> None:
        if self.max_pixels < 1:
            raise ValueError(f"DecodeLimits.max_pixels must be at least 1, got {self.max_pixels}")
        if self.animated not in ("first_frame", "refuse"):
            raise ValueError(
                f"DecodeLimits.animated must be 'first_frame' or 'refuse', got {self.animated!r}"
            )


@dataclass(frozen=True, eq=False)
class DecodedImage:
    """An upright RGB image: ``pixels`` is a read-only ``[height, width, 3]`` uint8 array.

    ``digest`` (sha256 hex over the size and the pixels) is the image's content identity: two files
    that decode to the same pixels are the same image. Equality and hashing use it.
    ``source_format`` is the sniffed format, ``animated`` whether the source had more frames.
    """

    pixels: np.ndarray
    source_format: str = "RGB"
    animated: bool = False
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        px = self.pixels
        if not isinstance(px, np.ndarray) or px.dtype != np.uint8 or px.ndim != 3 or px.shape[2] != 3:
            raise ValueError("DecodedImage.pixels must be a [height, width, 3] uint8 array")
        if px.shape[0] < 1 or px.shape[1] < 1:
            raise ValueError(f"DecodedImage has no pixels ({px.shape[1]} x {px.shape[0]})")
        # an owned, read-only copy: nobody holding the source array can change the image under its digest
        px = np.array(px, dtype=np.uint8, order="C", copy=True)
        px.setflags(write=False)
        object.__setattr__(self, "pixels", px)
        h = hashlib.sha256(_DIGEST_DOMAIN)
        h.update(px.shape[0].to_bytes(4, "little") + px.shape[1].to_bytes(4, "little"))
        h.update(px.data)
        object.__setattr__(self, "digest", h.hexdigest())

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DecodedImage) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"DecodedImage({self.width}x{self.height}, {self.source_format}, digest={self.digest[:12]})"

    def to_pil(self) -> Image.Image:
        """A PIL RGB image of the pixels (a copy; the array stays read-only)."""
        from PIL import Image

        return Image.fromarray(np.array(self.pixels), "RGB")


def decode_image(data: bytes | bytearray | memoryview, limits: DecodeLimits | None = None) -> DecodedImage:
    """Decode owned bytes into a `DecodedImage`; raises `MediaDecodeError` naming the cause."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    limits = limits or DecodeLimits()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode_image takes bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise MediaDecodeError("empty", "the image is empty (0 bytes)")
    fmt = require_image_format(data, MediaDecodeError)
    with warnings.catch_warnings():
        # our own size check below runs first and names the size; Pillow's error (at twice its
        # MAX_IMAGE_PIXELS) stays as the backstop for a limit set above Pillow's
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=[fmt])
            _check_size(image, fmt, limits)
            animated = bool(getattr(image, "is_animated", False))
            if animated and limits.animated == "refuse":
                raise MediaDecodeError(
                    "animated", f"animated {fmt} images are not accepted; send a still image"
                )
            if animated:
                image.seek(0)
            image.load()
            image = ImageOps.exif_transpose(image)
            pixels = _to_rgb(image)
        except MediaDecodeError:
            raise
        except Image.DecompressionBombError as e:
            raise MediaDecodeError("too_many_pixels", f"the {fmt} image is refused as too large: {e}") from e
        except UnidentifiedImageError as e:
            raise MediaDecodeError(
                "corrupt", f"the content starts like {fmt} but is not a readable {fmt}"
            ) from e
        except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError) as e:
            # Pillow reports truncation and corruption through all of these, depending on the codec
            raise MediaDecodeError("corrupt", f"the {fmt} image is truncated or corrupt: {e}") from e
    return DecodedImage(pixels, source_format=fmt, animated=animated)


def _check_size(image: Image.Image, fmt: str, limits: DecodeLimits) -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise MediaDecodeError("corrupt", f"the {fmt} image has no pixels ({width} x {height})")
    if width * height > limits.max_pixels:
        raise MediaDecodeError(
            "too_many_pixels",
            f"the {fmt} image is {width} x {height} = {width * height:,} pixels, over the limit of "
            f"{limits.max_pixels:,} pixels; send a smaller image",
        )


def _to_rgb(image: Image.Image) -> np.ndarray:
    """[H, W, 3] uint8, as transformers' ``convert_to_rgb`` makes it (module docstring)."""
    from PIL import Image

    if image.mode in _SIXTEEN_BIT_MODES:
        grey = np.asarray(image).astype(np.int64)
        grey = (np.clip(grey, 0, 65535) * 255 + 32767) // 65535
        return np.repeat(grey.astype(np.uint8)[:, :, None], 3, axis=2)
    if image.mode == "F":
        raise MediaDecodeError("unsupported_mode", "32-bit floating-point images are not supported")
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        rgb = Image.alpha_composite(background, rgba).convert("RGB")
    else:
        rgb = image.convert("RGB")
    return np.asarray(rgb, dtype=np.uint8)
