"""The demo model's tokenizer: byte-level BPE trained with `tokenizers` on the training corpus.

It keeps everything of the Qwen3.6 tokenizer except its vocabulary: the NFC normaliser, the Qwen
pre-tokenizer regex (digits split one by one) followed by byte-level mapping, the byte-level decoder, and
the 33 Qwen3.6 special tokens under the same strings and in the same order, appended at the end of the
vocabulary. So the real chat template and the thinking / tool-call output parsing work unchanged; only
the ids differ (`ninfer.targets.qwen3_6_demo.SPECIAL`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

from ninfer.targets.qwen3_6.frontend.tokenizer import SPECIAL_TOKEN_STRINGS
from ninfer.targets.qwen3_6.variant import SpecialTokens

# The Qwen3.5/3.6 tokenizer_config.json added_tokens_decoder, in id order (ids 248044..248076 there).
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)

# The Qwen3.5/3.6 pre-tokenizer regex (tokenizer_config.json "pretokenize_regex").
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3.5/3.6 tokenizer_config.json entries naming tokens by string (kept so HF loaders behave alike).
_ADDITIONAL_SPECIAL = QWEN_SPECIAL_TOKENS[1:14]
_EXTRA_SPECIAL = {
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "audio_token": "<|audio_pad|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}


def empty_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE with the Qwen3.6 normaliser, pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE(dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def _with_qwen_decoder(tok: Tokenizer) -> Tokenizer:
    """Set the decoder's flags as Qwen's tokenizer.json has them (the Python ByteLevel decoder takes none;
    they do not change decoding, but the file then matches the real one)."""
    doc = json.loads(tok.to_str())
    doc["decoder"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return Tokenizer.from_str(json.dumps(doc))


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train BPE on ``texts`` to ``vocab_size`` ids in total, the 33 special tokens being the last ones.

    The BPE part holds the 256 byte symbols plus ``vocab_size - 256 - 33`` merges; the special tokens
    are added after training so they take ids ``vocab_size - 33 ..`` in the Qwen order. Raises
    ValueError when the corpus is too small to learn that many merges (the ids would not line up).
    """
    bpe_size = vocab_size - len(QWEN_SPECIAL_TOKENS)
    if bpe_size <= 256:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for merges after 256 bytes and 33 specials")
    tok = empty_tokenizer()
    trainer = BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=min_frequency,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    learned = tok.get_vocab_size(with_added_tokens=False)
    if learned != bpe_size:
        raise ValueError(f"the corpus yields only {learned} BPE tokens, {bpe_size} wanted; lower vocab_size")
    tok.add_special_tokens(
        [
            AddedToken(t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
            for t in QWEN_SPECIAL_TOKENS
        ]
    )
    return _with_qwen_decoder(tok)


def special_tokens_of(tok: Tokenizer) -> SpecialTokens:
    """The `SpecialTokens` ids this tokenizer gives the strings the engine must know."""
    ids: dict[str, int] = {}
    for field, token in SPECIAL_TOKEN_STRINGS.items():
        token_id = tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no {token}")
        ids[field] = token_id
    return SpecialTokens(**ids, eos=(ids["im_end"], ids["endoftext"]))


def tokenizer_config(tok: Tokenizer, chat_template: str) -> dict[str, Any]:
    """A transformers tokenizer_config.json shaped like Qwen3.6's, with this tokenizer's ids."""
    added = tok.get_added_tokens_decoder()
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t.content,
                "lstrip": t.lstrip,
                "normalized": t.normalized,
                "rstrip": t.rstrip,
                "single_word": t.single_word,
                "special": t.special,
            }
            for i, t in sorted(added.items())
        },
        "additional_special_tokens": list(_ADDITIONAL_SPECIAL),
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "extra_special_tokens": dict(_EXTRA_SPECIAL),
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "pretokenize_regex": QWEN_PRETOKENIZE_REGEX,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def save_tokenizer(tok: Tokenizer, path: str | Path) -> None:
    """Write tokenizer.json in a stable, compact form (the file ships inside the artifact)."""
    doc = json.loads(tok.to_str())
    Path(path).write_text(json.dumps(doc, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(path))
