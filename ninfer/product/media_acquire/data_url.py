"""``data:`` URLs (RFC 2397): the payload is decoded, its declared media type ignored (content is sniffed)."""

from __future__ import annotations

import base64
import binascii
import re
import urllib.parse

from ninfer.product.media_acquire.policy import MediaAcquisitionError, MediaPolicy

_WHITESPACE = re.compile(rb"\s+")


def read_data_url(url: str, policy: MediaPolicy) -> bytes:
    """The bytes of a ``data:[<type>][;base64],<payload>`` URL; refuses oversized or malformed ones."""
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaAcquisitionError("bad_data_url", "the data: URL has no ',' before its payload")
    params = [p.strip().lower() for p in header.split(";")]
    is_base64 = "base64" in params[1:]
    # bound the work before decoding: base64 is 4 characters for 3 bytes
    decoded_bound = len(payload) * 3 // 4 if is_base64 else len(payload)
    if decoded_bound > policy.max_bytes + 3:
        raise MediaAcquisitionError(
            "too_large",
            f"the data: URL holds about {decoded_bound:,} bytes, "
            f"over the limit of {policy.max_bytes:,} bytes",
        )
    if is_base64:
        raw = _WHITESPACE.sub(b"", payload.encode("ascii", errors="replace"))
        try:
            data = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise MediaAcquisitionError(
                "bad_data_url", "the data: URL's base64 payload is not valid base64"
            ) from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > policy.max_bytes:
        raise MediaAcquisitionError(
            "too_large",
            f"the data: URL holds {len(data):,} bytes, over the limit of {policy.max_bytes:,} bytes",
        )
    if not data:
        raise MediaAcquisitionError("empty", "the data: URL's payload is empty")
    return data
