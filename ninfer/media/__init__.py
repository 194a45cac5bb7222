"""Media handling that needs no model: decoding owned bytes into pixels (``ninfer.media.decode``).

Nothing here imports a target; the family Frontend consumes what this produces.
"""

from ninfer.media.errors import MediaError

__all__ = ["MediaError"]
