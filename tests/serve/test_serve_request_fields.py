"""Every accepted request field works or is refused, on the bundled demo model over real HTTP (CPU): the
request models refuse unknown fields by name (bookkeeping fields clients send are accepted); logit_bias
at -100 never yields the token and at +100 always does, greedy and sampled, chat and completions;
min_tokens holds end-of-sequence back; n=4 seeded choices equal four single requests with seed + i,
streamed with choice indices and summed usage; reasoning_effort, continue_final_message; chat_template,
prompt_logprobs and best_of are refused with a 400 that says why."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from serve_helpers import MODEL, running_server

from ninfer import Engine, EngineConfig
from ninfer.cli.common import bundled_artifact
from ninfer.serve import BackgroundServer
from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6.frontend import Frontend

torch.set_num_threads(1)

USER = [{"role": "user", "content": "def fibonacci(n):"}]
NO_THINK = {"enable_thinking": False}
TOKEN = 258


@functools.cache
def demo_frontend() -> Frontend:
    return load_frontend(bundled_artifact())


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    config = EngineConfig(device="cpu", dtype="float32", max_concurrency=4, cuda_graphs=False, warmup=False)
    with running_server(Engine(bundled_artifact(), config), demo_frontend()) as server:
        yield server


def post(server: BackgroundServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def chat(server: BackgroundServer, **body: Any) -> dict[str, Any]:
    body.setdefault("messages", USER)
    body.setdefault("max_tokens", 12)
    body.setdefault("chat_template_kwargs", NO_THINK)
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def completion_ids(server: BackgroundServer, **body: Any) -> list[list[int]]:
    """Each choice's generated token ids (through the logprobs' tokens, re-tokenized per token)."""
    body.setdefault("prompt", "def fibonacci(n):")
    body.setdefault("max_tokens", 12)
    response = post(server, "/v1/completions", {**body, "logprobs": 0})
    assert response.status_code == 200, response.text
    return [[token_id(t) for t in c["logprobs"]["tokens"]] for c in response.json()["choices"]]


@functools.cache
def token_text(token: int) -> str:
    return demo_frontend().decode([token])


def token_id(text: str) -> int:
    ids = demo_frontend().encode(text)
    assert len(ids) == 1, text
    return ids[0]


def refused(response: httpx.Response, param: str, says: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


# ---- closed field lists ----


def test_unknown_fields_refused_by_name(server: BackgroundServer) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "guided_frob": 1}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "typo_temperature": 0}),
        ("/tokenize", {"prompt": "x", "extra": True}),
        ("/detokenize", {"tokens": [1], "extra": True}),
    ):
        unknown = next(k for k in body if k not in ("messages", "max_tokens", "prompt", "tokens"))
        refused(post(server, path, body), unknown, "unknown field")


def test_bookkeeping_fields_accepted(server: BackgroundServer) -> None:
    out = chat(server, user="u-1", metadata={"k": "v"}, store=False, service_tier="auto", max_tokens=2)
    assert out["choices"][0]["finish_reason"] == "length"


def test_refusals_say_why(server: BackgroundServer) -> None:
    refused(
        post(server, "/v1/chat/completions", {"messages": USER, "prompt_logprobs": 1}),
        "prompt_logprobs",
        "--purpose causal_scoring",
    )
    refused(
        post(server, "/v1/chat/completions", {"messages": USER, "chat_template": "{{ messages }}"}),
        "chat_template",
        "per-request chat template",
    )
    refused(post(server, "/v1/completions", {"prompt": "x", "best_of": 3}), "best_of", "best_of")
    refused(post(server, "/v1/chat/completions", {"messages": USER, "n": 5}), "n", "max_concurrency of 4")
    refused(  # structured outputs take guided_regex (docs/structured-outputs.md), not a whitespace pattern
        post(server, "/v1/chat/completions", {"messages": USER, "guided_whitespace_pattern": " "}),
        "guided_whitespace_pattern",
        "",
    )


# ---- logit_bias and min_tokens ----


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completions_logit_bias(server: BackgroundServer, temperature: float) -> None:
    (base,) = completion_ids(server, temperature=temperature, seed=3)
    banned = {str(t): -100 for t in set(base[:4])}
    (out,) = completion_ids(server, temperature=temperature, seed=3, logit_bias=banned)
    assert len(out) == 12 and not {int(t) for t in banned} & set(out)
    (forced,) = completion_ids(server, temperature=temperature, seed=3, logit_bias={str(TOKEN): 100})
    assert forced == [TOKEN] * 12


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_logit_bias(server: BackgroundServer, temperature: float) -> None:
    """Chat logit_bias used to be accepted and ignored: now -100 bans, +100 forces."""
    forced = chat(server, temperature=temperature, seed=5, logit_bias={str(TOKEN): 100}, logprobs=True)
    tokens = [entry["token"] for entry in forced["choices"][0]["logprobs"]["content"]]
    assert tokens == [token_text(TOKEN)] * 12
    base = chat(server, temperature=temperature, seed=5, logprobs=True)
    first = [token_id(e["token"]) for e in base["choices"][0]["logprobs"]["content"][:3]]
    banned = chat(
        server, temperature=temperature, seed=5, logprobs=True, logit_bias={str(t): -100 for t in first}
    )
    out = [token_id(e["token"]) for e in banned["choices"][0]["logprobs"]["content"]]
    assert len(out) == 12 and not set(first) & set(out)


def test_min_tokens(server: BackgroundServer) -> None:
    eos = {str(t): 100 for t in demo_frontend().eos_token_ids}
    now = chat(server, temperature=0, logit_bias=eos)
    assert now["choices"][0]["finish_reason"] == "stop" and now["usage"]["completion_tokens"] <= 1
    held = chat(server, temperature=0, logit_bias=eos, min_tokens=5)
    assert held["choices"][0]["finish_reason"] == "stop"
    assert held["usage"]["completion_tokens"] in (5, 6)  # 5 tokens, then the end of turn (counted or not)


# ---- n ----


def _content(out: dict[str, Any]) -> list[str]:
    return [c["message"]["content"] for c in sorted(out["choices"], key=lambda c: c["index"])]


def test_n_seeded_equals_single_requests(server: BackgroundServer) -> None:
    n4 = chat(server, n=4, seed=100, temperature=1.0)
    singles = [chat(server, seed=100 + i, temperature=1.0) for i in range(4)]
    assert _content(n4) == [_content(s)[0] for s in singles]
    assert len(set(_content(n4))) > 1  # independent samples, not one answer four times
    assert n4["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    assert n4["usage"]["prompt_tokens"] == 4 * singles[0]["usage"]["prompt_tokens"]


def test_n_streamed_with_indices(server: BackgroundServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    texts = ["", "", ""]
    finished, usage = set(), None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=12, n=3, seed=7, temperature=1.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"chat_template_kwargs": NO_THINK},
    ):  # fmt: skip
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
    whole = chat(server, n=3, seed=7, temperature=1.0)
    assert texts == _content(whole) and finished == {0, 1, 2}
    assert usage is not None and usage.completion_tokens == whole["usage"]["completion_tokens"]


def test_completions_n(server: BackgroundServer) -> None:
    response = post(
        server, "/v1/completions", {"prompt": ["def a():", "class B:"], "n": 2, "seed": 9, "max_tokens": 6}
    )
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(["def a():", "class B:"]):
        for j in range(2):
            single = post(
                server, "/v1/completions", {"prompt": prompt, "seed": 9 + j, "max_tokens": 6}
            ).json()
            assert choices[2 * i + j]["text"] == single["choices"][0]["text"]


# ---- chat template switches ----


def test_reasoning_effort(server: BackgroundServer) -> None:
    off = chat(server, temperature=0, reasoning_effort="none", chat_template_kwargs={})
    plain_off = chat(server, temperature=0, chat_template_kwargs={"enable_thinking": False})
    assert off["choices"][0]["message"] == plain_off["choices"][0]["message"]
    assert off["usage"]["prompt_tokens"] == plain_off["usage"]["prompt_tokens"]
    on = chat(server, temperature=0, reasoning_effort="high", chat_template_kwargs={})
    plain_on = chat(server, temperature=0, chat_template_kwargs={})
    assert on["usage"]["prompt_tokens"] == plain_on["usage"]["prompt_tokens"] != off["usage"]["prompt_tokens"]
    refused(
        post(
            server,
            "/v1/chat/completions",
            {"messages": USER, "reasoning_effort": "low", "chat_template_kwargs": NO_THINK},
        ),
        "reasoning_effort",
        "contradicts",
    )


def test_continue_final_message(server: BackgroundServer) -> None:
    """The reply continues the assistant's text: the same tokens as the raw rendered prompt left open."""
    messages = [*USER, {"role": "assistant", "content": "if n < 2:"}]
    out = chat(
        server, messages=messages, temperature=0, continue_final_message=True, add_generation_prompt=False
    )
    text = demo_frontend().render_chat(messages, add_generation_prompt=False, enable_thinking=False)
    assert text.endswith("if n < 2:<|im_end|>\n")
    raw = post(
        server,
        "/v1/completions",
        {"prompt": text[: -len("<|im_end|>\n")], "max_tokens": 12, "temperature": 0},
    )
    assert out["choices"][0]["message"]["content"] == raw.json()["choices"][0]["text"]
    kwargs = {"continue_final_message": True, **NO_THINK}
    body = {"messages": messages, "add_generation_prompt": False, "chat_template_kwargs": kwargs}
    tokenized = post(server, "/tokenize", body)
    assert tokenized.json()["count"] == out["usage"]["prompt_tokens"]
    refused(
        post(
            server,
            "/v1/chat/completions",
            {"messages": messages, "continue_final_message": True, "add_generation_prompt": True},
        ),
        "continue_final_message",
        "add_generation_prompt",
    )
    assert json.dumps(out)  # the answer is plain JSON
