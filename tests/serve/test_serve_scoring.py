"""Prompt log-probs through ``/v1/completions`` (echo + logprobs) on a ``causal_scoring`` server equal
transformers' log-softmax for the same weights (tiny dense package, one scoring window and several); top
alternatives equal transformers' top-k; ``max_tokens: 1`` appends transformers' argmax next token, which
is the exact request lm-eval-harness ``local-completions`` sends for log-likelihoods."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from serve_helpers import MODEL, ScriptedScoringProgram, running_server
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
def oracle_log_softmax(ids: tuple[int, ...]) -> torch.Tensor:
    """``[len(ids), vocab]`` log-softmax from transformers, full context: row i predicts token i + 1."""
    model = hf_causal_lm("qwen3_6_tiny")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def oracle_logprobs(ids: tuple[int, ...]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 from transformers, full context."""
    lp = oracle_log_softmax(ids)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def oracle_top(frontend: Frontend, row: torch.Tensor, k: int, chosen: int | None) -> dict[str, float]:
    """The completions ``top_logprobs`` entry transformers implies: the top-k token texts (first text
    wins), plus the chosen token itself."""
    values, ids = row.topk(k)
    out: dict[str, float] = {}
    for token_id, value in zip(ids.tolist(), values.tolist()):
        out.setdefault(frontend.decode([token_id]), value)
    if chosen is not None:
        out.setdefault(frontend.decode([chosen]), float(row[chosen]))
    return out


def assert_top_equal(got: dict[str, float], want: dict[str, float]) -> None:
    assert list(got) == list(want)
    assert list(got.values()) == pytest.approx(list(want.values()), abs=ATOL)


def greedy_continuation(ids: list[int], steps: int) -> list[int]:
    """Tokens transformers' argmax produces after ``ids``."""
    out = list(ids)
    for _ in range(steps):
        out.append(int(oracle_log_softmax(tuple(out))[-1].argmax()))
    return out[len(ids) :]


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
    rows = oracle_log_softmax(tuple(ids))
    for i in range(1, len(ids)):  # logprobs: 1 -> the most likely token plus the prompt token itself
        assert_top_equal(lps["top_logprobs"][i], oracle_top(frontend, rows[i - 1], 1, ids[i]))
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
    assert first["logprobs"]["top_logprobs"][1] == {  # logprobs: 0 -> the prompt token alone
        frontend.decode([short[1]]): first["logprobs"]["token_logprobs"][1]
    }
    got = second["logprobs"]["token_logprobs"]
    n = len(long)
    assert STRIDE + WINDOW < n < 2 * STRIDE + WINDOW  # windows [0, W), [S, S + W), then [n - W, n)
    assert got[1:WINDOW] == pytest.approx(oracle_logprobs(tuple(long[:WINDOW])), abs=ATOL)
    # tokens past the first window were scored by the window starting at STRIDE
    middle = oracle_logprobs(tuple(long[STRIDE : STRIDE + WINDOW]))
    assert got[WINDOW : STRIDE + WINDOW] == pytest.approx(middle[WINDOW - STRIDE - 1 :], abs=ATOL)
    # the rest by the last window, aligned to the end of the text (a full window, not one from 2 * STRIDE)
    tail = oracle_logprobs(tuple(long[n - WINDOW :]))
    assert got[STRIDE + WINDOW :] == pytest.approx(tail[STRIDE + 2 * WINDOW - n - 1 :], abs=ATOL)
    assert out["usage"]["prompt_tokens"] == len(short) + len(long)


def test_long_text_alternatives_and_next_token_come_from_their_windows(
    server: BackgroundServer, frontend: Frontend
) -> None:
    ids = frontend.encode(TEXT + " " + TEXT)
    n = len(ids)
    last_start = n - WINDOW  # the window ending at the last token holds a full window of context
    assert n > STRIDE + WINDOW, "the text spans three windows"
    body = _score(server, prompt=ids, echo=True, logprobs=3, max_tokens=1, temperature=0).json()
    lps = body["choices"][0]["logprobs"]
    assert len(lps["tokens"]) == n + 1
    second = oracle_log_softmax(tuple(ids[STRIDE : STRIDE + WINDOW]))  # scores tokens WINDOW..STRIDE+WINDOW-1
    for t in (WINDOW, STRIDE + WINDOW - 1):
        assert_top_equal(lps["top_logprobs"][t], oracle_top(frontend, second[t - STRIDE - 1], 3, ids[t]))
    last = oracle_log_softmax(tuple(ids[last_start:]))[-1]
    greedy = int(last.argmax())
    assert lps["tokens"][-1] == frontend.decode([greedy])
    assert lps["token_logprobs"][-1] == pytest.approx(float(last.max()), abs=ATOL)
    assert_top_equal(lps["top_logprobs"][-1], oracle_top(frontend, last, 3, greedy))
    assert body["usage"]["completion_tokens"] == 1


def test_top_alternatives_equal_transformers_topk(server: BackgroundServer, frontend: Frontend) -> None:
    ids = frontend.encode("Hello there, general Kenobi")
    k = 5
    lps = _score(server, prompt=ids, echo=True, logprobs=k, max_tokens=0).json()["choices"][0]["logprobs"]
    rows = oracle_log_softmax(tuple(ids))
    assert lps["top_logprobs"][0] is None and len(lps["top_logprobs"]) == len(ids)
    for i in range(1, len(ids)):
        assert_top_equal(lps["top_logprobs"][i], oracle_top(frontend, rows[i - 1], k, ids[i]))


def _lm_eval_loglikelihood(choice: dict[str, Any], ctxlen: int) -> tuple[float, bool]:
    """What lm-eval-harness ``local-completions`` (``LocalCompletionsAPI.parse_logprobs``) computes from
    one choice: the continuation's summed log-prob (entries ``ctxlen`` up to, excluding, the last, which
    is the one generated token) and whether each continuation token's log-prob equals (``==``) the best
    value in its ``top_logprobs``."""
    lps = choice["logprobs"]
    cont = lps["token_logprobs"][ctxlen:-1]
    tops = lps["top_logprobs"][ctxlen:-1]
    return sum(cont), all(lp == max(top.values()) for lp, top in zip(cont, tops))


def _lm_eval_payload(prompt: Any) -> dict[str, Any]:
    """Exactly what ``LocalCompletionsAPI._create_payload(generate=False)`` sends."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }


def test_lm_eval_local_completions_request(server: BackgroundServer, frontend: Frontend) -> None:
    context = frontend.encode("The quick brown fox")
    plain = frontend.encode(" jumps over")
    greedy = greedy_continuation(context, 3)  # what the model itself would continue with
    assert any(int(oracle_log_softmax(tuple(context + plain[:i]))[-1].argmax()) != plain[i] for i in range(2))
    inputs = [context + plain, context + greedy]  # lm-eval batches token lists (batch_size > 1)
    response = httpx.post(server.url + "/v1/completions", json=_lm_eval_payload(inputs), timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 2
    for choice, ids in zip(sorted(body["choices"], key=lambda c: c["index"]), inputs):
        lps = choice["logprobs"]
        assert len(lps["tokens"]) == len(lps["token_logprobs"]) == len(lps["top_logprobs"]) == len(ids) + 1
        rows = oracle_log_softmax(tuple(ids))
        total, is_greedy = _lm_eval_loglikelihood(choice, len(context))
        want = [float(rows[i - 1, ids[i]]) for i in range(len(context), len(ids))]
        assert total == pytest.approx(sum(want), abs=ATOL)
        want_greedy = all(int(rows[i - 1].argmax()) == ids[i] for i in range(len(context), len(ids)))
        assert is_greedy == want_greedy
        # the dropped last entry is the greedy next token, with its text appended to the echo
        next_id = int(rows[-1].argmax())
        assert lps["tokens"][-1] == frontend.decode([next_id])
        assert lps["token_logprobs"][-1] == pytest.approx(float(rows[-1].max()), abs=ATOL)
        assert choice["text"] == frontend.decode(ids) + frontend.decode([next_id])
        assert choice["finish_reason"] == "length"
    # the continuation from transformers' argmax is greedy, the hand-written one is not
    assert [_lm_eval_loglikelihood(c, len(context))[1] for c in body["choices"]] == [False, True]


def test_lm_eval_text_prompt(server: BackgroundServer, frontend: Frontend) -> None:
    """``tokenized_requests=False``: lm-eval sends the decoded text; ctxlen still counts its tokens."""
    context, continuation = "The quick brown fox", " jumps over"
    response = httpx.post(server.url + "/v1/completions", json=_lm_eval_payload(context + continuation))
    assert response.status_code == 200, response.text
    ids = frontend.encode(context + continuation)
    ctxlen = len(frontend.encode(context))
    total, _ = _lm_eval_loglikelihood(response.json()["choices"][0], ctxlen)
    assert total == pytest.approx(sum(oracle_logprobs(tuple(ids))[ctxlen - 1 :]), abs=ATOL)


def test_scoring_server_refuses_generation_clearly(server: BackgroundServer) -> None:
    chat = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert chat.status_code == 400 and "causal_scoring" in chat.json()["error"]["message"]
    gen = _score(server, prompt="x", max_tokens=5)
    assert gen.status_code == 400 and gen.json()["error"]["code"] == "wrong_purpose"
    two = _score(server, prompt="x y", echo=True, logprobs=1, max_tokens=2, temperature=0)
    assert two.status_code == 400 and "max_tokens: 1 with temperature: 0" in two.json()["error"]["message"]
    sampled = _score(server, prompt="x y", echo=True, logprobs=1, max_tokens=1)  # the model's default temp
    error = sampled.json()["error"]
    assert sampled.status_code == 400 and error["param"] == "temperature"
    assert "temperature: 0" in error["message"]
    stop = _score(server, prompt="x y", echo=True, logprobs=1, max_tokens=1, temperature=0, stop=["z"])
    assert stop.status_code == 400 and stop.json()["error"]["param"] == "stop"
    streamed = _score(server, prompt="x y", echo=True, logprobs=1, max_tokens=0, stream=True)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"


def test_end_of_text_prediction_finishes_with_stop(frontend: Frontend) -> None:
    """A scripted scoring Program predicts ``last + 1``: ending the prompt right before an EOS id makes the
    greedy token EOS, so the choice stops, its text has no special token, and the entry is still there."""
    eos = frontend.eos_token_ids[0]
    engine = Engine.from_parts(
        ScriptedScoringProgram(max_context=16),
        frontend,
        EngineConfig(purpose="causal_scoring", score_window=16, score_stride=8, warmup=False),
    )
    prompt = [*frontend.encode("Hi"), eos - 1]
    request = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0}
    with running_server(engine, frontend) as srv:
        body = _score(srv, **request).json()
        shown = _score(srv, **request, skip_special_tokens=False).json()
        ignored = _score(srv, **request, ignore_eos=True)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == frontend.decode(prompt)
    assert choice["logprobs"]["tokens"][-1] == frontend.decode([eos], skip_special_tokens=False)
    assert choice["logprobs"]["token_logprobs"][-1] == -float(len(prompt))  # the scripted next-token value
    assert shown["choices"][0]["text"].endswith(frontend.decode([eos], skip_special_tokens=False))
    assert ignored.json()["choices"][0]["finish_reason"] == "length"
