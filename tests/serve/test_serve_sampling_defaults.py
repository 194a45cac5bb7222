"""The server passes only the sampling fields a request gives; the Engine fills the rest from the model's
generation config (config value, else neutral; ``do_sample: false`` = greedy unless a temperature is
given). Scripted Programs behind the bundled demo model's real Frontend, with its generation defaults
swapped per test; the sampling is read from the RequestPlan each request starts with."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_helpers import MODEL, ScriptedProgram, ScriptedScoringProgram, running_server, scripted_engine

from ninfer import Engine, EngineConfig
from ninfer.cli.common import bundled_artifact
from ninfer.runtime.contract.types import RequestPlan
from ninfer.serve import BackgroundServer
from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6.frontend import Frontend

MESSAGES = [{"role": "user", "content": "Name a colour."}]
SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}
GREEDY = {"do_sample": False, "temperature": 0.7, "top_k": 40}


def frontend_with(defaults: dict[str, Any]) -> Frontend:
    """The demo model's Frontend with another generation config's sampling defaults."""
    frontend = copy.copy(load_frontend(bundled_artifact()))
    frontend.generation_defaults = dict(defaults)
    return frontend


@pytest.fixture
def served() -> Iterator[tuple[dict[str, BackgroundServer], dict[str, list[RequestPlan]]]]:
    """Two generation servers, one per model config, and the plans each one's Program started."""
    servers: dict[str, BackgroundServer] = {}
    plans: dict[str, list[RequestPlan]] = {"sampling": [], "greedy": []}
    with (
        running_server(*_scripted(SAMPLING, plans["sampling"])) as sampling,
        running_server(*_scripted(GREEDY, plans["greedy"])) as greedy,
    ):
        servers["sampling"], servers["greedy"] = sampling, greedy
        yield servers, plans


def _scripted(defaults: dict[str, Any], plans: list[RequestPlan]) -> tuple[Engine, Frontend]:
    frontend = frontend_with(defaults)
    program = ScriptedProgram(max_concurrency=1, max_context=256, page_size=16, kv_pages=64, eos_period=0)
    program.on_start = plans.append
    return scripted_engine(program, frontend), frontend


def _post(server: BackgroundServer, path: str, **body: Any) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": 2, "seed": 5, **body}
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _fields(plan: RequestPlan, *names: str) -> tuple[Any, ...]:
    return tuple(getattr(plan.sampling, name) for name in names)


def test_fields_left_out_take_the_model_config(served: Any) -> None:
    servers, plans = served
    _post(servers["sampling"], "/v1/chat/completions", messages=MESSAGES)
    _post(servers["sampling"], "/v1/completions", prompt="The sky is")
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty")
    assert [_fields(p, *names) for p in plans["sampling"]] == [(0.6, 0.95, 20, 0.0, 1.1, 0.0)] * 2


def test_given_fields_win(served: Any) -> None:
    servers, plans = served
    _post(servers["sampling"], "/v1/chat/completions", messages=MESSAGES, temperature=0, top_k=0, top_p=1)
    assert _fields(plans["sampling"][0], "temperature", "top_k", "top_p", "repetition_penalty") == (
        0.0, 0, 1.0, 1.1
    )


def test_do_sample_false_is_greedy_unless_the_request_gives_a_temperature(served: Any) -> None:
    servers, plans = served
    _post(servers["greedy"], "/v1/chat/completions", messages=MESSAGES)
    _post(servers["greedy"], "/v1/completions", prompt="The sky is")
    _post(servers["greedy"], "/v1/chat/completions", messages=MESSAGES, temperature=0.5)
    assert [_fields(p, "temperature", "top_k", "top_p") for p in plans["greedy"]] == [
        (0.0, 40, 1.0), (0.0, 40, 1.0), (0.5, 40, 1.0)
    ]


@pytest.mark.parametrize(("defaults", "status"), [(GREEDY, 200), (SAMPLING, 400)])
def test_scoring_next_token_follows_the_model_default_temperature(
    defaults: dict[str, Any], status: int
) -> None:
    """``max_tokens: 1`` without a temperature appends the greedy token only where the model's default
    resolves to greedy; a sampling default is refused, naming the temperature it would use."""
    frontend = frontend_with(defaults)
    engine = Engine.from_parts(
        ScriptedScoringProgram(max_context=16),
        frontend,
        EngineConfig(purpose="causal_scoring", score_window=16, score_stride=8, warmup=False),
    )
    body = {"model": MODEL, "prompt": "The sky is", "echo": True, "logprobs": 1, "max_tokens": 1}
    with running_server(engine, frontend) as server:
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    if status == 400:
        assert "temperature 0.6" in response.json()["error"]["message"]
    else:
        assert response.json()["usage"]["completion_tokens"] == 1
