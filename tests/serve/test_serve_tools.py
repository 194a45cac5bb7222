"""Tool calls: a scripted model says the official Qwen3-Coder XML; the real Qwen3.6 Frontend parses it and
the gateway returns OpenAI ``tool_calls`` (streamed and not). Malformed XML comes back as content."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from serve_helpers import MODEL, ScriptProgram, running_server, scripted_engine

from ninfer.serve import BackgroundServer
from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6.frontend import Frontend

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
REASONING = "The user wants a forecast."
CALL_XML = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
# a parameter that never closes: not a complete call, so it must stay content
BROKEN_XML = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"


@functools.cache
def frontend_of(path: str) -> Frontend:
    return load_frontend(path)


def _script(frontend: Frontend, answer: str) -> list[int]:
    """Model output after the generation prompt (which opened <think>): reasoning, close, answer, end."""
    im_end = frontend.encode("<|im_end|>")
    return frontend.encode(f"{REASONING}\n</think>\n\n{answer}") + im_end


@pytest.fixture(scope="module")
def servers(tiny_artifact: Path) -> Iterator[dict[str, BackgroundServer]]:
    frontend = frontend_of(str(tiny_artifact))
    out: dict[str, BackgroundServer] = {}
    room = {"max_context": 1024, "page_size": 16, "kv_pages": 256}  # the tools system prompt is long
    with (
        running_server(
            scripted_engine(ScriptProgram(_script(frontend, CALL_XML), **room), frontend), frontend
        ) as good,
        running_server(
            scripted_engine(ScriptProgram(_script(frontend, BROKEN_XML), **room), frontend), frontend
        ) as bad,
    ):
        out["call"], out["broken"] = good, bad
        yield out


def _client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_tool_call_non_streamed(servers: dict[str, BackgroundServer]) -> None:
    out = _client(servers["call"]).chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert getattr(choice.message, "reasoning_content", None) == REASONING
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}  # typed by the schema


def test_tool_call_streamed(servers: dict[str, BackgroundServer]) -> None:
    stream = _client(servers["call"]).chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True
    )
    calls: dict[int, dict[str, Any]] = {}
    content, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = entry["id"] or d.id
                entry["name"] = entry["name"] or (d.function.name if d.function else None)
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert list(calls) == [0]
    assert calls[0]["id"] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}


def test_tool_call_feeds_back_as_history(servers: dict[str, BackgroundServer]) -> None:
    """The returned assistant message (with tool_calls) and a tool result are valid next-turn input."""
    client = _client(servers["call"])
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS).choices[0].message
    history = [
        *MESSAGES,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"forecast": "sunny"}'},
    ]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert again.choices[0].finish_reason == "tool_calls"


def test_malformed_xml_is_content(servers: dict[str, BackgroundServer]) -> None:
    client = _client(servers["broken"])
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
    choice = full.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == BROKEN_XML
    streamed = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == BROKEN_XML


def test_tool_choice_none_leaves_xml_unparsed(servers: dict[str, BackgroundServer]) -> None:
    out = _client(servers["call"]).chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none"
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == CALL_XML
