"""The official `openai` client (sync and async) against `ninfer serve`'s app on the tiny dense package
(random weights, real Qwen3.6 tokenizer and chat template), over real HTTP."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from serve_helpers import MODEL, running_server

from ninfer import Engine, EngineConfig
from ninfer.serve import BackgroundServer
from ninfer.serve.protocol import ChatCompletionChunk, ChatCompletionResponse, CompletionResponse
from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6.frontend import Frontend

torch.set_num_threads(1)

MAX_CONTEXT = 160
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@functools.cache
def frontend_of(path: str) -> Frontend:
    return load_frontend(path)


@pytest.fixture(scope="module")
def frontend(tiny_artifact: Path) -> Frontend:
    return frontend_of(str(tiny_artifact))


@pytest.fixture(scope="module")
def server(tiny_artifact: Path, frontend: Frontend) -> Iterator[BackgroundServer]:
    config = EngineConfig(
        device="cpu",
        max_concurrency=2,
        queue_capacity=8,
        max_context=MAX_CONTEXT,
        page_size=16,
        cuda_graphs=False,
        warmup=False,
    )
    with running_server(lambda: Engine(tiny_artifact, config), frontend) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _stream_text(chunks: Any) -> tuple[str, str, str | None, Any, int]:
    """(content, reasoning, finish_reason, usage, number of content/reasoning chunks) of a chat stream."""
    content, reasoning, finish, usage, pieces = [], [], None, None, 0
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
                pieces += 1
            extra = getattr(delta, "reasoning_content", None)
            if extra:
                reasoning.append(extra)
                pieces += 1
            finish = choice.finish_reason or finish
    return "".join(content), "".join(reasoning), finish, usage, pieces


def test_chat_sync_stream_equals_non_stream(client: openai.OpenAI, frontend: Frontend) -> None:
    args: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=10, seed=11, temperature=0.9)
    full = client.chat.completions.create(**args, logprobs=True, top_logprobs=3)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    reasoning = getattr(choice.message, "reasoning_content", None)
    assert reasoning, "thinking is on by default: the output starts in the reasoning channel"
    # usage counts match the tokenizer: the rendered chat prompt, one logprob entry per generated token
    assert full.usage.prompt_tokens == len(frontend.prepare_chat(MESSAGES).token_ids)
    assert full.usage.completion_tokens == 10 == len(choice.logprobs.content)
    assert full.usage.total_tokens == full.usage.prompt_tokens + 10
    for entry in choice.logprobs.content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob <= tops[0] + 1e-5 <= 1e-5, "the best alternative is at least as likely"

    stream = client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    content, s_reasoning, finish, usage, pieces = _stream_text(stream)
    assert (content, s_reasoning, finish) == (choice.message.content or "", reasoning, "length")
    assert pieces > 1, "the text arrives in several deltas"
    # the same prompt again: the context cache serves its prefix (reported as cached prompt tokens)
    assert usage.prompt_tokens_details.cached_tokens > full.usage.prompt_tokens_details.cached_tokens == 0
    streamed, once = usage.model_dump(), full.usage.model_dump()
    streamed.pop("prompt_tokens_details"), once.pop("prompt_tokens_details")
    assert streamed == once


def test_chat_no_thinking_goes_to_content(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        seed=3,
        temperature=0.0,
        extra_body={
            "chat_template_kwargs": {"enable_thinking": False},
            "top_k": 5,
            "repetition_penalty": 1.1,
        },
    )
    message = out.choices[0].message
    assert message.content and getattr(message, "reasoning_content", None) is None


def test_chat_async_client(server: BackgroundServer) -> None:
    async def main() -> None:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        args: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=8, seed=5)
        full, stream = await asyncio.gather(
            aclient.chat.completions.create(**args), aclient.chat.completions.create(**args, stream=True)
        )
        chunks = [c async for c in stream]
        content, reasoning, finish, _, _ = _stream_text(chunks)
        message = full.choices[0].message
        assert (content, reasoning) == (message.content or "", getattr(message, "reasoning_content", ""))
        assert finish == full.choices[0].finish_reason
        await aclient.close()

    asyncio.run(main())


def test_completions_sync_and_async(
    client: openai.OpenAI, server: BackgroundServer, frontend: Frontend
) -> None:
    prompt = "The capital of France is"
    args: dict[str, Any] = dict(model=MODEL, prompt=prompt, max_tokens=7, seed=21, temperature=1.0)
    full = client.completions.create(**args, logprobs=2)
    choice = full.choices[0]
    assert full.usage.prompt_tokens == len(frontend.encode(prompt))
    assert (
        full.usage.completion_tokens
        == 7
        == len(choice.logprobs.tokens)
        == len(choice.logprobs.token_logprobs)
    )
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset[0] == 0

    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices)
    assert streamed == choice.text

    echoed = client.completions.create(**args, echo=True)
    assert echoed.choices[0].text == prompt + choice.text

    async def main() -> None:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        ids = frontend.encode(prompt)
        batch = await aclient.completions.create(**{**args, "prompt": [ids, ids]})
        assert [c.index for c in batch.choices] == [0, 1]
        assert batch.choices[0].text == batch.choices[1].text == choice.text  # same tokens, same seed
        assert batch.usage.prompt_tokens == 2 * len(ids)
        stream = await aclient.completions.create(**{**args, "prompt": [prompt, prompt]}, stream=True)
        texts = ["", ""]
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.text
        assert texts == [choice.text, choice.text]
        await aclient.close()

    asyncio.run(main())


def test_completion_max_tokens_zero_echoes_prompt(client: openai.OpenAI, frontend: Frontend) -> None:
    out = client.completions.create(model=MODEL, prompt="Just echo", max_tokens=0, echo=True)
    assert out.choices[0].text == "Just echo" and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(frontend.encode("Just echo")) and out.usage.completion_tokens == 0


def test_raw_responses_match_documented_schema(server: BackgroundServer) -> None:
    url = server.url
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "seed": 1, "logprobs": True}
    ChatCompletionResponse.model_validate(
        httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    )
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        ChatCompletionChunk.model_validate_json(event)
    done = httpx.post(
        url + "/v1/completions", json={"prompt": "a b", "max_tokens": 2, "logprobs": 1}, timeout=60
    )
    CompletionResponse.model_validate(done.json())


def test_models_and_tokenizer_endpoints(
    client: openai.OpenAI, server: BackgroundServer, frontend: Frontend
) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")

    url = server.url
    text = "Hello, wörld! 你好"
    tok = httpx.post(url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tok["tokens"] == frontend.encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == MAX_CONTEXT and "".join(tok["token_strs"]).startswith("Hello")
    chat = httpx.post(url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == list(frontend.prepare_chat(MESSAGES).token_ids)
    assert httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
    bad = httpx.post(url + "/detokenize", json={"tokens": [frontend.vocab_size + 5]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert httpx.get(url + "/ready").status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "code", "says"),
    [
        ({"messages": MESSAGES, "n": 9}, 400, "invalid_request", "n=9 exceeds"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
                    }
                ]
            },
            400,
            "invalid_image",
            "remote image URLs are not accepted here",
        ),
        (
            {"messages": [{"role": "user", "content": "hi " * 200}]},
            400,
            "context_length_exceeded",
            "max_context",
        ),
        ({"messages": MESSAGES, "max_tokens": 10_000}, 400, "context_length_exceeded", "lower max_tokens"),
        ({"messages": MESSAGES, "model": "gpt-4o"}, 404, "model_not_found", "gpt-4o"),
        ({"messages": MESSAGES, "temperature": -1}, 400, "invalid_request", "temperature"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request", "messages.0"),
        ({"messages": []}, 400, "invalid_request", "messages"),
        (
            {
                "messages": MESSAGES,
                "tool_choice": {"type": "function", "function": {"name": "g"}},
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            400,
            "invalid_request",
            "tool_choice",
        ),
        (
            {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            400,
            "invalid_request",
            "response_format",
        ),
        (
            {"messages": MESSAGES, "guided_regex": "a(b"},
            400,
            "invalid_request",
            "guided_regex",
        ),
        (
            {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": "yes"}},
            400,
            "invalid_request",
            "enable_thinking",
        ),
    ],
)
def test_chat_errors_are_openai_shaped(
    server: BackgroundServer, body: dict[str, Any], status: int, code: str, says: str
) -> None:
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and says in error["message"] and error["type"]


def test_malformed_json_and_unknown_route(server: BackgroundServer) -> None:
    bad = httpx.post(
        server.url + "/v1/completions",
        content=b'{"prompt": "x", ',
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    nan = httpx.post(
        server.url + "/v1/completions",
        content=b'{"prompt": "x", "temperature": NaN}',
        headers={"content-type": "application/json"},
    )
    assert nan.status_code == 400
    missing = httpx.get(server.url + "/v2/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError, match="echo"):
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).completions.create(
            model=MODEL, prompt="x", echo=True, logprobs=1, max_tokens=1
        )
