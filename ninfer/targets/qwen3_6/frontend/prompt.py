"""PreparedPrompt construction: content identity, the thinking state the prompt leaves open, and the
reuse boundaries of a rendered chat."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ninfer.runtime.contract.identity import ids_bytes
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
    h.update(ids_bytes(token_ids))
    for m in media:
        h.update(len(m).to_bytes(8, "little"))
        h.update(m)
    return h.hexdigest()


def last_index(ids: Sequence[int], value: int) -> int:
    for pos in range(len(ids) - 1, -1, -1):
        if ids[pos] == value:
            return pos
    return -1


def prompt_opens_thinking(token_ids: Sequence[int], special: SpecialTokens) -> bool:
    """True when the last turn of the prompt has a ``<think>`` with no ``</think>`` after it.

    The Qwen3.6 generation prompt ends ``<|im_start|>assistant\\n<think>\\n`` (thinking on) or
    ``...<think>\\n\\n</think>\\n\\n`` (thinking off); a ``<think>`` of an earlier turn does not count.
    """
    last_open = last_index(token_ids, special.think_open)
    if last_open < 0:
        return False
    return last_open > last_index(token_ids, special.think_close) and last_open > last_index(
        token_ids, special.im_start
    )


@dataclass(frozen=True)
class TurnMarkers:
    """The ChatML headers as this tokenizer encodes them. Special tokens split the encoding, and the
    header's ``\\n`` never merges with a following non-space character (the pre-tokenizer isolates
    newlines), which is why a header ends at the same token in every rendering."""

    system_header: tuple[int, ...]  # <|im_start|>system\n
    assistant_header: tuple[int, ...]  # <|im_start|>assistant\n
    turn_end: tuple[int, ...]  # <|im_end|>\n

    @classmethod
    def encoded(cls, encode: Callable[[str], Sequence[int]]) -> TurnMarkers:
        return cls(
            tuple(encode("<|im_start|>system\n")),
            tuple(encode("<|im_start|>assistant\n")),
            tuple(encode("<|im_end|>\n")),
        )


def find_tokens(ids: tuple[int, ...], pattern: tuple[int, ...], start: int) -> int:
    """Index of the first occurrence of ``pattern`` at or after ``start``, -1 if none."""
    head, n = pattern[0], len(pattern)
    while True:
        try:
            i = ids.index(head, start)  # C-speed scan for the header's special token
        except ValueError:
            return -1
        if ids[i : i + n] == pattern:
            return i
        start = i + 1


def chat_boundaries(
    ids: tuple[int, ...], markers: TurnMarkers, images: Sequence[PreparedImage] = ()
) -> tuple[int, ...]:
    """Reuse boundaries of a rendered chat (docs/resources-and-context-cache.md, "Reuse boundaries"):
    after the preamble's ``<|im_end|>\\n`` when the prompt opens with a system turn (system message,
    tools, or the 3.8 reasoning instructions), and after every ``<|im_start|>assistant\\n``, the
    generation prompt's included. A later rendering that appends turns renders everything before an
    assistant body the same (history before it is unchanged, and reasoning the template drops starts
    inside the body), so each is a frontier a later prompt can reuse. Kept to ``1..len(ids)-1`` and out
    of image pads. (Message text that spells a header encodes as one too: a useless hint, no harm.)"""
    found: list[int] = []
    if ids[: len(markers.system_header)] == markers.system_header:
        end = find_tokens(ids, markers.turn_end, 0)
        if end >= 0:
            found.append(end + len(markers.turn_end))
    header = markers.assistant_header
    pos = find_tokens(ids, header, 0)
    while pos >= 0:
        found.append(pos + len(header))
        pos = find_tokens(ids, header, pos + len(header))
    spans = [(image.token_offset, image.token_offset + image.num_tokens) for image in images]
    return tuple(sorted({b for b in found if 0 < b < len(ids) and not any(lo < b < hi for lo, hi in spans)}))


def make_prepared_prompt(
    token_ids: Sequence[int],
    special: SpecialTokens,
    tools: Sequence[Mapping[str, Any]] | None = None,
    media: Sequence[bytes] = (),
    chat: bool = False,
    images: Sequence[PreparedImage] = (),
    mrope: tuple[np.ndarray, int] | None = None,
    boundaries: Sequence[int] = (),
    template_kwargs: Mapping[str, Any] | None = None,
) -> PreparedPrompt:
    """``images``' digests join ``media`` in the content identity; ``mrope`` is (positions, delta)."""
    ids = tuple(map(int, token_ids))
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
        boundaries=tuple(boundaries),
        template_kwargs=copy.deepcopy(dict(template_kwargs)) if template_kwargs is not None else None,
    )
