"""The Engine fills the sampling fields a request leaves ``None`` from the model's generation config, once,
in ``Engine._plan``: the config's value if present, else the neutral OpenAI value; ``do_sample: false``
means greedy unless the request gives a temperature; a value the request gives always wins.

Each test reads the ``SamplingParams`` of the ``RequestPlan`` the scripted Program received at start.
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_fixtures import drain, make_engine
from scripted_frontend import ScriptedFrontend
from scripted_program import ScriptedProgram

from ninfer import Engine, GenerationRequest, RequestRejected
from ninfer.runtime.contract.types import RequestPlan, SamplingParams
from ninfer.types import NEUTRAL_SAMPLING, resolve_sampling

SAMPLING_FIELDS = tuple(NEUTRAL_SAMPLING)
# a generation config that sets every sampling default, none of them neutral
FULL_CONFIG: dict[str, Any] = {
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "min_p": 0.05,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "repetition_penalty": 1.1,
    "max_new_tokens": 4096,
}


def engine_with(defaults: dict[str, Any], plans: list[RequestPlan]) -> Engine:
    """A step-driven Engine on a model whose generation config has these defaults; every RequestPlan the
    Program starts is appended to ``plans``."""
    program = ScriptedProgram(max_concurrency=1, max_context=64, page_size=4, kv_pages=64, eos_period=0)
    program.on_start = plans.append
    engine, _, _ = make_engine(program=program, frontend=ScriptedFrontend(defaults), max_concurrency=1)
    return engine


def planned_sampling(defaults: dict[str, Any], **request: Any) -> SamplingParams:
    """The SamplingParams the Engine plans for one prompt request on a model with these defaults."""
    plans: list[RequestPlan] = []
    engine = engine_with(defaults, plans)
    handle = engine.submit(GenerationRequest(prompt="abc", max_tokens=2, seed=7, **request))
    drain(engine)
    assert handle.result().finish_reason == "length"
    (plan,) = plans
    return plan.sampling


def fields(sampling: SamplingParams) -> dict[str, Any]:
    return {name: getattr(sampling, name) for name in SAMPLING_FIELDS}


def test_config_defaults_apply_to_fields_the_request_leaves_out() -> None:
    sampling = planned_sampling(FULL_CONFIG)
    assert fields(sampling) == {name: FULL_CONFIG[name] for name in SAMPLING_FIELDS}
    assert sampling.seed == 7


def test_explicit_request_values_win_even_when_falsy() -> None:
    """0 and 0.0 are values the user gave, not "unset": they must not fall back to the config."""
    given = {
        "temperature": 0.0,
        "top_p": 0.5,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": -1.0,
        "repetition_penalty": 1.0,
    }
    assert fields(planned_sampling(FULL_CONFIG, **given)) == given


def test_one_explicit_field_keeps_the_other_defaults() -> None:
    sampling = fields(planned_sampling(FULL_CONFIG, top_k=5))
    assert sampling == {**{name: FULL_CONFIG[name] for name in SAMPLING_FIELDS}, "top_k": 5}


def test_top_k_minus_one_means_disabled() -> None:
    assert planned_sampling(FULL_CONFIG, top_k=-1).top_k == 0


def test_do_sample_false_means_greedy_unless_the_request_gives_a_temperature() -> None:
    config = {"do_sample": False, "temperature": 0.7, "top_k": 20}
    greedy = planned_sampling(config)
    assert greedy.temperature == 0.0
    assert greedy.top_k == 20  # the other defaults still apply
    assert planned_sampling(config, temperature=0.8).temperature == 0.8
    # do_sample true (or absent) leaves the config's temperature as it is
    assert planned_sampling({**config, "do_sample": True}).temperature == 0.7
    assert planned_sampling({"temperature": 0.7}).temperature == 0.7


def test_missing_config_keys_take_the_neutral_value() -> None:
    assert fields(planned_sampling({})) == dict(NEUTRAL_SAMPLING)
    assert NEUTRAL_SAMPLING == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
    partial = fields(planned_sampling({"top_k": 20, "repetition_penalty": 1.05}))
    assert partial == {**NEUTRAL_SAMPLING, "top_k": 20, "repetition_penalty": 1.05}


def test_request_problems_accept_none_and_check_given_values() -> None:
    assert GenerationRequest(prompt="a").problems() == []
    assert all(getattr(GenerationRequest(prompt="a"), name) is None for name in SAMPLING_FIELDS)
    problems = GenerationRequest(prompt="a", top_p=0.0, top_k=True).problems()  # type: ignore[arg-type]
    assert any("top_p" in p for p in problems) and any("top_k" in p for p in problems)


def test_an_invalid_config_default_rejects_the_request_and_an_explicit_value_avoids_it() -> None:
    plans: list[RequestPlan] = []
    engine = engine_with({"top_p": 0.0, "temperature": 0.6}, plans)
    with pytest.raises(RequestRejected) as err:
        engine.submit(GenerationRequest(prompt="abc", max_tokens=2))
    assert err.value.kind == "invalid_request"
    assert "generation config" in err.value.message
    assert "top_p must be in (0, 1], got 0.0" in err.value.message
    handle = engine.submit(GenerationRequest(prompt="abc", max_tokens=2, top_p=0.9))
    drain(engine)
    assert handle.result().finish_reason == "length"
    assert [(p.sampling.top_p, p.sampling.temperature) for p in plans] == [(0.9, 0.6)]


def test_resolve_sampling_refuses_unknown_fields() -> None:
    with pytest.raises(TypeError, match="seed"):
        resolve_sampling({}, seed=1)
