"""Text tokenizer: the Hugging Face `tokenizers` runtime over the package's ``tokenizer.json``.

The Qwen3.5/3.6 tokenizer is byte-level BPE with an NFC normaliser and 33 added special tokens.
Special-token strings inside input text are parsed as the special tokens (as the official tokenizer
and ``apply_chat_template`` + encode do); no BOS/EOS is ever added.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer

from ninfer.targets.qwen3_6.variant import SpecialTokens

# SpecialTokens field -> the token string that field must map to in tokenizer.json
SPECIAL_TOKEN_STRINGS: dict[str, str] = {
    "endoftext": "<|endoftext|>",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
    "image_pad": "<|image_pad|>",
    "video_pad": "<|video_pad|>",
    "think_open": "<think>",
    "think_close": "</think>",
}
# NFC normalisation can shrink text before it is tokenized: three 3-byte Hangul jamo compose to one 3-byte
# syllable; no composition shrinks more than that
NFC_MAX_SHRINK = 3


class TextTokenizer:
    """Encode/decode plus the special-token facts the output pipeline needs."""

    def __init__(self, tokenizer_json: bytes | str) -> None:
        text = tokenizer_json.decode("utf-8") if isinstance(tokenizer_json, bytes) else tokenizer_json
        self.json_text = text  # the tokenizer.json text (the grammar engine builds its own tokenizer from it)
        self._tok = Tokenizer.from_str(text)
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        # ids of added tokens marked special: they decode as one unit and are dropped by skip_special_tokens
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added_text: dict[int, str] = {i: t.content for i, t in added.items()}

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it tokenizes, encode holds it throughout: one long text
        # would stall every other Python thread (the HTTP server's event loop) until it is done
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for (every vocabulary string's
        UTF-8 length, which for byte-level BPE is at least the bytes it decodes to), so a text of ``n``
        bytes needs at least ``n / (max_token_bytes * NFC_MAX_SHRINK)`` tokens."""
        return max(len(token.encode("utf-8")) for token in self._tok.get_vocab(with_added_tokens=True))

    def min_tokens(self, n_bytes: int) -> int:
        """Fewest tokens a text of ``n_bytes`` UTF-8 bytes can encode to: a bound checked before the full
        tokenization of an absurdly long text."""
        return n_bytes // (self.max_token_bytes * NFC_MAX_SHRINK)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def added_token_text(self, token_id: int) -> str | None:
        """The string of an added (special) token, or None for an ordinary BPE token."""
        return self._added_text.get(token_id)

    def check_special(self, special: SpecialTokens) -> None:
        """Raise ValueError unless every id in ``special`` is the id this tokenizer gives its token."""
        bad = []
        for name, token in SPECIAL_TOKEN_STRINGS.items():
            want = getattr(special, name)
            got = self.token_id(token)
            if got != want:
                bad.append(f"{token} is {got} in tokenizer.json, {want} in SpecialTokens.{name}")
        for eos in special.eos:
            if not 0 <= eos < self.vocab_size:
                bad.append(f"eos id {eos} is outside the tokenizer vocabulary ({self.vocab_size})")
        if bad:
            raise ValueError("tokenizer.json does not match the package's special tokens: " + "; ".join(bad))

    def validate_ids(self, ids: Iterable[int]) -> tuple[int, ...]:
        """The ids as plain ints; ValueError names the first one that is not a token of this vocabulary."""
        n = self.vocab_size
        out = []
        for pos, i in enumerate(ids):
            try:
                if isinstance(i, bool):
                    raise TypeError
                value = operator.index(i)
            except TypeError:
                raise ValueError(f"token id {i!r} at position {pos} is not an integer") from None
            if not 0 <= value < n:
                raise ValueError(f"token id {value} at position {pos} is outside the vocabulary [0, {n})")
            out.append(value)
        return tuple(out)
