"""The hostile-but-fair request set of the hardening issue, kept as data: every case is one HTTP request
(or a raw-socket behaviour) and the statuses an answer may have. ``tests/serve/test_serve_hostile.py``
replays it in CI; ``tests/serve/hostile_probe.py`` replays it while timing ``GET /health``.

Bodies are built on demand (a 100 MiB body is not kept in memory longer than its request).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

MIB = 1 << 20
USER = {"role": "user", "content": "hi"}


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Callable[[], bytes]  # the raw body bytes (JSON unless the case is about malformed JSON)
    statuses: frozenset[int]  # what a correct server may answer
    param: str | None = None  # the error's param, when the case is about one field


def nested_object(depth: int) -> str:
    return '{"x":' * (depth - 1) + "{}" + "}" * (depth - 1)


def raw(text: str) -> Callable[[], bytes]:
    return lambda: text.encode("utf-8", "surrogatepass")


def js(value: object) -> Callable[[], bytes]:
    return lambda: json.dumps(value).encode()


def chat(**fields: object) -> Callable[[], bytes]:
    return js({"messages": [USER], "max_tokens": 4, **fields})


def completion(**fields: object) -> Callable[[], bytes]:
    return js({"prompt": "hi", "max_tokens": 4, **fields})


def _deep_chat(where: str, depth: int) -> Callable[[], bytes]:
    deep = nested_object(depth)
    bodies = {
        "kwargs": '{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": %s}',
        "tool": '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
        '"function": {"name": "f", "parameters": {"type": "object", "properties": %s}}}]}',
        "call": '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", '
        '"tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": %s}}]}, '
        '{"role": "tool", "tool_call_id": "c", "content": "ok"}]}',
    }
    return raw(bodies[where] % deep)


def _deep_tokenize() -> bytes:
    return (
        '{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": '
        + nested_object(1000)
        + "}"
    ).encode()


def _ids(value: str, count: int, key: str = "prompt") -> Callable[[], bytes]:
    """``{key: [value, value, ...]}`` with ``count`` entries, built when sent."""
    return lambda: f'{{"{key}": [{",".join([value] * count)}]}}'.encode()


def _text(size: int, where: str) -> Callable[[], bytes]:
    """A chat message or completion prompt of ``size`` bytes of text, built when sent."""

    def build() -> bytes:
        text = ("a b " * (size // 4 + 1))[:size]
        if where == "chat":
            return json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
        return json.dumps({"prompt": text}).encode()

    return build


BAD_REQUEST = frozenset({400})
TOO_LARGE = frozenset({413})


def hostile_cases() -> list[Case]:
    chat_path, completions_path = "/v1/chat/completions", "/v1/completions"
    cases = [
        # nesting: 1,000 deep in every place the issue found, and past orjson's own limit
        Case("nest 1000 chat_template_kwargs", chat_path, _deep_chat("kwargs", 1000), BAD_REQUEST),
        Case("nest 1000 tool parameters.properties", chat_path, _deep_chat("tool", 1000), BAD_REQUEST),
        Case("nest 1000 tool-call arguments", chat_path, _deep_chat("call", 1000), BAD_REQUEST),
        Case(
            "nest 1000 tool-call arguments as a JSON string",
            chat_path,
            js(
                {
                    "messages": [
                        USER,
                        {
                            "role": "assistant",
                            "content": "",
                            "tool_calls": [{"function": {"name": "f", "arguments": nested_object(1000)}}],
                        },
                    ]
                }
            ),
            BAD_REQUEST,
            "messages",
        ),
        Case("nest 5000 (beyond the JSON parser)", chat_path, _deep_chat("kwargs", 5000), BAD_REQUEST),
        Case(
            "nest 1000 /tokenize",
            "/tokenize",
            _deep_tokenize,
            BAD_REQUEST,
        ),
        Case(
            "nest 1000 /tokenize prompt list",
            "/tokenize",
            raw('{"prompt": ' + "[" * 1000 + "]" * 1000 + "}"),
            BAD_REQUEST,
        ),
        # size: 10 MiB prompts (the context bound), 100 MiB bodies (413), 5M-token id prompts
        Case(
            "10 MiB chat message",
            chat_path,
            _text(10 * MIB, "chat"),
            BAD_REQUEST,
            "messages",
        ),
        Case(
            "10 MiB completion prompt",
            completions_path,
            _text(10 * MIB, "completion"),
            BAD_REQUEST,
            "prompt",
        ),
        Case(
            "10 MiB /tokenize prompt",
            "/tokenize",
            lambda: b'{"prompt": "' + b"x" * (10 * MIB) + b'"}',
            BAD_REQUEST,
            "prompt",
        ),
        Case(
            "100 MiB chat message",
            chat_path,
            _text(100 * MIB, "chat"),
            TOO_LARGE,
        ),
        Case(
            "5M-token id prompt (small ids)",
            completions_path,
            _ids("1", 5_000_000),
            BAD_REQUEST,
            "prompt",
        ),
        Case(
            "5M-token id prompt (large ids)",
            completions_path,
            _ids("151643", 5_000_000),
            TOO_LARGE,
        ),
        Case(
            "5M ids to /detokenize",
            "/detokenize",
            _ids("7", 5_000_000, "tokens"),
            BAD_REQUEST,
            "tokens",
        ),
        Case(
            "1M one-token prompts",
            completions_path,
            _ids("[1]", 1_000_000),
            BAD_REQUEST,
        ),
        Case(
            "one prompt of a context's worth of ids",
            completions_path,
            _ids("1", 300_000),
            BAD_REQUEST,
            "prompt",
        ),
        # vocabulary and field naming
        Case(
            "out-of-vocabulary stop_token_ids",
            chat_path,
            chat(stop_token_ids=[10**9]),
            BAD_REQUEST,
            "stop_token_ids",
        ),
        Case(
            "out-of-vocabulary prompt id",
            completions_path,
            js({"prompt": [1, 2, 10**9]}),
            BAD_REQUEST,
            "prompt",
        ),
        Case(
            "batch: the second prompt bad",
            completions_path,
            js({"prompt": [[1, 2], [10**9]]}),
            BAD_REQUEST,
            "prompt[1]",
        ),
        Case(
            "batch: the second prompt too long",
            completions_path,
            js({"prompt": ["short", "a b " * 100_000], "max_tokens": 2}),
            BAD_REQUEST,
            "prompt[1]",
        ),
        Case("max_tokens beyond the context", chat_path, chat(max_tokens=10**6), BAD_REQUEST, "messages"),
        Case("out-of-vocabulary /detokenize", "/detokenize", js({"tokens": [10**9]}), BAD_REQUEST, "tokens"),
        # malformed JSON and schema violations
        Case("empty body", chat_path, raw(""), BAD_REQUEST),
        Case("not JSON", chat_path, raw("hello"), BAD_REQUEST),
        Case("truncated JSON", chat_path, raw('{"messages": [{"role": "user"'), BAD_REQUEST),
        Case(
            "NaN",
            chat_path,
            raw('{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
            BAD_REQUEST,
        ),
        Case("Infinity", completions_path, raw('{"prompt": "hi", "top_p": Infinity}'), BAD_REQUEST),
        Case(
            "lone surrogate",
            chat_path,
            raw('{"messages": [{"role": "user", "content": "\\ud800"}]}'),
            BAD_REQUEST,
        ),
        Case(
            "invalid UTF-8",
            chat_path,
            lambda: b'{"messages": [{"role": "user", "content": "\xff"}]}',
            BAD_REQUEST,
        ),
        Case("a JSON list", chat_path, js([1, 2]), BAD_REQUEST),
        Case("a JSON string", chat_path, js("messages"), BAD_REQUEST),
        Case("messages not a list", chat_path, js({"messages": "hi"}), BAD_REQUEST, "messages"),
        Case("no messages", chat_path, js({"messages": []}), BAD_REQUEST, "messages"),
        Case("unknown role", chat_path, js({"messages": [{"role": "robot", "content": "x"}]}), BAD_REQUEST),
        Case("content a number", chat_path, js({"messages": [{"role": "user", "content": 5}]}), BAD_REQUEST),
        Case("temperature a string", chat_path, chat(temperature="hot"), BAD_REQUEST, "temperature"),
        Case("negative temperature", chat_path, chat(temperature=-1), BAD_REQUEST, "temperature"),
        Case("top_p 0", chat_path, chat(top_p=0), BAD_REQUEST, "top_p"),
        Case("seed 2**64", chat_path, chat(seed=2**64), BAD_REQUEST, "seed"),
        Case("max_tokens 0 (chat)", chat_path, chat(max_tokens=0), BAD_REQUEST, "max_tokens"),
        Case("max_tokens a float", chat_path, chat(max_tokens=1.5), BAD_REQUEST, "max_tokens"),
        Case("n beyond max_concurrency", chat_path, chat(n=9), BAD_REQUEST, "n"),
        Case("n 0", chat_path, chat(n=0), BAD_REQUEST, "n"),
        Case("unknown field", chat_path, chat(frobnicate=1), BAD_REQUEST, "frobnicate"),
        Case(
            "unknown completions field",
            completions_path,
            completion(guided_frob=1),
            BAD_REQUEST,
            "guided_frob",
        ),
        Case("prompt_logprobs", chat_path, chat(prompt_logprobs=1), BAD_REQUEST, "prompt_logprobs"),
        Case("chat_template", chat_path, chat(chat_template="{{ x }}"), BAD_REQUEST, "chat_template"),
        Case("guided_json", chat_path, chat(guided_json={"type": "nothing"}), BAD_REQUEST, "guided_json"),
        Case("logit_bias key not an id", chat_path, chat(logit_bias={"abc": 1}), BAD_REQUEST, "logit_bias"),
        Case("logit_bias value 101", chat_path, chat(logit_bias={"1": 101}), BAD_REQUEST, "logit_bias"),
        Case(
            "min_tokens > max_tokens", chat_path, chat(min_tokens=9, max_tokens=2), BAD_REQUEST, "min_tokens"
        ),
        Case("min_tokens negative", chat_path, chat(min_tokens=-1), BAD_REQUEST, "min_tokens"),
        Case(
            "continue_final_message after a user turn",
            chat_path,
            chat(continue_final_message=True),
            BAD_REQUEST,
            "continue_final_message",
        ),
        Case(
            "reasoning_effort unknown",
            chat_path,
            chat(reasoning_effort="max"),
            BAD_REQUEST,
            "reasoning_effort",
        ),
        Case("top_logprobs 21", chat_path, chat(logprobs=True, top_logprobs=21), BAD_REQUEST, "top_logprobs"),
        Case("empty stop string", chat_path, chat(stop=[""]), BAD_REQUEST, "stop"),
        Case("stop_token_ids negative", chat_path, chat(stop_token_ids=[-1]), BAD_REQUEST),
        Case("thinking_budget 0", chat_path, chat(thinking_budget=0), BAD_REQUEST, "thinking_budget"),
        Case(
            "chat_template_kwargs sets messages",
            chat_path,
            chat(chat_template_kwargs={"messages": []}),
            BAD_REQUEST,
            "chat_template_kwargs",
        ),
        Case(
            "enable_thinking a string",
            chat_path,
            chat(chat_template_kwargs={"enable_thinking": "no"}),
            BAD_REQUEST,
            "chat_template_kwargs",
        ),
        Case(
            "image content",
            chat_path,
            js(
                {
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                    ]
                }
            ),
            BAD_REQUEST,
        ),
        Case(
            "tool_choice required, no tools",
            chat_path,
            chat(tool_choice="required"),
            BAD_REQUEST,
            "tool_choice",
        ),
        Case(
            "response_format bad schema",
            chat_path,
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no"}},
                }
            ),
            BAD_REQUEST,
            "response_format",
        ),
        Case(
            "system message last",
            chat_path,
            js({"messages": [USER, {"role": "system", "content": "x"}]}),
            BAD_REQUEST,
            "messages",
        ),
        Case("empty prompt", completions_path, js({"prompt": ""}), BAD_REQUEST, "prompt"),
        Case("empty prompt list", completions_path, js({"prompt": []}), BAD_REQUEST, "prompt"),
        Case("prompt of mixed kinds", completions_path, js({"prompt": [1, "a"]}), BAD_REQUEST),
        Case("negative prompt id", completions_path, js({"prompt": [-1]}), BAD_REQUEST),
        Case("suffix", completions_path, completion(suffix="x"), BAD_REQUEST, "suffix"),
        Case(
            "logit_bias outside the vocabulary",
            completions_path,
            completion(logit_bias={"999999999": 5}),
            BAD_REQUEST,
            "logit_bias",
        ),
        Case("best_of 2", completions_path, completion(best_of=2), BAD_REQUEST, "best_of"),
        Case(
            "echo with logprobs (generation server)",
            completions_path,
            completion(echo=True, logprobs=1),
            BAD_REQUEST,
            "echo",
        ),
        Case("model unknown", chat_path, chat(model="gpt-9"), frozenset({404}), "model"),
        Case(
            "/tokenize both prompt and messages",
            "/tokenize",
            js({"prompt": "a", "messages": [USER]}),
            BAD_REQUEST,
            "prompt",
        ),
    ]
    return cases
