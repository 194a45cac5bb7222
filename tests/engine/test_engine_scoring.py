"""Causal scoring: window/stride placement, per-token logprobs and top-n alternatives, the next-token
prediction, purpose separation, and refusal of malformed Program answers."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scripted_frontend import ScriptedFrontend
from scripted_program import ScriptedScoringProgram

from ninfer import Engine, EngineConfig, EngineFailed, RequestRejected, TokenLogprob
from ninfer.runtime.contract.types import WindowScores
from ninfer.runtime.scoring.core import CausalScoreCore, ScoreWindow, plan_windows


def _window_starts(n: int, stride: int, window: int) -> list[int]:
    """Oracle, from the documented rule: multiples of stride while the window ends before the last token,
    then one window aligned to the end of the text."""
    return [s for s in range(0, n, stride) if s + window < n] + [max(0, n - window)]


def _scoring_start(t: int, n: int, stride: int, window: int) -> int:
    """Oracle: the earliest window start that holds token t with context before it (the most context)."""
    return min(s for s in _window_starts(n, stride, window) if s < t < s + window)


def test_plan_windows_by_hand() -> None:
    assert plan_windows(10, 4, 2) == [ScoreWindow(0, 4, 1), ScoreWindow(2, 6, 4), ScoreWindow(4, 8, 6),
                                      ScoreWindow(6, 10, 8)]
    assert plan_windows(4, 8, 4) == [ScoreWindow(0, 4, 1)]
    # the last window ends at the last token and holds a full window, not [6, 9) from the stride rule
    assert plan_windows(9, 4, 3) == [ScoreWindow(0, 4, 1), ScoreWindow(3, 7, 4), ScoreWindow(5, 9, 7)]
    assert plan_windows(1, 4, 2) == [] and plan_windows(0, 4, 2) == []
    assert plan_windows(4, 4, 2) == [ScoreWindow(0, 4, 1)]


def test_tail_token_gets_a_full_window() -> None:
    """2049 tokens, window 2048, stride 1024: token 2048 is scored with 2047 tokens of context (window
    [1, 2049)), not 1024 (a window starting at 1024), and the next-token prediction sees 2048 tokens."""
    assert plan_windows(2049, 2048, 1024) == [ScoreWindow(0, 2048, 1), ScoreWindow(1, 2049, 2048)]
    program = ScriptedScoringProgram(max_context=2048)
    ids = [i % 500 for i in range(2049)]
    result = CausalScoreCore(program, 2048, 1024).score(ids, next_token=True)
    assert result.logprobs[2048] == -2047 - ids[2048] / 1000.0
    assert result.next_token is not None and result.next_token.logprob == -2048.0
    assert [len(w) for w in program.windows] == [2048, 2048]


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 60), window=st.integers(2, 16), data=st.data())
def test_each_token_is_scored_once_with_the_most_context(n: int, window: int, data: st.DataObject) -> None:
    stride = data.draw(st.integers(1, window - 1))
    program = ScriptedScoringProgram(max_context=16)
    result = CausalScoreCore(program, window, stride).score(list(range(n)))
    assert len(result.logprobs) == n and (n == 0 or result.logprobs[0] is None)
    for t in range(1, n):
        start = _scoring_start(t, n, stride, window)
        assert result.logprobs[t] == -(t - start) - t / 1000.0
        if t >= window:  # past the first window, tail tokens included: at least window - stride of context
            assert t - start >= window - stride
    assert all(len(w) == min(n, window) for w in program.windows)
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




@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 60), window=st.integers(2, 16), top_n=st.integers(0, 20), data=st.data())
def test_alternatives_and_next_token_come_from_the_right_window(
    n: int, window: int, top_n: int, data: st.DataObject
) -> None:
    stride = data.draw(st.integers(1, window - 1))
    ids = [100 + 7 * i for i in range(n)]
    program = ScriptedScoringProgram(max_context=16)
    result = CausalScoreCore(program, window, stride).score(ids, top_n=top_n, next_token=True)
    if top_n:
        assert len(result.top_logprobs) == n and (n == 0 or result.top_logprobs[0] is None)
    else:
        assert result.top_logprobs == ()
    for t in range(1, n):
        ctx = t - _scoring_start(t, n, stride, window)
        lp = -ctx - ids[t] / 1000.0
        assert result.logprobs[t] == lp
        if top_n:  # the same window as the logprob: same ctx, and the token's own value is the top-1
            assert result.top_logprobs[t] == tuple((ids[t] + j, lp - j) for j in range(top_n))
            assert result.top_logprobs[t][0][1] == result.logprobs[t]
    if n == 0:
        assert result.next_token is None and program.calls == []
        return
    # the window that ends at the last token, as long as the window allows
    last_start = _window_starts(n, stride, window)[-1]
    ctx = n - last_start
    assert ctx == min(n, window)
    assert result.next_token == TokenLogprob(
        ids[-1] + 1, -float(ctx), tuple((ids[-1] + 1 + j, -float(ctx) - j) for j in range(top_n))
    )
    assert [c[2] for c in program.calls] == [False] * (len(program.calls) - 1) + [True]
    assert program.calls[-1][0] == tuple(ids[last_start:])
    assert all(c[1] == top_n for c in program.calls)
    assert math.isclose(result.total_nll, -sum(lp for lp in result.logprobs if lp is not None))


def test_engine_score_defaults_add_nothing_and_validates_top_n() -> None:
    program = ScriptedScoringProgram(max_context=32)
    config = EngineConfig(purpose="causal_scoring", score_window=4, score_stride=2)
    engine = Engine.from_parts(program, ScriptedFrontend(), config)
    (plain,) = engine.score(["abcdef"])
    assert plain.top_logprobs == () and plain.next_token is None
    assert all(c[1:] == (0, False) for c in program.calls)
    (rich,) = engine.score(["abcdef"], top_n=3, next_token=True)
    assert rich.logprobs == plain.logprobs and rich.total_nll == plain.total_nll
    b_lp = -1 - ord("b") / 1000.0  # token 1 ("b") has one token of context in the first window
    assert rich.top_logprobs[1] == ((ord("b"), b_lp), (ord("b") + 1, b_lp - 1), (ord("b") + 2, b_lp - 2))
    # 6 tokens, window 4, stride 2: the last window is [2, 6), 4 tokens of context for the prediction
    assert rich.next_token == TokenLogprob(ord("f") + 1, -4.0, ((ord("f") + 1, -4.0), (ord("f") + 2, -5.0),
                                                                 (ord("f") + 3, -6.0)))
    (single,) = engine.score([[42]], next_token=True)  # no token to score, but a prediction
    assert single.logprobs == (None,) and single.next_token == TokenLogprob(43, -1.0, ())
    for bad in (-1, 21):
        with pytest.raises(RequestRejected, match="top_n must be 0..20") as info:
            engine.score(["ab"], top_n=bad)
        assert info.value.kind == "invalid_request"
    assert engine.availability.state == "ready"


class _UnsortedTop(ScriptedScoringProgram):
    def score_window(
        self, token_ids: Sequence[int], top_n: int = 0, *, predict_next: bool = False
    ) -> WindowScores:
        scores = super().score_window(token_ids, top_n, predict_next=predict_next)
        reversed_top = tuple(tuple(reversed(row)) for row in scores.top)
        return WindowScores(scores.logprobs, reversed_top, scores.next_top)


class _ShortTop(ScriptedScoringProgram):
    def score_window(
        self, token_ids: Sequence[int], top_n: int = 0, *, predict_next: bool = False
    ) -> WindowScores:
        scores = super().score_window(token_ids, top_n, predict_next=predict_next)
        return WindowScores(scores.logprobs, tuple(row[:-1] for row in scores.top), scores.next_top)


class _NoPrediction(ScriptedScoringProgram):
    def score_window(
        self, token_ids: Sequence[int], top_n: int = 0, *, predict_next: bool = False
    ) -> WindowScores:
        scores = super().score_window(token_ids, top_n)  # ignores predict_next
        return WindowScores(scores.logprobs, scores.top)


@pytest.mark.parametrize(
    ("program", "message"),
    [(_UnsortedTop(), "not sorted best first"), (_ShortTop(), "alternatives in the top-n of token 1"),
     (_NoPrediction(), "next-token alternatives")],
)
def test_malformed_program_answers_fail_the_engine(program: ScriptedScoringProgram, message: str) -> None:
    config = EngineConfig(purpose="causal_scoring", score_window=4, score_stride=2)
    engine = Engine.from_parts(program, ScriptedFrontend(), config)
    with pytest.raises(EngineFailed, match=message):
        engine.score(["abcdef"], top_n=2, next_token=True)
    assert engine.availability.state == "failed"
