"""Causal scoring: window/stride placement, per-token logprobs, purpose separation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scripted_frontend import ScriptedFrontend
from scripted_program import ScriptedScoringProgram

from ninfer import Engine, EngineConfig
from ninfer.runtime.scoring.core import CausalScoreCore, ScoreWindow, plan_windows


def test_plan_windows_by_hand() -> None:
    assert plan_windows(10, 4, 2) == [ScoreWindow(0, 4, 1), ScoreWindow(2, 6, 4), ScoreWindow(4, 8, 6),
                                      ScoreWindow(6, 10, 8)]
    assert plan_windows(4, 8, 4) == [ScoreWindow(0, 4, 1)]
    assert plan_windows(9, 4, 3) == [ScoreWindow(0, 4, 1), ScoreWindow(3, 7, 4), ScoreWindow(6, 9, 7)]
    assert plan_windows(1, 4, 2) == [] and plan_windows(0, 4, 2) == []


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 60), window=st.integers(2, 16), data=st.data())
def test_each_token_is_scored_once_with_the_most_context(n: int, window: int, data: st.DataObject) -> None:
    stride = data.draw(st.integers(1, window - 1))
    program = ScriptedScoringProgram(max_context=16)
    result = CausalScoreCore(program, window, stride).score(list(range(n)))
    assert len(result.logprobs) == n and (n == 0 or result.logprobs[0] is None)
    for t in range(1, n):
        # oracle: the earliest window start (multiple of stride) that holds t with context before it
        start = min(s for s in range(0, n, stride) if s < t < s + window)
        assert result.logprobs[t] == -(t - start) - t / 1000.0
    assert all(len(w) <= window for w in program.windows)
    assert math.isclose(result.total_nll, -sum(lp for lp in result.logprobs if lp is not None))


def test_engine_score_uses_config_window_and_stride() -> None:
    program = ScriptedScoringProgram(max_context=32)
    config = EngineConfig(purpose="causal_scoring", score_window=4, score_stride=2)
    engine = Engine.from_parts(program, ScriptedFrontend(), config)
    assert engine.availability.state == "ready"
    (text_result, ids_result) = engine.score(["abcdefghij", [5, 6, 7]])
    assert text_result.token_ids == tuple(b"abcdefghij")
    contexts = [None, 1, 2, 3, 2, 3, 2, 3, 2, 3]
    for t, ctx in enumerate(contexts):
        expected = None if ctx is None else -ctx - text_result.token_ids[t] / 1000.0
        assert text_result.logprobs[t] == expected
    assert ids_result.logprobs == (None, -1 - 6 / 1000.0, -2 - 7 / 1000.0)
    assert [len(w) for w in program.windows] == [4, 4, 4, 4, 3]


def test_window_larger_than_program_context_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="lower score_window"):
        Engine.from_parts(ScriptedScoringProgram(max_context=8), ScriptedFrontend(),
                          EngineConfig(purpose="causal_scoring", score_window=16, score_stride=8))
