"""PreparedPrompt construction: content identity and the thinking state the prompt leaves open."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ninfer.targets.qwen3_6.frontend.types import PreparedImage, PreparedPrompt
from ninfer.targets.qwen3_6.variant import SpecialTokens

_DIGEST_DOMAIN = b"ninfer.qwen3_6.prompt.v1\0"


def prompt_digest(token_ids: Sequence[int], media: Sequence[bytes] = ()) -> str:
    """sha256 hex over the ids (u32 little-endian) and each media identity (length-prefixed).

    Two prompts with equal ids but different images must not share a prefix, so media identity is part
    of the digest; the domain prefix keeps it apart from any other hash in the system.
    """
    h = hashlib.sha256(_DIGEST_DOMAIN)
    h.update(len(token_ids).to_bytes(8, "little"))
    h.update(b"".join(int(i).to_bytes(4, "little") for i in token_ids))
    for m in media:
        h.update(len(m).to_bytes(8, "little"))
        h.update(m)
    return h.hexdigest()


def _last_index(ids: Sequence[int], value: int) -> int:
    for pos in range(len(ids) - 1, -1, -1):
        if ids[pos] == value:
            return pos
    return -1


def prompt_opens_thinking(token_ids: Sequence[int], special: SpecialTokens) -> bool:
    """True when the last turn of the prompt has a ``<think>`` with no ``</think>`` after it.

    The Qwen3.6 generation prompt ends ``<|im_start|>assistant\\n<think>\\n`` (thinking on) or
    ``...<think>\\n\\n</think>\\n\\n`` (thinking off); a ``<think>`` of an earlier turn does not count.
    """
    last_open = _last_index(token_ids, special.think_open)
    if last_open < 0:
        return False
    return last_open > _last_index(token_ids, special.think_close) and last_open > _last_index(
        token_ids, special.im_start
    )


def make_prepared_prompt(
    token_ids: Sequence[int],
    special: SpecialTokens,
    tools: Sequence[Mapping[str, Any]] | None = None,
    media: Sequence[bytes] = (),
    chat: bool = False,
    images: Sequence[PreparedImage] = (),
    mrope: tuple[np.ndarray, int] | None = None,
) -> PreparedPrompt:
    """``images``' digests join ``media`` in the content identity; ``mrope`` is (positions, delta)."""
    ids = tuple(int(i) for i in token_ids)
    media = [*media, *(bytes.fromhex(image.digest) for image in images)]
    positions, delta = mrope if mrope is not None else (None, 0)
    return PreparedPrompt(
        token_ids=ids,
        digest=prompt_digest(ids, media),
        opens_thinking=prompt_opens_thinking(ids, special),
        tools=tuple(copy.deepcopy(dict(t)) for t in tools) if tools else None,
        chat=chat,
        images=tuple(images),
        mrope_positions=positions,
        mrope_delta=delta,
    )
