"""Content identity of a token prefix, shared by the Frontend, the Engine and the Program.

A checkpoint is looked up by the digest of the tokens it holds plus the identity of every media item
inside them, so a wrong boundary can only cost hits, never correctness. The digest is package-neutral
(no target import): a Frontend computes it for its prompts' boundaries, a Program for prompt + output
frontiers, and both must agree byte for byte.

Layout (sha256, injective): domain, salt (length-prefixed), the ids (u32 little-endian), then a trailer:
each media item as (offset u64, digest length u64, digest), the media count and the token count (u64
little-endian). The ids come before anything that depends on the prefix length, so `PrefixHasher` can
hash a growing prefix once and take the digest at every boundary on the way.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence

_DOMAIN = b"ninfer.prefix.v1\0"  # apart from the whole-prompt digest (ninfer.qwen3_6.prompt.v1)


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "little")


def ids_bytes(token_ids: Iterable[int]) -> bytes:
    """The ids as u32 little-endian bytes (OverflowError outside u32)."""
    a = array("I", token_ids)  # 4 bytes on every supported platform
    if sys.byteorder == "big":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


class PrefixHasher:
    """Incremental `prefix_digest`: ``extend`` tokens, ``add_media`` once its tokens are in, and take
    ``hexdigest()`` at any point (it equals ``prefix_digest`` of everything added so far)."""

    __slots__ = ("_h", "_n", "_media")

    def __init__(self, salt: str = "") -> None:
        s = salt.encode("utf-8")
        self._h = hashlib.sha256(_DOMAIN + _u64(len(s)) + s)
        self._n = 0
        self._media: list[tuple[int, str]] = []

    @property
    def num_tokens(self) -> int:
        return self._n

    def extend(self, token_ids: Sequence[int]) -> None:
        self._h.update(ids_bytes(token_ids))
        self._n += len(token_ids)

    def add_media(self, offset: int, digest: str) -> None:
        """A media item whose tokens start at ``offset`` (already added); in ascending offset order."""
        if not 0 <= offset < self._n:
            raise ValueError(f"media offset {offset} outside the {self._n} tokens hashed so far")
        if self._media and offset <= self._media[-1][0]:
            raise ValueError(f"media offsets must ascend: {offset} after {self._media[-1][0]}")
        self._media.append((offset, digest))

    def hexdigest(self) -> str:
        h = self._h.copy()  # the trailer depends on the length: hash it on a copy
        for offset, digest in self._media:
            d = digest.encode("utf-8")
            h.update(_u64(offset) + _u64(len(d)) + d)
        h.update(_u64(len(self._media)) + _u64(self._n))
        return h.hexdigest()


def prefix_digest(token_ids: Sequence[int], media: Sequence[tuple[int, str]] = (), salt: str = "") -> str:
    """sha256 hex identity of a token prefix: ``token_ids`` and each media item wholly inside it as
    ``(token offset, media digest)`` in ascending offset order. ``salt`` lets a Program separate
    checkpoints of different backend configurations. Deterministic; equal exactly when ids, media and
    salt are equal. Raises ValueError for a media offset outside the ids or out of order."""
    hasher = PrefixHasher(salt)
    hasher.extend(token_ids)
    for offset, digest in media:
        hasher.add_media(offset, digest)
    return hasher.hexdigest()


def prefix_digests(
    token_ids: Sequence[int],
    lengths: Iterable[int],
    media_spans: Sequence[tuple[int, int, str]] = (),
    salt: str = "",
) -> dict[int, str]:
    """`prefix_digest` of ``token_ids[:n]`` for every ``n`` in ``lengths``, in one pass over the ids.
    ``media_spans`` are (token offset, token count, media digest) of the media items; those wholly
    inside a prefix are part of its identity, and a length that cuts one has no digest (omitted)."""
    wanted = sorted({n for n in lengths if 0 < n <= len(token_ids)})
    spans = sorted(media_spans)
    out: dict[int, str] = {}
    hasher = PrefixHasher(salt)
    item = 0
    for n in wanted:
        hasher.extend(token_ids[hasher.num_tokens : n])
        while item < len(spans) and spans[item][0] + spans[item][1] <= n:
            hasher.add_media(spans[item][0], spans[item][2])
            item += 1
        if not any(offset < n < offset + count for offset, count, _ in spans):
            out[n] = hasher.hexdigest()
    return out
