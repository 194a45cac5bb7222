"""Incremental, UTF-8-safe detokenization (the prefix-offset scheme vLLM uses).

A character may span several byte-level tokens; decoding each token alone would emit U+FFFD halves.
The detokenizer keeps a short window of regular tokens: ``decode(window[:read])`` is text already
emitted, ``decode(window)`` is that plus the candidate new text, which is emitted only when it does not
end in an incomplete character. Special tokens are emitted whole, as separate pieces, so the caller can
route or drop them by id.

State is a few immutable fields, so ``copy()`` is cheap: the output session copies it for every preview.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

from ninfer.targets.qwen3_6.frontend.tokenizer import TextTokenizer

_REPLACEMENT = "\ufffd"
# a UTF-8 character has at most 4 bytes and every token at least 1, so a tail of 4 or more held tokens
# that still ends incomplete is invalid UTF-8 and is emitted (with U+FFFD) instead of held forever
_MAX_HELD_TOKENS = 4


class Piece(NamedTuple):
    """Decoded text and, for an added special token, its id (None for regular text)."""

    text: str
    special_id: int | None = None


class IncrementalDetokenizer:
    __slots__ = ("_tok", "_window", "_read")

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tok = tokenizer
        self._window: tuple[int, ...] = ()  # regular tokens from the prefix offset on
        self._read = 0  # window[:read] is already emitted (kept as decoding context)

    def copy(self) -> IncrementalDetokenizer:
        return copy.copy(self)

    def step(self, token_id: int) -> list[Piece]:
        """The text pieces that become final once ``token_id`` is appended."""
        special = self._tok.added_token_text(token_id)
        if special is not None:
            pieces = self.flush()
            pieces.append(Piece(special, token_id))
            return pieces
        if not 0 <= token_id < self._tok.vocab_size:
            return []  # a row of the embedding with no token (vocab padding): no text
        window = self._window + (token_id,)
        prefix_text = self._tok.decode(window[: self._read])
        new_text = self._tok.decode(window)
        held = len(window) - self._read
        if len(new_text) > len(prefix_text) and (
            not new_text.endswith(_REPLACEMENT) or held >= _MAX_HELD_TOKENS
        ):
            self._window = window[self._read :]
            self._read = len(self._window)
            return [Piece(new_text[len(prefix_text) :])]
        self._window = window
        return []

    def flush(self) -> list[Piece]:
        """Emit held tokens even if incomplete (a special token or the end follows, so they never will be)."""
        if len(self._window) == self._read:
            self._window, self._read = (), 0
            return []
        prefix_text = self._tok.decode(self._window[: self._read])
        new_text = self._tok.decode(self._window)
        self._window, self._read = (), 0
        return [Piece(new_text[len(prefix_text) :])] if len(new_text) > len(prefix_text) else []
