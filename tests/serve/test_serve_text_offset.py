"""Completions ``logprobs.text_offset``: each token's character position in the choice's text, the same in
a stream as in one piece, even while a stop-string check holds text back; characters split over several
byte-level tokens (an emoji) count once, and a skipped special token adds no text. (The echo offset of a
causal_scoring server is checked in test_serve_scoring.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_helpers import MODEL, ScriptProgram, running_server, scripted_engine

from ninfer.serve import BackgroundServer
from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6.frontend import Frontend

# "cat" is held back twice as a possible start of the stop string "cat!" (once released, once completing);
# the emoji and the fraktur letter are each several byte-level tokens
SCRIPT_TEXT = "🦊 fox and the cat sat; 𝔘 the cat! gone"
STOP = "cat!"
PROMPT = "Once"  # a generation server gives no prompt log-probs, so no echo here


@pytest.fixture(scope="module")
def frontend(tiny_artifact: Path) -> Frontend:
    return load_frontend(str(tiny_artifact))


@pytest.fixture(scope="module")
def server(frontend: Frontend) -> Iterator[BackgroundServer]:
    script = frontend.encode(SCRIPT_TEXT)
    program = ScriptProgram(script=script, eos=frontend.eos_token_ids[0], max_context=256, page_size=16,
                            kv_pages=64)
    with running_server(scripted_engine(program, frontend), frontend) as srv:
        yield srv


def _request(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 64, "logprobs": 0, "temperature": 0, **extra}


def _whole(server: BackgroundServer, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _streamed(server: BackgroundServer, body: dict[str, Any]) -> tuple[str, list[str], list[int], list[int]]:
    """(text, tokens, offsets, and per token the length of the text emitted up to its chunk's end)."""
    text, tokens, offsets, emitted = "", [], [], []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            text += choice["text"]
            if choice["logprobs"]:
                tokens += choice["logprobs"]["tokens"]
                offsets += choice["logprobs"]["text_offset"]
                emitted += [len(text)] * len(choice["logprobs"]["tokens"])
    return text, tokens, offsets, emitted


def _check_offsets(text: str, start: int, tokens: list[str], offsets: list[int], frontend: Frontend) -> None:
    assert offsets[0] == start and offsets == sorted(offsets)
    fragments = [i for i, tok in enumerate(tokens) if "\ufffd" in tok]
    assert len(fragments) >= 4  # the fox and the fraktur U: byte fragments, shown as U+FFFD in `tokens`
    for i, (token, offset) in enumerate(zip(tokens, offsets)):
        if token.startswith("\ufffd"):  # continues or starts a split character: that character's offset
            assert text[offset] in "🦊𝔘", (i, offset)
        elif "\ufffd" in token:  # whole characters, then the start of a split one
            whole = token.rstrip("\ufffd")
            assert text[offset : offset + len(whole)] == whole and text[offset + len(whole)] in "🦊𝔘"
        elif offset + len(token) <= len(text):  # whole tokens inside the text are found where they say
            assert text[offset : offset + len(token)] == token, (i, token, offset)
    fox = tokens.index(" fox")
    assert offsets[fox] == start + len("🦊")  # not start + 3: the emoji is one character, not three tokens


def test_stream_offsets_equal_whole_offsets_with_stop_hold_back(
    server: BackgroundServer, frontend: Frontend
) -> None:
    body = _request(stop=[STOP])
    whole = _whole(server, body)
    expected_text = SCRIPT_TEXT[: SCRIPT_TEXT.index(STOP)]
    assert whole["text"] == expected_text and whole["finish_reason"] == "stop"
    lps = whole["logprobs"]
    text, tokens, offsets, emitted = _streamed(server, body)
    assert (text, tokens, offsets) == (whole["text"], lps["tokens"], lps["text_offset"])
    cat = tokens.index(" cat")  # "cat" may start "cat!": its chunk emits the space and holds "cat" back
    assert emitted[cat] < offsets[cat] + len(" cat") <= emitted[cat + 1]
    _check_offsets(whole["text"], 0, tokens, offsets, frontend)
    # the tokens the stop string cut off start where the text ends, and after it
    assert tokens[-2:] == [" cat", "!"] and offsets[-2:] == [len(expected_text) - 1, len(expected_text) + 3]


def test_skipped_end_of_text_adds_no_text(server: BackgroundServer, frontend: Frontend) -> None:
    body = _request()
    whole = _whole(server, body)
    assert whole["text"] == SCRIPT_TEXT and whole["finish_reason"] == "stop"
    lps = whole["logprobs"]
    _check_offsets(whole["text"], 0, lps["tokens"], lps["text_offset"], frontend)
    # the end-of-text token is listed but adds no text: it starts at the end of the text
    assert lps["tokens"][-1] == frontend.decode([frontend.eos_token_ids[0]], skip_special_tokens=False)
    assert lps["text_offset"][-1] == len(whole["text"])
    text, tokens, offsets, _ = _streamed(server, body)
    assert (text, tokens, offsets) == (whole["text"], lps["tokens"], lps["text_offset"])
