"""Text tokenizer: the Hugging Face `tokenizers` runtime over the package's ``tokenizer.json``.

The Qwen3.5/3.6 tokenizer is byte-level BPE with an NFC normaliser and 33 added special tokens.
Special-token strings inside input text are parsed as the special tokens (as the official tokenizer
and ``apply_chat_template`` + encode do); no BOS/EOS is ever added.

`tokenizers` takes the added tokens out of a text before anything else runs (for added tokens that are
not normalised and strip nothing, as all of Qwen's are), and encodes each piece between them on its own.
So an encoding is the concatenation of its pieces' encodings, and a piece seen before need not be
encoded again: a chat client resends the whole conversation every turn, and without the piece cache a
20,000-token history costs about 80 ms of BPE on every turn, in the request's TTFT.
"""

from __future__ import annotations

import functools
import operator
import re
import threading
from collections import OrderedDict
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
# pieces (text between added tokens) at least this long are remembered with their ids
PIECE_CACHE_MIN_CHARS = 64
# the remembered pieces hold at most this many token ids in all (least recently used go first)
PIECE_CACHE_TOKENS = 1 << 22


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
        # the split `tokenizers` makes first (module docstring), where it is a plain string match
        plain = all(not (t.normalized or t.lstrip or t.rstrip or t.single_word) for t in added.values())
        self._added_id = {content: i for i, content in self._added_text.items()}
        contents = sorted(self._added_id, key=len, reverse=True)
        self._added_split = re.compile("|".join(map(re.escape, contents))) if plain and contents else None
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._piece_tokens = 0
        self._pieces_lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        if self._added_split is None or len(text) < 2 * PIECE_CACHE_MIN_CHARS:
            return self._encode_batch([text])[0]
        pieces: list[str | int] = []  # text pieces and added-token ids, in order
        start = 0
        for match in self._added_split.finditer(text):
            if match.start() > start:
                pieces.append(text[start : match.start()])
            pieces.append(self._added_id[match.group()])
            start = match.end()
        if start < len(text):
            pieces.append(text[start:])
        with self._pieces_lock:
            known = {p: self._pieces[p] for p in pieces if isinstance(p, str) and p in self._pieces}
            for piece in known:
                self._pieces.move_to_end(piece)
        missing = list(dict.fromkeys(p for p in pieces if isinstance(p, str) and p not in known))
        if missing:
            fresh = dict(zip(missing, map(tuple, self._encode_batch(missing))))
            self._remember({p: ids for p, ids in fresh.items() if len(p) >= PIECE_CACHE_MIN_CHARS})
            known.update(fresh)
        out: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                out.append(piece)
            else:
                out.extend(known[piece])
        return out

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch releases the GIL while it tokenizes, encode holds it throughout: one long text
        # would stall every other Python thread (the HTTP server's event loop) until it is done
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def _remember(self, pieces: dict[str, tuple[int, ...]]) -> None:
        with self._pieces_lock:
            for piece, ids in pieces.items():
                if piece not in self._pieces and len(ids) <= PIECE_CACHE_TOKENS:
                    self._pieces[piece] = ids
                    self._piece_tokens += len(ids)
            while self._piece_tokens > PIECE_CACHE_TOKENS:
                _, ids = self._pieces.popitem(last=False)
                self._piece_tokens -= len(ids)

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
