"""Prompt log-probs through ``/v1/completions`` (echo + logprobs) on a ``causal_scoring`` server equal
transformers' log-softmax for the same weights (tiny dense package, one scoring window and several)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from serve_helpers import MODEL, running_server
from tiny_artifacts import hf_causal_lm

from ninfer import Engine, EngineConfig
from ninfer.serve import BackgroundServer
from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6.frontend import Frontend

torch.set_num_threads(1)

WINDOW, STRIDE = 24, 16
TEXT = "The quick brown fox jumps over the lazy dog, and then it naps in the warm afternoon sun."
ATOL = 2e-4


@functools.cache
def frontend_of(path: str) -> Frontend:
    return load_frontend(path)


@functools.cache
def oracle_logprobs(ids: tuple[int, ...]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 from transformers, full context."""
    model = hf_causal_lm("qwen3_6_tiny")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


@pytest.fixture(scope="module")
def frontend(tiny_artifact: Path) -> Frontend:
    return frontend_of(str(tiny_artifact))


@pytest.fixture(scope="module")
def server(tiny_artifact: Path, frontend: Frontend) -> Iterator[BackgroundServer]:
    config = EngineConfig(
        purpose="causal_scoring", device="cpu", score_window=WINDOW, score_stride=STRIDE, page_size=8
    )
    with running_server(lambda: Engine(tiny_artifact, config), frontend) as srv:
        yield srv


def _score(server: BackgroundServer, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=120)


def test_prompt_logprobs_equal_transformers(server: BackgroundServer, frontend: Frontend) -> None:
    ids = frontend.encode(TEXT)
    assert len(ids) <= WINDOW, "one window: every token has its full context"
    out = _score(server, prompt=TEXT, echo=True, logprobs=1, max_tokens=0)
    assert out.status_code == 200, out.text
    body = out.json()
    choice = body["choices"][0]
    lps = choice["logprobs"]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert lps["tokens"] == [frontend.decode([i]) for i in ids]
    assert "".join(lps["tokens"]) == TEXT and lps["text_offset"][-1] == len(TEXT) - len(lps["tokens"][-1])
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    want = oracle_logprobs(tuple(ids))
    assert lps["token_logprobs"][1:] == pytest.approx(want, abs=ATOL)
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_batch_of_token_prompts_and_long_text(server: BackgroundServer, frontend: Frontend) -> None:
    short = frontend.encode("Hello there")
    long = frontend.encode(TEXT + " " + TEXT)  # longer than one window: later tokens come from later windows
    assert len(long) > WINDOW
    out = _score(server, prompt=[short, long], echo=True, logprobs=0, max_tokens=0).json()
    first, second = out["choices"]
    assert (first["index"], second["index"]) == (0, 1)
    assert first["logprobs"]["token_logprobs"][1:] == pytest.approx(oracle_logprobs(tuple(short)), abs=ATOL)
    got = second["logprobs"]["token_logprobs"]
    assert got[1:WINDOW] == pytest.approx(oracle_logprobs(tuple(long[:WINDOW])), abs=ATOL)
    # tokens past the first window were scored by the window starting at STRIDE
    tail = oracle_logprobs(tuple(long[STRIDE : STRIDE + WINDOW]))
    assert got[WINDOW : STRIDE + WINDOW] == pytest.approx(tail[WINDOW - STRIDE - 1 :], abs=ATOL)
    assert out["usage"]["prompt_tokens"] == len(short) + len(long)


def _lm_eval_loglikelihood(choice: dict[str, Any], ctxlen: int) -> tuple[float, bool]:
    """What lm-eval-harness ``local-completions`` computes from one choice: the continuation's summed
    log-prob (entries ``ctxlen`` up to, excluding, the last, which is the one generated token) and
    whether every continuation token was the greedy one."""
    lps = choice["logprobs"]
    cont = lps["token_logprobs"][ctxlen:-1]
    tops = lps["top_logprobs"][ctxlen:-1]
    return sum(cont), all(lp == max(top.values()) for lp, top in zip(cont, tops))


@pytest.mark.xfail(
    strict=True,
    reason="lm-eval sends max_tokens=1 and drops the last entry as the generated token; Engine.score gives "
    "no next-token distribution, so a causal_scoring server cannot produce that token (nor top alternatives "
    "for is_greedy) and refuses max_tokens=1",
)
def test_lm_eval_local_completions_request(server: BackgroundServer, frontend: Frontend) -> None:
    context, continuation = frontend.encode("The quick brown fox"), frontend.encode(" jumps over")
    payload = {  # exactly what LocalCompletionsAPI._create_payload sends for a log-likelihood request
        "model": MODEL,
        "prompt": [context + continuation],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    response = httpx.post(server.url + "/v1/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    total, _ = _lm_eval_loglikelihood(response.json()["choices"][0], len(context))
    want = oracle_logprobs(tuple(context + continuation))[len(context) - 1 :]
    assert total == pytest.approx(sum(want), abs=ATOL)


def test_scoring_server_refuses_generation_clearly(server: BackgroundServer) -> None:
    chat = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert chat.status_code == 400 and "causal_scoring" in chat.json()["error"]["message"]
    gen = _score(server, prompt="x", max_tokens=5)
    assert gen.status_code == 400 and gen.json()["error"]["code"] == "wrong_purpose"
    one = _score(server, prompt="x y", echo=True, logprobs=1, max_tokens=1)
    assert one.status_code == 400 and "max_tokens: 0" in one.json()["error"]["message"]
