"""The demo tokenizer: Qwen3.6 pipeline and special tokens, trained vocabulary, round trips, chat template."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from demo_helpers import FIXTURES, special_for_vocab
from ninfer_tools.train_demo.corpus import stdlib_root
from ninfer_tools.train_demo.tokenizer import (
    QWEN_PRETOKENIZE_REGEX,
    QWEN_SPECIAL_TOKENS,
    load_tokenizer,
    save_tokenizer,
    special_tokens_of,
    tokenizer_config,
    train_tokenizer,
)
from tokenizers import Tokenizer

from ninfer.targets.qwen3_6.frontend.chat_template import ChatTemplate
from ninfer.targets.qwen3_6.frontend.frontend import Frontend
from ninfer.targets.qwen3_6.frontend.tokenizer import TextTokenizer
from ninfer.targets.qwen3_6.resources import RESOURCE_DIR
from ninfer.targets.qwen3_6_demo import PACKAGE

VOCAB = PACKAGE.variant.vocab_size
ROUND_TRIP_TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "x = 1234567890 + 3.14e-10\r\n\tprint(f'{x!r:>10}')  # 注释 comment\n",
    "Ünïcödé ÅÄÖ café naïve — “quotes” 🐍🚀 \u0000 \x7f ﬁ",
    "e\u0301 decomposed vs \u00e9 composed; Hangul \u1100\u1161",  # NFC changes these
    "   \n\n\n    trailing spaces   \n",
    "",
]


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A tokenizer of the demo's exact size trained on 30 stdlib modules (~0.8 MB), saved and reloaded."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(stdlib_root().glob("*.py"))[:30]]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    save_tokenizer(train_tokenizer(texts, VOCAB), path)
    return load_tokenizer(path)


def test_special_tokens_are_qwen36s_in_order() -> None:
    config = json.loads((FIXTURES / "tokenizer_config.json").read_text(encoding="utf-8"))
    real = [
        v["content"] for _, v in sorted(config["added_tokens_decoder"].items(), key=lambda kv: int(kv[0]))
    ]
    assert list(QWEN_SPECIAL_TOKENS) == real
    assert config["pretokenize_regex"] == QWEN_PRETOKENIZE_REGEX


def test_pipeline_equals_the_real_qwen_tokenizer(demo_tokenizer: Tokenizer) -> None:
    """Normaliser, pre-tokenizer, decoder and post-processor are the real tokenizer.json's, byte for byte."""
    ours = json.loads(demo_tokenizer.to_str())
    real = json.loads((RESOURCE_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    for key in ("normalizer", "pre_tokenizer", "decoder", "post_processor"):
        assert ours[key] == real[key], key
    assert ours["model"]["type"] == "BPE" and ours["model"]["byte_fallback"] is False


def test_vocabulary_layout(demo_tokenizer: Tokenizer) -> None:
    assert demo_tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB
    first = VOCAB - len(QWEN_SPECIAL_TOKENS)
    for i, token in enumerate(QWEN_SPECIAL_TOKENS):
        assert demo_tokenizer.token_to_id(token) == first + i
    added = demo_tokenizer.get_added_tokens_decoder()
    assert sorted(added) == list(range(first, VOCAB)) and all(t.special for t in added.values())
    # byte-level: all 256 byte symbols are base tokens, and merges fill the rest
    doc = json.loads(demo_tokenizer.to_str())
    assert len(doc["model"]["vocab"]) == first
    assert len(doc["model"]["merges"]) == first - 256


def test_package_special_ids_match_the_tokenizer(demo_tokenizer: Tokenizer) -> None:
    assert special_tokens_of(demo_tokenizer) == PACKAGE.variant.special == special_for_vocab(VOCAB)
    TextTokenizer(demo_tokenizer.to_str()).check_special(PACKAGE.variant.special)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(demo_tokenizer: Tokenizer, text: str) -> None:
    ids = demo_tokenizer.encode(text, add_special_tokens=False).ids
    assert all(0 <= i < VOCAB - len(QWEN_SPECIAL_TOKENS) for i in ids)  # no special from plain text
    assert demo_tokenizer.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_code_compresses_and_digits_split(demo_tokenizer: Tokenizer) -> None:
    """Trained merges do real work on Python (several bytes per token); digits stay one per token."""
    text = (stdlib_root() / "textwrap.py").read_text(encoding="utf-8")
    ids = demo_tokenizer.encode(text, add_special_tokens=False).ids
    assert len(text.encode()) / len(ids) > 2.5
    assert demo_tokenizer.encode("x = 2024", add_special_tokens=False).tokens[-4:] == ["2", "0", "2", "4"]


def test_chat_template_output_uses_special_ids(demo_tokenizer: Tokenizer) -> None:
    """The real Qwen3.6 chat template renders unchanged and its markers encode as single special ids."""
    template = ChatTemplate((RESOURCE_DIR / "qwen3_6.jinja").read_text(encoding="utf-8"))
    messages = [
        {"role": "user", "content": "Write fib."},
        {"role": "assistant", "content": "<think>\nshort\n</think>\n\ndef fib(n): ..."},
    ]
    rendered = template.render(messages) + template.render(messages[:1], add_generation_prompt=True)
    ids = demo_tokenizer.encode(rendered, add_special_tokens=False).ids
    s = PACKAGE.variant.special
    assert ids.count(s.im_start) == 4 and ids.count(s.im_end) == 3
    assert ids.count(s.think_open) == 2 and ids.count(s.think_close) == 1
    assert demo_tokenizer.decode(ids, skip_special_tokens=False) == rendered


def test_frontend_accepts_the_tokenizer_and_config(demo_tokenizer: Tokenizer, tmp_path: Path) -> None:
    template = (RESOURCE_DIR / "qwen3_6.jinja").read_text(encoding="utf-8")
    config = tokenizer_config(demo_tokenizer, template)
    assert config["chat_template"] == template
    assert config["added_tokens_decoder"][str(PACKAGE.variant.special.im_end)]["content"] == "<|im_end|>"
    frontend = Frontend(
        TextTokenizer(demo_tokenizer.to_str()), ChatTemplate(template), PACKAGE.variant.special, {}
    )
    assert frontend.eos_token_ids == PACKAGE.variant.special.eos


def test_too_small_corpus_is_refused() -> None:
    with pytest.raises(ValueError, match="BPE tokens"):
        train_tokenizer(["a tiny corpus"], 1024)
