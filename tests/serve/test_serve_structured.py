"""Structured outputs over HTTP on the bundled demo model: the official ``openai`` client for
``response_format`` json_schema and ``tools`` + ``tool_choice="required"`` (and a named function), raw
httpx for vLLM's ``guided_*`` extras and the ``structured_outputs`` object on chat and completions, and
400s naming the field for what is refused or malformed (never a 200 that ignored the field)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from serve_helpers import MODEL, running_server

from ninfer import Engine, EngineConfig
from ninfer.cli.common import bundled_artifact
from ninfer.serve import BackgroundServer
from ninfer.targets.open import load_frontend

pytest.importorskip("llguidance")

NO_THINKING = {"enable_thinking": False}
MESSAGES = [{"role": "user", "content": "Answer."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "minLength": 1, "maxLength": 12},
                    "days": {"type": "integer", "minimum": 1, "maximum": 5},
                },
                "required": ["city", "days"],
            },
        },
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    path = bundled_artifact()
    config = EngineConfig(device="cpu", max_concurrency=4, max_context=1024, warmup=False)
    with running_server(lambda: Engine(path, config), load_frontend(path)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server: BackgroundServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)


def test_openai_response_format_json_schema(client: openai.OpenAI) -> None:
    for seed in range(3):
        out = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=64,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
            },
            extra_body={"chat_template_kwargs": NO_THINKING},
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_openai_json_object_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=96,
        temperature=0,
        stream=True,
        response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": NO_THINKING},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.startswith("{")


def test_openai_tools_with_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            max_tokens=80,
            seed=1,
            extra_body={"chat_template_kwargs": NO_THINKING},
        )
        result = out.choices[0]
        assert result.finish_reason == "tool_calls"
        calls = result.message.tool_calls or []
        assert len(calls) == 1
        call = calls[0].function  # type: ignore[union-attr]
        if isinstance(choice, dict):
            assert call.name == "get_weather"
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.name)
        jsonschema.validate(json.loads(call.arguments), schema)


def test_guided_extras_on_chat_and_completions(server: BackgroundServer) -> None:
    cases = [
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        ({"guided_regex": "[a-z]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[a-z]{3}-[0-9]{2}", t) or 1 / 0),
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green") or 1 / 0),
        ({"guided_grammar": 'root ::= "n=" [0-9]'}, lambda t: re.fullmatch("n=[0-9]", t) or 1 / 0),
        ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        ({"structured_outputs": {"regex": "x{1,3}y"}}, lambda t: re.fullmatch("x{1,3}y", t) or 1 / 0),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down") or 1 / 0),
        ({"structured_outputs": {"grammar": 'start: "ok" "!"?'}}, lambda t: re.fullmatch("ok!?", t) or 1 / 0),
    ]
    def both(extra: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
        body = {"messages": MESSAGES, "max_tokens": 48, "chat_template_kwargs": NO_THINKING, **extra}
        chat = post(server, "/v1/chat/completions", body)
        return chat, post(server, "/v1/completions", {"prompt": "def f():", "max_tokens": 48, **extra})

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(both, [extra for extra, _ in cases]))
    for (extra, check), (chat, done) in zip(cases, answers):
        assert chat.status_code == 200, (extra, chat.text)
        check(chat.json()["choices"][0]["message"]["content"])
        assert done.status_code == 200, (extra, done.text)
        check(done.json()["choices"][0]["text"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_json": {"type": "nope"}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_grammar": "start: missing"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
          "schema": {"type": "object", "not": {"required": ["a"]}}}}}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(server: BackgroundServer, body: dict[str, Any], param: str) -> None:
    response = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error


def test_completions_refuse_a_constraint_without_generation(server: BackgroundServer) -> None:
    response = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0, "guided_regex": "a"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "guided_regex"
