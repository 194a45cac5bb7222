"""Structured outputs on the bundled demo model (CPU): JSON schemas, regex, choice, grammars, tool calls.

200 seeded random schemas (nested objects, arrays, enums, bounded numbers, required fields) produce
output that parses and validates with ``jsonschema`` every time, greedy and sampled; without the
constraint the same model fails most of them (the negative control). Regex, choice, Lark/GBNF grammars
and ``tool_call`` constraints hold; reasoning stays unconstrained until ``</think>``; reported log-probs
are the masked distribution's; bad constraints are refused naming the field; cancellation and
concurrency at ``max_concurrency=8`` leave the Engine healthy and its pools at baseline; MTP decoding
under a constraint gives exactly constrained plain decoding's tokens.
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
import time
from collections.abc import Iterator

import jsonschema
import pytest
from schema_gen import schemas

from ninfer import Engine, EngineConfig, GenerationRequest
from ninfer.cli.common import bundled_artifact
from ninfer.types import GenerationResult, OutputConstraint, RequestRejected

pytest.importorskip("llguidance")

NO_THINKING = {"enable_thinking": False}
SCHEMA_COUNT = 200


def chat(text: str = "Give the JSON.", **fields: object) -> GenerationRequest:
    fields.setdefault("chat_template_kwargs", NO_THINKING)
    return GenerationRequest(messages=[{"role": "user", "content": text}], **fields)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    config = EngineConfig(device="cpu", warmup=False, max_concurrency=8, max_context=1024, queue_capacity=512)
    with Engine(bundled_artifact(), config) as e:
        yield e


def run_all(engine: Engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    handles = [engine.submit(r) for r in requests]
    return [h.result() for h in handles]


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_random_schemas_validate_every_time_greedy_and_sampled(engine: Engine) -> None:
    cases = schemas(SCHEMA_COUNT, seed=20261202)
    requests = [
        chat(
            max_tokens=96,
            temperature=0.0 if i % 2 == 0 else 1.0,  # half greedy, half sampled
            seed=i,
            constraint=OutputConstraint.json_schema(schema),
        )
        for i, schema in enumerate(cases)
    ]
    results = run_all(engine, requests)
    failures = [(r.finish_reason, r.text, s) for r, s in zip(results, cases) if not valid(r.text, s)]
    assert not failures, failures[:3]
    assert all(r.finish_reason == "stop" for r in results)
    assert engine.core.program.usage() == engine.core.baseline


def test_negative_control_the_same_schemas_unconstrained_fail_often(engine: Engine) -> None:
    cases = schemas(24, seed=20261202)
    results = run_all(engine, [chat(max_tokens=20, temperature=1.0, seed=i) for i in range(len(cases))])
    failed = sum(not valid(r.text, s) for r, s in zip(results, cases))
    assert failed >= 18, failed


def test_compiled_grammars_are_cached_by_digest(engine: Engine) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    constraints = engine.frontend.constraints  # type: ignore[attr-defined]
    run_all(engine, [chat(max_tokens=16, constraint=OutputConstraint.json_schema(schema))])
    before = constraints.compiled
    results = run_all(
        engine,
        [chat(max_tokens=16, seed=s, constraint=OutputConstraint.json_schema(schema)) for s in range(4)],
    )
    assert constraints.compiled == before
    assert all(valid(r.text, schema) for r in results)


def test_json_object_regex_choice_and_grammars_hold(engine: Engine) -> None:
    pattern = r"[A-Z][a-z]{1,6} [0-9]{2,3}"
    choices = ["yes", "no", "maybe later", "ça va"]
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'
    gbnf = 'root ::= "x=" [0-9] [0-9]? ";"'
    requests = []
    for seed in range(8):
        requests += [
            chat(
                max_tokens=96,
                temperature=float(seed % 2),
                seed=seed,
                constraint=OutputConstraint.json_object(),
            ),
            chat(max_tokens=24, temperature=1.0, seed=seed, constraint=OutputConstraint.regex(pattern)),
            chat(max_tokens=24, temperature=1.0, seed=seed, constraint=OutputConstraint.choice(choices)),
            chat(max_tokens=32, temperature=1.0, seed=seed, constraint=OutputConstraint.cfg(lark)),
            chat(max_tokens=24, temperature=1.0, seed=seed, constraint=OutputConstraint.cfg(gbnf)),
        ]
    results = run_all(engine, requests)
    compiler = engine.frontend.constraints  # type: ignore[attr-defined]
    for i in range(0, len(results), 5):
        obj, rx, ch, lk, gb = results[i : i + 5]
        if obj.finish_reason == "stop":
            assert isinstance(json.loads(obj.text), dict), obj.text
        else:  # this model may write a string longer than the cap: the output is a prefix of an object
            assert compiler.matcher(OutputConstraint.json_object(), None).consume_tokens(list(obj.token_ids))
        assert re.fullmatch(pattern, rx.text), rx.text
        assert ch.text in choices
        assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", lk.text), lk.text
        assert re.fullmatch(r"x=[0-9]{1,2};", gb.text), gb.text
        assert all(r.finish_reason == "stop" for r in (rx, ch, lk, gb))


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
            },
            "required": ["tags"],
        },
    },
}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}


def test_tool_choice_required_and_named_give_parsed_tool_calls(engine: Engine) -> None:
    tools = [WEATHER, SEARCH]
    requests = []
    for seed in range(6):
        requests.append(
            chat("What is the weather?", tools=tools, max_tokens=80, temperature=1.0, seed=seed,
                 constraint=OutputConstraint.tool_call(parallel=False))
        )  # fmt: skip
        requests.append(
            chat("Search.", tools=tools, max_tokens=80, temperature=float(seed % 2), seed=seed,
                 constraint=OutputConstraint.tool_call("search"))
        )  # fmt: skip
    results = run_all(engine, requests)
    for i, result in enumerate(results):
        assert result.finish_reason == "stop", (result.text, result.token_ids)
        assert len(result.tool_calls) == 1, result.text
        call = result.tool_calls[0]
        if i % 2:
            assert call.name == "search"
        arguments = json.loads(call.arguments)
        jsonschema.validate(arguments, TOOL_SCHEMAS[call.name])
        assert result.text == ""


def test_reasoning_stays_unconstrained_until_the_think_block_ends(engine: Engine) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
    }
    results = run_all(
        engine,
        [
            chat(chat_template_kwargs={"enable_thinking": True}, thinking_budget=6, max_tokens=64, seed=s,
                 temperature=1.0, constraint=OutputConstraint.json_schema(schema))
            for s in range(4)
        ],
    )  # fmt: skip
    for r in results:
        assert r.reasoning_text  # the reasoning ran free (it is not JSON)
        assert valid(r.text, schema), (r.reasoning_text, r.text)


def test_logprobs_are_of_the_masked_distribution(engine: Engine) -> None:
    only = run_all(engine, [chat(max_tokens=4, logprobs=True, top_logprobs=3, temperature=1.0,
                                 constraint=OutputConstraint.choice(["7"]))])[0]  # fmt: skip
    assert only.text == "7"
    assert only.logprobs
    first, stop = only.logprobs  # "7" is the one allowed first token: log-prob 0, no alternative
    assert first.logprob == pytest.approx(0.0, abs=1e-6)
    assert [t for t, _ in first.top] == [first.token_id]
    # then only the stop tokens (<|im_end|>, <|endoftext|>): their masked probabilities add up to 1
    assert {t for t, _ in stop.top} <= set(engine.frontend.eos_token_ids)  # type: ignore[attr-defined]
    assert sum(math.exp(v) for _, v in stop.top) == pytest.approx(1.0, abs=1e-4)
    two = run_all(engine, [chat(max_tokens=8, logprobs=True, top_logprobs=20, temperature=1.0, seed=3,
                                constraint=OutputConstraint.choice(["yes", "no"]))])[0]  # fmt: skip
    first = two.logprobs[0]  # every allowed first token (the tokenizations of the two words' prefixes)
    assert 2 <= len(first.top) < 20
    assert sum(math.exp(v) for _, v in first.top) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize(
    ("constraint", "field", "words"),
    [
        (OutputConstraint.regex("a(b", source="guided_regex"), "guided_regex", "regex"),
        (OutputConstraint.json_schema({"type": "nonsense"}, source="response_format"), "response_format",
         "type"),
        (OutputConstraint.cfg("start: undefined_rule", source="guided_grammar"), "guided_grammar",
         "undefined"),
        (OutputConstraint.json_schema({"type": "object", "not": {"required": ["a"]}}, strict=True,
                                      source="response_format"), "response_format", "unimplemented"),
    ],
)  # fmt: skip
def test_bad_constraints_are_refused_naming_the_field(
    engine: Engine, constraint: OutputConstraint, field: str, words: str
) -> None:
    with pytest.raises(RequestRejected) as info:
        engine.submit(chat(max_tokens=8, constraint=constraint))
    assert info.value.kind == "invalid_request"
    assert info.value.message.startswith(f"{field}:"), info.value.message
    assert words.lower() in info.value.message.lower()


def test_a_schema_keyword_the_engine_cannot_enforce_is_ignored_unless_strict(engine: Engine) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False, "not": {"required": ["b"]}}  # fmt: skip
    result = run_all(engine, [chat(max_tokens=16, constraint=OutputConstraint.json_schema(schema))])[0]
    assert valid(result.text, schema)


def test_unknown_tool_name_is_refused(engine: Engine) -> None:
    with pytest.raises(RequestRejected) as info:
        engine.submit(
            chat(tools=[WEATHER], constraint=OutputConstraint.tool_call("nope", source="tool_choice"))
        )
    assert info.value.message.startswith("tool_choice:") and "nope" in info.value.message


def test_constrained_requests_with_cancellation_and_concurrency_keep_the_engine_healthy(
    engine: Engine,
) -> None:
    rng = random.Random(7)
    cases = schemas(24, seed=99)
    handles = []
    for i, schema in enumerate(cases):
        constraint = OutputConstraint.json_schema(schema) if i % 3 else None
        handles.append(engine.submit(chat(max_tokens=64, temperature=1.0, seed=i, constraint=constraint)))
    cancels = [h for h in handles if rng.random() < 0.4]

    def cancel_later() -> None:
        for h in cancels:
            time.sleep(rng.random() * 0.05)
            h.cancel()

    thread = threading.Thread(target=cancel_later)
    thread.start()
    results = [h.result() if h not in cancels else next(e for e in h if isinstance(e, GenerationResult))
               for h in handles]  # fmt: skip
    thread.join()
    for i, (r, schema) in enumerate(zip(results, cases)):
        assert r.finish_reason in ("stop", "length", "cancelled")
        if i % 3 and r.finish_reason == "stop":
            assert valid(r.text, schema)
    deadline = time.monotonic() + 10
    while engine.core.outstanding and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.availability.ready
    assert engine.core.program.usage() == engine.core.baseline
    # the Engine still serves constrained requests after all that
    after = run_all(engine, [chat(max_tokens=8, constraint=OutputConstraint.choice(["ok"]))])[0]
    assert after.text == "ok"


def test_mtp_under_a_constraint_gives_constrained_plain_decodings_tokens() -> None:
    cases = schemas(12, seed=4242)
    requests = [
        chat(max_tokens=64, temperature=0.0, constraint=OutputConstraint.json_schema(s)) for s in cases
    ]
    requests += [
        chat(
            max_tokens=24, temperature=0.0, constraint=OutputConstraint.regex(r"[a-z]{2,5}(, [a-z]{2,5}){2}")
        )
    ]
    out = {}
    for spec in (None, "mtp:3"):
        config = EngineConfig(
            device="cpu", dtype="float32", speculative=spec, warmup=False, max_concurrency=4,
            max_context=384, prefix_cache=False,
        )  # fmt: skip
        with Engine(bundled_artifact(), config) as e:
            out[spec] = run_all(e, requests)
            if spec is not None:
                drafted = sum(r.usage.drafted_tokens for r in out[spec])
                assert drafted > 0 and sum(r.usage.accepted_draft_tokens for r in out[spec]) > 0
    assert [r.token_ids for r in out["mtp:3"]] == [r.token_ids for r in out[None]]
    assert all(valid(r.text, s) for r, s in zip(out["mtp:3"], cases))
