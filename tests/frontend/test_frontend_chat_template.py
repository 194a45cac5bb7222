"""Chat-template rendering: the 8 saved renders byte for byte, thinking flags, tools, multi-turn reasoning
(checked against transformers' own renderer), and the sandbox/globals transformers provides."""

from __future__ import annotations

import copy
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ninfer.targets.qwen3_6.frontend import (
    ChatTemplate,
    ChatTemplateError,
    Frontend,
    SpecialTokens,
    TextTokenizer,
)
from ninfer.targets.qwen3_6.resources import RESOURCE_DIR

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CASES: dict[str, Any] = json.loads((FIXTURES / "render_cases.json").read_text(encoding="utf-8"))
TEMPLATES = {n: (RESOURCE_DIR / f"{n}.jinja").read_text(encoding="utf-8") for n in ("qwen3_6", "qwen3_8")}

WEATHER_TOOL = CASES["c"]["tools"][0]


def weather_call(city: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city, "days": 1}}}


# multi-turn: reasoning given three ways (reasoning_content, inline <think> in content, "reasoning" alias),
# a tool round with two calls and two results, then a new user query and a final assistant answer
MULTI_TURN: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "reasoning_content": "Two cities, two calls.",
        "content": "",
        "tool_calls": [weather_call("Paris"), weather_call("Rome")],
    },
    {"role": "tool", "content": '{"temp_c": 18}'},
    {"role": "tool", "content": '{"temp_c": 24}'},
    {"role": "assistant", "content": "<think>\nRome is warmer.\n</think>\n\nParis 18°C, Rome 24°C."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "reasoning": "Need another call.", "content": "Let me check."},
]


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer((RESOURCE_DIR / "tokenizer.json").read_bytes())


@pytest.fixture(scope="module")
def frontends(tokenizer: TextTokenizer) -> dict[str, Frontend]:
    return {n: Frontend(tokenizer, ChatTemplate(src), SpecialTokens(), {}) for n, src in TEMPLATES.items()}


def hf_render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """transformers' own renderer, the reference these templates are written for."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("name", ["qwen3_6", "qwen3_8"])
@pytest.mark.parametrize("case", ["a", "b", "c", "d"])
def test_saved_renders_byte_exact(name: str, case: str, frontends: dict[str, Frontend]) -> None:
    expected = (FIXTURES / f"{name}.render_{case}.txt").read_bytes()
    c = CASES[case]
    messages = copy.deepcopy(c["messages"])
    direct = ChatTemplate(TEMPLATES[name]).render(messages, tools=c.get("tools"), **c["kwargs"])
    assert direct.encode("utf-8") == expected
    via_frontend = frontends[name].render_chat(messages, tools=c.get("tools"), **c["kwargs"])
    assert via_frontend.encode("utf-8") == expected
    assert messages == c["messages"]  # the caller's messages are never touched


def test_enable_thinking_generation_prompt(frontends: dict[str, Frontend]) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    fe = frontends["qwen3_6"]
    assert fe.render_chat(msgs).endswith("<|im_start|>assistant\n<think>\n")
    off = fe.render_chat(msgs, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert fe.render_chat(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    p_on, p_off = fe.prepare_chat(msgs), fe.prepare_chat(msgs, enable_thinking=False)
    assert p_on.opens_thinking and not p_off.opens_thinking
    assert fe.decode(p_on.token_ids) == fe.render_chat(msgs)
    assert p_on.token_ids[-2:] == (248068, 198) and p_on.tools is None


@pytest.mark.parametrize("name", ["qwen3_6", "qwen3_8"])
@pytest.mark.parametrize("preserve", [None, True, False])
@pytest.mark.parametrize("thinking", [True, False])
def test_multi_turn_matches_transformers(
    name: str, preserve: bool | None, thinking: bool, frontends: dict[str, Frontend]
) -> None:
    kwargs: dict[str, Any] = {"enable_thinking": thinking}
    if preserve is not None:
        kwargs["preserve_thinking"] = preserve
    ours = frontends[name].render_chat(
        MULTI_TURN,
        tools=[WEATHER_TOOL],
        add_generation_prompt=False,
        preserve_thinking=preserve,
        enable_thinking=thinking,
    )
    assert ours == hf_render(TEMPLATES[name], MULTI_TURN, tools=[WEATHER_TOOL], **kwargs)


def test_multi_turn_reasoning_semantics(frontends: dict[str, Frontend]) -> None:
    fe36, fe38 = frontends["qwen3_6"], frontends["qwen3_8"]
    plain = fe36.render_chat(MULTI_TURN, tools=[WEATHER_TOOL], add_generation_prompt=False)
    # 3.6: reasoning of turns before the last user query is dropped, the turn after it keeps its reasoning
    assert "Two cities" not in plain and "Rome is warmer" not in plain
    assert "<|im_start|>assistant\nParis 18°C, Rome 24°C.<|im_end|>" in plain
    assert "<|im_start|>assistant\n<think>\nNeed another call.\n</think>\n\nLet me check.<|im_end|>" in plain
    # two calls, then two tool results merged into one user turn
    assert (
        "<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n1\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
    ) in plain
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 18}\n</tool_response>\n<tool_response>\n' in plain
    kept = fe36.render_chat(
        MULTI_TURN, tools=[WEATHER_TOOL], add_generation_prompt=False, preserve_thinking=True
    )
    assert "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\n<tool_call>" in kept
    assert "<think>\nRome is warmer.\n</think>\n\nParis 18°C" in kept
    # 3.8 keeps past reasoning by default and drops it only with preserve_thinking=False
    assert "Two cities, two calls." in fe38.render_chat(MULTI_TURN, add_generation_prompt=False)
    dropped = fe38.render_chat(MULTI_TURN, add_generation_prompt=False, preserve_thinking=False)
    assert "Two cities, two calls." not in dropped
    assert "<|im_start|>system\nReasoning effort is set to low." in fe38.render_chat(
        MULTI_TURN, reasoning_effort="low"
    )


def test_string_arguments_and_reasoning_alias(frontends: dict[str, Frontend]) -> None:
    c = copy.deepcopy(CASES["c"])
    expected = (FIXTURES / "qwen3_6.render_c.txt").read_text(encoding="utf-8")
    fn = c["messages"][2]["tool_calls"][0]["function"]
    fn["arguments"] = json.dumps(fn["arguments"])  # OpenAI clients send a JSON string
    assert frontends["qwen3_6"].render_chat(c["messages"], tools=c["tools"]) == expected
    a = [{"role": "user", "content": "q"}, {"role": "assistant", "reasoning_content": "R", "content": "A"}]
    b = [{"role": "user", "content": "q"}, {"role": "assistant", "reasoning": "R", "content": "A"}]
    assert frontends["qwen3_6"].render_chat(a) == frontends["qwen3_6"].render_chat(b)
    assert "<think>\nR\n</think>\n\nA" in frontends["qwen3_6"].render_chat(b)


def test_template_errors_are_clear(frontends: dict[str, Frontend]) -> None:
    fe = frontends["qwen3_6"]
    with pytest.raises(ChatTemplateError, match="No messages provided"):
        fe.render_chat([])
    with pytest.raises(ChatTemplateError, match="System message must be at the beginning"):
        fe.render_chat([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="System message cannot contain images"):
        fe.render_chat([{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="Unexpected message role"):
        fe.render_chat([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(ValueError, match="must be acquired and decoded first"):  # raw image parts
        fe.prepare_chat(CASES["d"]["messages"])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% if %}")


def test_globals_filters_and_sandbox() -> None:
    t = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':')) }}")
    x = {"a": "é<b>", "n": [1, 2]}
    assert t.render([], x=x) == "|".join(
        [
            json.dumps(x, ensure_ascii=False),
            json.dumps(x, ensure_ascii=False, indent=2),
            json.dumps(x, ensure_ascii=False, separators=(",", ":")),
        ]
    )
    year = ChatTemplate("{{ strftime_now('%Y') }}").render([])
    assert year in {str(datetime.now().year - 1), str(datetime.now().year)}
    loop = "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    assert ChatTemplate(loop).render([]) == "01"  # loopcontrols
    assert ChatTemplate("{{ dict(a=1)['a'] }}{% set ns = namespace(v=2) %}{{ ns.v }}").render([]) == "12"
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.append(1) }}").render(msgs)  # immutable sandbox
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ raise_exception('nope') }}").render(msgs)
    assert msgs == [{"role": "user", "content": "hi"}]
    # trim_blocks + lstrip_blocks: block lines leave no whitespace behind
    assert ChatTemplate("  {% if true %}\nA\n  {% endif %}\nB").render([]) == "A\nB"
    # rich objects reach the template only as inert placeholders
    assert (
        ChatTemplate("{{ messages[0].content[0].image }}").render(
            [{"role": "user", "content": [{"type": "image", "image": object()}]}]
        )
        == "<object>"
    )


def nested(depth: int) -> dict[str, Any]:
    """``{"x": {"x": ... {}}}``: ``depth`` objects, one inside the other."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"x": value}
    return value


@pytest.mark.parametrize("depth", [500, 1000, 5000])
def test_hostile_nesting_is_a_template_error_not_a_recursion_error(
    depth: int, frontends: dict[str, Frontend]
) -> None:
    """Nesting far past Python's recursion limit in template kwargs, a tool's parameters or a tool call's
    arguments (object or JSON string) is refused with ChatTemplateError naming the limit."""
    fe = frontends["qwen3_6"]
    user = [{"role": "user", "content": "q"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": nested(depth)}}

    def call(arguments: Any) -> dict[str, Any]:
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": arguments}}],
        }

    cases = [
        lambda: fe.render_chat(user, deep=nested(depth)),
        lambda: fe.render_chat(user, tools=[tool]),
        lambda: fe.render_chat([*user, call(nested(depth))]),
    ]
    for render in cases:
        with pytest.raises(ChatTemplateError, match="nested deeper than 64 levels"):
            render()
    # a JSON string is parsed (too deep for json.loads: left a string); either way a template error
    for text in ('{"x":' * depth + "{}" + "}" * depth, "[" * depth + "]" * depth):
        with pytest.raises(ChatTemplateError):
            fe.render_chat([*user, call(text)])


def test_nesting_within_the_limit_renders_as_before(frontends: dict[str, Frontend]) -> None:
    """The copy is exact up to the limit: tuples stay tuples, dataclass-free JSON stays equal."""
    from ninfer.targets.qwen3_6.frontend.chat_template import MAX_TEMPLATE_DEPTH, plain_template_data

    data = {"a": [1, (2, [3, (4,)]), {"k": None}], "b": 1.5, 3: "x"}
    assert plain_template_data(data) == data and isinstance(plain_template_data(data)["a"][1][1][1], tuple)
    assert plain_template_data(nested(MAX_TEMPLATE_DEPTH)) == nested(MAX_TEMPLATE_DEPTH)
    with pytest.raises(ChatTemplateError):
        plain_template_data(nested(MAX_TEMPLATE_DEPTH + 1))
    fe = frontends["qwen3_6"]
    tool = {"type": "function", "function": {"name": "f", "parameters": nested(20)}}
    assert json.dumps(nested(20)) in fe.render_chat([{"role": "user", "content": "q"}], tools=[tool])
