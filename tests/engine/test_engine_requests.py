"""Request-level errors fail only their request, with a message that says what to change."""

from __future__ import annotations

import math

import pytest
from engine_fixtures import FakeClock, drain, make_engine
from scripted_program import ScriptedProgram

from ninfer import EngineConfig, GenerationRequest, RequestRejected


def _program(**kw: int) -> ScriptedProgram:
    kw.setdefault("max_concurrency", 1)
    kw.setdefault("kv_pages", 64)
    return ScriptedProgram(max_context=64, page_size=4, eos_period=0, **kw)


def _still_serves(engine) -> None:
    handle = engine.submit(GenerationRequest(prompt="ok", max_tokens=3, seed=1))
    drain(engine)
    assert handle.result().finish_reason == "length"
    assert not engine.core.failed


def test_prompt_beyond_max_context_is_rejected_at_submit() -> None:
    engine, _, _ = make_engine(program=_program(), max_concurrency=1, max_context=32)
    with pytest.raises(RequestRejected) as err:
        engine.submit(GenerationRequest(prompt="x" * 40))
    assert err.value.kind == "context_too_long"
    assert "40 tokens" in err.value.message and "max_context is 32" in err.value.message
    assert "shorten the prompt" in err.value.message
    with pytest.raises(RequestRejected) as err:
        engine.submit(GenerationRequest(prompt="x" * 20, max_tokens=20))
    assert err.value.kind == "context_too_long" and "lower max_tokens to at most 12" in err.value.message
    _still_serves(engine)


def test_max_tokens_default_fills_the_context() -> None:
    engine, _, _ = make_engine(program=_program(), max_concurrency=1, max_context=16)
    handle = engine.submit(GenerationRequest(prompt="x" * 10))
    drain(engine)
    result = handle.result()
    assert result.finish_reason == "length" and result.usage.completion_tokens == 6


@pytest.mark.parametrize(
    ("request_kwargs", "words"),
    [
        ({"prompt": "a", "temperature": -1.0}, "temperature"),
        ({"prompt": "a", "temperature": math.nan}, "temperature"),
        ({"prompt": "a", "top_p": 0.0}, "top_p"),
        ({"prompt": "a", "top_k": -5}, "top_k"),
        ({"prompt": "a", "min_p": 1.5}, "min_p"),
        ({"prompt": "a", "presence_penalty": 3.0}, "presence_penalty"),
        ({"prompt": "a", "repetition_penalty": 0.0}, "repetition_penalty"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "top_logprobs": 3}, "top_logprobs needs logprobs"),
        ({"prompt": "a", "top_logprobs": 50, "logprobs": True}, "top_logprobs must be 0..20"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one of prompt"),
        ({}, "exactly one of prompt"),
        ({"prompt": [1, 2, 999]}, "cannot be prepared"),
        ({"prompt": "a", "stop": [""]}, "stop strings"),
        ({"prompt": "a", "seed": -1}, "seed"),
        # the final prefill chunk samples the first token before any close tag can be forced
        ({"messages": [{"role": "user", "content": "b"}], "thinking_budget": 0}, "must be >= 1, got 0"),
        ({"prompt": "a", "thinking_budget": -3}, "enable_thinking=False"),
    ],
)
def test_invalid_request_is_rejected_with_what_to_change(request_kwargs: dict, words: str) -> None:
    engine, _, _ = make_engine(program=_program(), max_concurrency=1)
    with pytest.raises(RequestRejected) as err:
        engine.submit(GenerationRequest(**request_kwargs))
    assert err.value.kind == "invalid_request"
    assert words in err.value.message
    assert engine.core.outstanding == 0
    _still_serves(engine)


def test_overload_rejects_at_submit_and_recovers_when_capacity_returns() -> None:
    engine, _, _ = make_engine(program=_program(), max_concurrency=1, queue_capacity=1)
    first = engine.submit(GenerationRequest(prompt="a", max_tokens=2, seed=1))
    second = engine.submit(GenerationRequest(prompt="b", max_tokens=2, seed=2))
    with pytest.raises(RequestRejected) as err:
        engine.submit(GenerationRequest(prompt="c", max_tokens=2))
    assert err.value.kind == "overload" and "queue_capacity" in err.value.message
    drain(engine)
    # finished but unconsumed requests still hold capacity until their consumer lets go
    with pytest.raises(RequestRejected):
        engine.submit(GenerationRequest(prompt="c", max_tokens=2))
    assert first.result().finish_reason == "length"
    third = engine.submit(GenerationRequest(prompt="c", max_tokens=2, seed=3))
    drain(engine)
    assert second.result().finish_reason == "length" and third.result().finish_reason == "length"


def test_queue_timeout_fails_only_the_waiting_request() -> None:
    clock = FakeClock()
    engine, _, _ = make_engine(program=_program(), clock=clock, max_concurrency=1, queue_timeout_s=5.0)
    active = engine.submit(GenerationRequest(prompt="a", max_tokens=20, seed=1))
    waiting = engine.submit(GenerationRequest(prompt="b", max_tokens=2, seed=2))
    engine.core.step()
    clock.now = 4.9
    engine.core.step()
    assert not waiting.done
    clock.now = 5.0
    engine.core.step()
    assert waiting.done
    with pytest.raises(RequestRejected) as err:
        waiting.result()
    assert err.value.kind == "queue_timeout" and "queue_timeout_s=5.0" in err.value.message
    drain(engine)
    assert active.result().finish_reason == "length"
    assert engine.core.outstanding == 0


def test_infeasible_request_is_rejected_and_the_engine_continues() -> None:
    engine, _, _ = make_engine(program=_program(kv_pages=4), max_concurrency=1)  # 16 positions in all
    big = engine.submit(GenerationRequest(prompt="a" * 4, max_tokens=20))
    drain(engine)
    result = big.result(raise_on_error=False)
    assert result.finish_reason == "error" and result.error.kind == "infeasible"
    assert "lower max_tokens" in result.error.message
    _still_serves(engine)


def test_purposes_do_not_mix() -> None:
    engine, program, frontend = make_engine(program=_program(), max_concurrency=1)
    with pytest.raises(RequestRejected) as err:
        engine.score(["abc"])
    assert err.value.kind == "wrong_purpose" and "causal_scoring" in err.value.message
    from scripted_program import ScriptedScoringProgram

    from ninfer import Engine

    scorer = Engine.from_parts(ScriptedScoringProgram(64), frontend,
                               EngineConfig(purpose="causal_scoring", score_window=8, score_stride=4))
    with pytest.raises(RequestRejected) as err:
        scorer.submit(GenerationRequest(prompt="a"))
    assert err.value.kind == "wrong_purpose" and "score()" in err.value.message


def test_config_values_are_checked() -> None:
    for kwargs, words in [
        ({"max_concurrency": 9}, "max_concurrency must be 1..8"),
        ({"page_size": 12}, "page_size"),
        ({"score_window": 8, "score_stride": 8}, "score_stride"),
        ({"purpose": "chat"}, "purpose"),
        ({"queue_timeout_s": 0}, "queue_timeout_s"),
    ]:
        with pytest.raises(ValueError, match=words):
            EngineConfig(**kwargs)
