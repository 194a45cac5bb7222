"""Images on the command line (`ninfer generate --image PATH`, `/image PATH` in `ninfer chat`).

A path names the user's own file: any file they can read (the acquisition policy's media root is
``/``, the path made absolute first), unlike `ninfer serve`, where clients' paths stay inside
``--media-root``. A ``data:`` URL works too; http(s) URLs do not (download the image first). The image is
read, sniffed and decoded here, before the request is built, so a bad file is reported at once.
"""

from __future__ import annotations

import os
from typing import Any


def image_part(reference: str) -> dict[str, Any]:
    """``{"type": "image", "image": DecodedImage}`` for a chat message; ValueError (a MediaError for a
    refused or undecodable image) with a one-line message naming the argument."""
    from ninfer.media.errors import MediaError
    from ninfer.product.media_acquire import MediaPolicy
    from ninfer.product.prompt_input import image_part as acquired_part

    given = reference.strip()
    if not given:
        raise ValueError("the image path is empty")
    lowered = given.lower()
    if lowered.startswith(("http://", "https://")):
        raise ValueError(f"{given}: give a local file or a data: URL (download the image first)")
    if lowered.startswith("data:"):
        path = given
    else:
        path = os.path.abspath(os.path.expanduser(given))
        if not os.path.exists(path):
            raise ValueError(f"{given}: no such file")
        if os.path.isdir(path):
            raise ValueError(f"{given}: is a directory, not an image file")
    try:
        return acquired_part(path, MediaPolicy(media_root="/"))
    except MediaError as e:
        shown = given if len(given) <= 80 else given[:77] + "..."
        raise type(e)(e.kind, f"{shown}: {e}") from None
