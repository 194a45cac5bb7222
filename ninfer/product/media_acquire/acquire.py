"""One entry point: a media reference (URL or local path) to owned bytes whose content is an image."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ninfer.media.decode.sniff import SUPPORTED_FORMATS, require_image_format
from ninfer.product.media_acquire.data_url import read_data_url
from ninfer.product.media_acquire.local import read_local_file
from ninfer.product.media_acquire.policy import MediaAcquisitionError, MediaPolicy
from ninfer.product.media_acquire.remote import fetch_remote

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")


@dataclass(frozen=True)
class AcquiredMedia:
    """Owned bytes plus what the content says it is (``format``: Pillow's name, ``media_type``: MIME);
    ``source`` is ``data``, ``file`` or ``remote`` (never the URL: it may carry a token)."""

    data: bytes
    format: str
    media_type: str
    source: str


def acquire_image(reference: str, policy: MediaPolicy) -> AcquiredMedia:
    """Bytes of an image reference under ``policy``.

    ``data:`` URLs always; ``http(s)`` URLs when the policy allows remote media; a path (anything without
    a ``scheme:`` prefix of two or more letters) only inside ``policy.media_root``. ``file://`` URLs are
    refused: name the file by path (relative to the media root) instead, so there is one way to reach a
    local file and one check. The content must sniff as a supported image, whatever the URL or server
    says it is. Raises `MediaAcquisitionError` naming the cause.
    """
    if not isinstance(reference, str):
        raise MediaAcquisitionError(
            "bad_reference", f"an image reference is a string, got {type(reference).__name__}"
        )
    reference = reference.strip()
    if not reference:
        raise MediaAcquisitionError("bad_reference", "the image reference is empty")
    match = _SCHEME.match(reference)
    scheme = match.group(1).lower() if match else None
    if scheme == "data":
        data, source = read_data_url(reference, policy), "data"
    elif scheme in ("http", "https"):
        data, source = fetch_remote(reference, policy), "remote"
    elif scheme == "file":
        raise MediaAcquisitionError(
            "file_url_refused", "file:// URLs are not accepted; give the path relative to the media root"
        )
    elif scheme is not None and len(scheme) > 1:  # any other scheme is refused; "c:x.png" stays a path
        raise MediaAcquisitionError("bad_scheme", f"image URLs with the scheme {scheme!r} are not accepted")
    else:
        data, source = read_local_file(reference, policy), "file"
    fmt = require_image_format(data, MediaAcquisitionError, f"{source} content")
    return AcquiredMedia(data=data, format=fmt, media_type=SUPPORTED_FORMATS[fmt], source=source)
