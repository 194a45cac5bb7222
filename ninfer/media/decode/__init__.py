"""Decode already-owned media bytes (no URLs, no paths, no target): images through Pillow."""

from ninfer.media.decode.image import (
    DEFAULT_MAX_PIXELS,
    DecodedImage,
    DecodeLimits,
    MediaDecodeError,
    decode_image,
)
from ninfer.media.decode.sniff import SUPPORTED_FORMATS, sniff_image_format

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "SUPPORTED_FORMATS",
    "DecodeLimits",
    "DecodedImage",
    "MediaDecodeError",
    "decode_image",
    "sniff_image_format",
]
