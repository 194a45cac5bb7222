"""Image type from the content's magic bytes: a declared MIME type or a file extension is never trusted."""

from __future__ import annotations

from ninfer.media.errors import MediaError

# Pillow format name -> MIME type of the formats NInfer decodes. TIFF, ICO, PSD, SVG and the rest are
# refused: each added codec is attack surface, and clients send these five.
SUPPORTED_FORMATS: dict[str, str] = {
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "GIF": "image/gif",
    "WEBP": "image/webp",
    "BMP": "image/bmp",
}


def sniff_image_format(data: bytes) -> str | None:
    """The Pillow format name the bytes start like, or None when they look like none we decode."""
    head = bytes(data[:16])
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "WEBP"
    if head.startswith(b"BM") and len(head) >= 14:
        return "BMP"
    return None


def describe_head(data: bytes, n: int = 12) -> str:
    """The first bytes, printable, for an error message (never the whole body)."""
    return repr(bytes(data[:n])) + ("..." if len(data) > n else "")


def require_image_format(data: bytes, error: type[MediaError], what: str = "content") -> str:
    """The sniffed format of ``data``; else ``error("not_an_image", ...)`` quoting its first bytes."""
    fmt = sniff_image_format(data)
    if fmt is None:
        names = ", ".join(SUPPORTED_FORMATS)
        raise error(
            "not_an_image",
            f"the {what} is not a supported image ({names}); it starts with {describe_head(data)}",
        )
    return fmt
