"""Incremental, UTF-8-safe detokenization (the prefix-offset scheme vLLM uses).

A character may span several byte-level tokens; decoding each token alone would emit U+FFFD halves.
The detokenizer keeps a short window of regular tokens: ``decode(window[:read])`` is text already
emitted, ``decode(window)`` is that plus the candidate new text, which is emitted only when it does not
end in an incomplete character. Special tokens are emitted whole, as separate pieces, so the caller can
route or drop them by id.

The prefix text ``decode(window[:read])`` is cached, so a step decodes once instead of twice. While
tokens are held it does not change. After an emission the new prefix is the emitted piece. That holds
because the Qwen3 tokenizer's decoder is byte-level (token bytes concatenated, then a lossy UTF-8
decode). When the old prefix text has no U+FFFD its bytes are complete UTF-8, and UTF-8 restarts at a
character boundary, so ``decode(window) == prefix + decode(window[read:])``. A prefix that contains
U+FFFD gives no such guarantee and is decoded fresh. tests/frontend/test_output_lazy.py checks this
against fresh decodes on random streams.

State is a few immutable fields, so ``copy()`` is cheap: the output session copies it for every preview
that needs text (stop strings).
"""

from __future__ import annotations

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
    __slots__ = ("_tok", "_window", "_read", "_prefix")

    def __init__(
        self,
        tokenizer: TextTokenizer,
        window: tuple[int, ...] = (),
        read: int = 0,
        prefix: str | None = "",
    ) -> None:
        self._tok = tokenizer
        self._window = window  # regular tokens from the prefix offset on
        self._read = read  # window[:read] is already emitted (kept as decoding context)
        self._prefix = prefix  # decode(window[:read]) when known, else None (decoded on demand)

    def copy(self) -> IncrementalDetokenizer:
        # direct construction: copy.copy goes through the generic __reduce_ex__ path (several us)
        return IncrementalDetokenizer(self._tok, self._window, self._read, self._prefix)

    def step(self, token_id: int) -> list[Piece]:
        """The text pieces that become final once ``token_id`` is appended."""
        tok = self._tok
        special = tok.added_token_text(token_id)
        if special is not None:
            pieces = self.flush()
            pieces.append(Piece(special, token_id))
            return pieces
        if not 0 <= token_id < tok.vocab_size:
            return []  # a row of the embedding with no token (vocab padding): no text
        read = self._read
        window = self._window + (token_id,)
        prefix_text = self._prefix
        if prefix_text is None:
            prefix_text = tok.decode(window[:read])
        new_text = tok.decode(window)
        if len(new_text) > len(prefix_text) and (
            not new_text.endswith(_REPLACEMENT) or len(window) - read >= _MAX_HELD_TOKENS
        ):
            piece = new_text[len(prefix_text) :]
            self._window = window[read:]
            self._read = len(self._window)
            # the emitted piece is decode(new window) when the old prefix was complete UTF-8 (module doc)
            self._prefix = piece if _REPLACEMENT not in prefix_text else None
            return [Piece(piece)]
        self._window = window
        self._prefix = prefix_text
        return []

    def flush(self) -> list[Piece]:
        """Emit held tokens even if incomplete (a special token or the end follows, so they never will be)."""
        window, read, prefix_text = self._window, self._read, self._prefix
        self._window, self._read, self._prefix = (), 0, ""
        if len(window) == read:
            return []
        if prefix_text is None:
            prefix_text = self._tok.decode(window[:read])
        new_text = self._tok.decode(window)
        return [Piece(new_text[len(prefix_text) :])] if len(new_text) > len(prefix_text) else []
