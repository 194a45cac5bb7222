"""Media acquisition for the gateways: ``data:`` URLs, local files under a media root, guarded remote
fetches. Produces owned bytes (sniffed as an image); decoding is ``ninfer.media.decode``'s job."""

from ninfer.product.media_acquire.acquire import AcquiredMedia, acquire_image
from ninfer.product.media_acquire.policy import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_REDIRECTS,
    DEFAULT_TIMEOUT_S,
    MediaAcquisitionError,
    MediaPolicy,
)
from ninfer.product.media_acquire.remote import refusal_reason

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_REDIRECTS",
    "DEFAULT_TIMEOUT_S",
    "AcquiredMedia",
    "MediaAcquisitionError",
    "MediaPolicy",
    "acquire_image",
    "refusal_reason",
]
