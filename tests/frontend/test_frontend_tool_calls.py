"""Qwen3-Coder XML tool calls: the template's own rendering parses back to the same calls with typed
arguments, deltas stream name first and concatenate to the final JSON, malformed calls stay content."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from ninfer.targets.qwen3_6.frontend import (
    Frontend,
    FrontendResources,
    OutputDelta,
    OutputOptions,
    OutputSession,
    PreparedPrompt,
    SpecialTokens,
    convert_param_value,
    parse_tool_call,
)
from ninfer.targets.qwen3_6.resources import RESOURCE_DIR

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
IM_END = 248046

TOOLS: list[dict[str, Any]] = [
    json.loads((FIXTURES / "render_cases.json").read_text(encoding="utf-8"))["c"]["tools"][0],  # get_weather
    {
        "type": "function",
        "function": {
            "name": "book",
            "description": "Book a trip.",
            "parameters": {
                "type": "object",
                "properties": {
                    "code": {"type": "string"},
                    "seats": {"type": "integer"},
                    "budget": {"type": "number"},
                    "refundable": {"type": "boolean"},
                    "traveller": {"type": "object"},
                    "stops": {"type": "array", "items": {"type": "string"}},
                    "note": {"type": ["string", "null"]},
                    "limit": {"type": ["integer", "null"]},
                    "class": {"enum": ["eco", "biz"]},
                },
            },
        },
    },
]
USER_TURN = [{"role": "user", "content": "Plan my trip to Paris."}]
BOOK_ARGS: dict[str, Any] = {
    "code": "007",
    "seats": 3,
    "budget": 1250.5,
    "refundable": False,
    "traveller": {"name": "Zoë", "age": 41, "tags": ["vip"]},
    "stops": ["Lyon", "Dijon"],
    "note": "window seat\nplease <no> peanuts",
    "limit": None,
    "class": "biz",
    "extra": [1, 2],  # not in the schema: parsed as JSON
}


@pytest.fixture(scope="module")
def fe() -> Frontend:
    res = FrontendResources(
        tokenizer_json=(RESOURCE_DIR / "tokenizer.json").read_bytes(),
        chat_template=(RESOURCE_DIR / "qwen3_6.jinja").read_text(encoding="utf-8"),
        generation_config={"eos_token_id": [248046, 248044]},
    )
    return Frontend.from_resources(res, SpecialTokens())


@pytest.fixture(scope="module")
def prompt(fe: Frontend) -> PreparedPrompt:
    return fe.prepare_chat(USER_TURN, tools=TOOLS)


def call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": args}}


def model_output(fe: Frontend, assistant: dict[str, Any]) -> str:
    """What the model generates for ``assistant``, as the template itself renders that turn."""
    before = fe.render_chat(USER_TURN, tools=TOOLS)
    after = fe.render_chat(USER_TURN + [assistant], tools=TOOLS, add_generation_prompt=False)
    assert after.startswith(before) and after.endswith("<|im_end|>\n")
    return after[len(before) : -1]


def drive(
    session: OutputSession, ids: Sequence[int], sizes: Sequence[int] | None = None
) -> list[OutputDelta]:
    deltas, pos, k = [], 0, 0
    while pos < len(ids):
        preview = session.preview(ids[pos : pos + (sizes[k % len(sizes)] if sizes else 1)])
        deltas.append(session.commit(preview))
        pos, k = pos + preview.accepted, k + 1
        if preview.stop:
            break
    return deltas


def run(
    fe: Frontend, prompt: PreparedPrompt, text: str, sizes: Sequence[int] | None = None, **opts: Any
) -> tuple[OutputSession, list[OutputDelta]]:
    session = fe.new_output_session(prompt, OutputOptions(**opts))
    deltas = drive(session, fe.encode(text), sizes)
    deltas.append(session.finish())
    return session, deltas


def streamed_calls(deltas: Sequence[OutputDelta]) -> dict[int, dict[str, Any]]:
    """Rebuild calls from deltas the way an OpenAI streaming client does."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for piece in d.tool_calls:
            c = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id is not None:
                assert c["id"] is None and c["arguments"] == ""  # id and name come first, once
                c["id"] = piece.id
            if piece.name is not None:
                c["name"] = piece.name
            c["arguments"] += piece.arguments
    return calls


def test_template_rendered_calls_parse_back(fe: Frontend, prompt: PreparedPrompt) -> None:
    assistant = {
        "role": "assistant",
        "reasoning_content": "Weather first, then book.",
        "content": "Checking both.",
        "tool_calls": [
            call("get_weather", {"city": "Paris", "days": 2, "units": "celsius"}),
            call("book", BOOK_ARGS),
        ],
    }
    text = model_output(fe, assistant)
    assert "<parameter=traveller>\n" + json.dumps(BOOK_ARGS["traveller"], ensure_ascii=False) in text
    assert text.endswith("</function>\n</tool_call><|im_end|>")
    for sizes in (None, [4], [1, 7, 2]):
        session, deltas = run(fe, prompt, text, sizes)
        assert session.finish_reason == "stop"
        assert session.reasoning_text == assistant["reasoning_content"] and session.text == "Checking both."
        calls = session.tool_calls
        assert [c.name for c in calls] == ["get_weather", "book"] and [c.index for c in calls] == [0, 1]
        assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 2, "units": "celsius"}
        assert json.loads(calls[1].arguments) == BOOK_ARGS  # typed: int, float, bool, object, array, null
        assert all(c.id.startswith("call_") and len(c.id) > 10 for c in calls) and calls[0].id != calls[1].id
        streamed = streamed_calls(deltas)
        assert [(s["id"], s["name"], s["arguments"]) for s in streamed.values()] == [
            (c.id, c.name, c.arguments) for c in calls
        ]
    # the parsed message re-renders to exactly the prompt plus the generated text
    parsed = {
        "role": "assistant",
        "reasoning_content": session.reasoning_text,
        "content": session.text,
        "tool_calls": [c.to_openai() for c in session.tool_calls],
    }
    assert model_output(fe, parsed) == text


def test_call_without_content_and_text_after(fe: Frontend, prompt: PreparedPrompt) -> None:
    text = model_output(
        fe, {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Oslo"})]}
    )
    session, _ = run(fe, prompt, text)
    assert session.text == "" and json.loads(session.tool_calls[0].arguments) == {"city": "Oslo"}
    # the model was told not to write after a call; if it does, that text is content
    body = text.removesuffix("<|im_end|>")
    session, _ = run(fe, prompt, body + "\n\nDone, see above.<|im_end|>")
    assert session.text == "Done, see above." and len(session.tool_calls) == 1


def test_preview_twice_same_call_id(fe: Frontend, prompt: PreparedPrompt) -> None:
    ids = fe.encode("</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n")
    tail = fe.encode("</function>\n</tool_call>")
    session = fe.new_output_session(prompt, OutputOptions())
    session.commit(session.preview(ids))
    first, second = session.preview(tail), session.preview(tail)
    assert first == second and first.delta.tool_calls[0].name == "get_weather"
    assert session.tool_calls == ()
    session.commit(second)
    assert session.tool_calls[0].id == first.delta.tool_calls[0].id


WEATHER_OPEN = "<tool_call>\n<function=get_weather>\n"
MALFORMED = {
    "unknown function": "<tool_call>\n<function=fly>\n<parameter=to>\nMars\n</parameter>\n</function>\n"
    "</tool_call>",
    "missing </parameter>": WEATHER_OPEN + "<parameter=city>\nParis\n</function>\n</tool_call>",
    "text between params": WEATHER_OPEN + "hmm <parameter=city>\nX\n</parameter>\n</function>\n</tool_call>",
    "no function": "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
    "missing </function>": WEATHER_OPEN + "<parameter=city>\nParis\n</parameter>\n</tool_call>",
    "garbage after": WEATHER_OPEN + "</function>\nextra\n</tool_call>",
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_calls_stay_content(kind: str, fe: Frontend, prompt: PreparedPrompt) -> None:
    xml = MALFORMED[kind]
    for sizes in (None, [5]):
        session, deltas = run(fe, prompt, "</think>\n\nTrying.\n\n" + xml + "<|im_end|>", sizes)
        assert session.tool_calls == () and all(not d.tool_calls for d in deltas)
        assert session.text == "Trying.\n\n" + xml


def test_unterminated_call_is_content(fe: Frontend, prompt: PreparedPrompt) -> None:
    partial = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    session = fe.new_output_session(prompt, OutputOptions())
    deltas = drive(session, fe.encode("</think>\n\nOK " + partial))
    assert "".join(d.text for d in deltas) == "OK"  # the open call (and the space before it) is held
    assert session.finish().text == " " + partial and session.tool_calls == ()
    session, _ = run(fe, prompt, "</think>\n\n" + partial + "<|im_end|>")  # ended by a stop token
    assert session.text == partial and session.finish_reason == "stop"
    # a later well-formed call still parses after a malformed one
    good = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    )
    session, _ = run(fe, prompt, "</think>\n\n<tool_call>oops " + good + "<|im_end|>")
    assert session.text == "<tool_call>oops" and json.loads(session.tool_calls[0].arguments) == {
        "city": "Oslo"
    }


def test_calls_in_reasoning_or_without_tools_are_text(fe: Frontend, prompt: PreparedPrompt) -> None:
    xml = WEATHER_OPEN + "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    session, _ = run(fe, prompt, "Maybe " + xml + "\n</think>\n\nNo call needed.<|im_end|>")
    assert session.reasoning_text == "Maybe " + xml and session.text == "No call needed."
    assert session.tool_calls == ()
    no_tools = fe.prepare_chat(USER_TURN)
    session, _ = run(fe, no_tools, "</think>\n\n" + xml + "<|im_end|>")
    assert session.text == xml and session.tool_calls == ()
    session, _ = run(fe, prompt, "</think>\n\n" + xml + "<|im_end|>", parse_tool_calls=False)
    assert session.text == xml and session.tool_calls == ()
    # <tool_call> is markup, not a control token: skip_special_tokens keeps it
    session, _ = run(fe, prompt, "</think>\n\n" + xml, parse_tool_calls=False, skip_special_tokens=True)
    assert session.text == xml


def test_random_spans_agree(fe: Frontend, prompt: PreparedPrompt) -> None:
    text = model_output(
        fe,
        {
            "role": "assistant",
            "reasoning_content": "r",
            "content": "Sure <tool",
            "tool_calls": [call("book", {"code": "A1", "seats": 2}), call("get_weather", {"city": "Nice"})],
        },
    )
    ref, ref_deltas = run(fe, prompt, text)
    assert ref.text == "Sure <tool" and len(ref.tool_calls) == 2
    rnd = random.Random(5)
    for _ in range(10):
        session, deltas = run(fe, prompt, text, [rnd.randint(1, 9) for _ in range(6)])
        assert (session.text, session.reasoning_text) == (ref.text, ref.reasoning_text)
        assert [(c.name, c.arguments) for c in session.tool_calls] == [
            (c.name, c.arguments) for c in ref.tool_calls
        ]
        assert [(s["name"], s["arguments"]) for s in streamed_calls(deltas).values()] == [
            (s["name"], s["arguments"]) for s in streamed_calls(ref_deltas).values()
        ]


def test_convert_param_value_by_schema() -> None:
    cases: list[tuple[str, Any, Any]] = [
        ("2", {"type": "integer"}, 2),
        (" -7 ", {"type": "int"}, -7),
        ("two", {"type": "integer"}, "two"),
        ("2.5", {"type": "number"}, 2.5),
        ("1e3", {"type": "number"}, 1000.0),
        ("3", {"type": "number"}, 3),
        ("NaN", {"type": "number"}, "NaN"),
        ("True", {"type": "boolean"}, True),
        ("false", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ('{"a": [1, {"b": null}]}', {"type": "object"}, {"a": [1, {"b": None}]}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("[1, 2", {"type": "array"}, "[1, 2"),
        ("007", {"type": "string"}, "007"),
        ("[1]", {"type": "string"}, "[1]"),
        ("null", {"type": "string"}, "null"),
        (" padded ", {"type": "string"}, " padded "),
        ("null", {"type": ["integer", "null"]}, None),
        ("5", {"type": ["integer", "null"]}, 5),
        ("eco", {"enum": ["eco", "biz"]}, "eco"),
        ("3", {"enum": None}, 3),  # malformed schemas type nothing and never raise
        ("3", {"enum": 5}, 3),
        ("3", None, 3),
        ('{"k": 1}', {}, {"k": 1}),
        ("hello", None, "hello"),
        ("true", {"description": "no type"}, True),
    ]
    for raw, schema, expected in cases:
        got = convert_param_value(raw, schema)
        assert got == expected and type(got) is type(expected), (raw, schema, got)


def test_parse_tool_call_unit() -> None:
    schemas = {"f": {"n": {"type": "integer"}}}
    assert parse_tool_call(
        "<tool_call><function=f><parameter=n>1</parameter></function></tool_call>", schemas
    ) == (
        "f",
        {"n": 1},
    )
    block = (
        "<tool_call>\n<function=f>\n<parameter=s>\n\nline1\nline2\n\n</parameter>\n</function>\n</tool_call>"
    )
    assert parse_tool_call(block, schemas) == (
        "f",
        {"s": "\nline1\nline2\n"},
    )  # one newline each side is format
    assert parse_tool_call("<tool_call>\n<function=f>\n</function>\n</tool_call>", schemas) == ("f", {})
    assert parse_tool_call("<tool_call>\n<function=g>\n</function>\n</tool_call>", schemas) is None
    assert parse_tool_call("<tool_call>\n<function=f\n</function>\n</tool_call>", schemas) is None
