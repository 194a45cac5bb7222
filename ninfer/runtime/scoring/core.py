"""CausalScoreCore: offline causal scoring of texts through a ``ScoringProgram``, one window at a time.

No request, continuation, checkpoint or cache entry exists here: each window runs on temporary, empty
State and Main KV inside the Program, serially. Window placement (``score_window``/``score_stride``):

- a text of ``n <= window`` tokens is scored in one window ``[0, n)``;
- a longer text is scored in windows ``[s, s + window)`` for ``s = 0, stride, 2*stride, ...`` while such a
  window ends before the last token, then in one last window aligned to the end of the text,
  ``[n - window, n)``, which starts at most ``stride`` tokens after the window before it;
- each token takes its logprob from the *first* window that holds it with at least one token before it;
  all windows but a short text's have ``window`` tokens, so the earliest-starting one gives it the most
  context: every token past the first window gets at least ``window - stride`` tokens of context, the
  tail tokens included (the last window is not cut short where the text ends); the first token of the
  text has no context and no logprob;
- a token's top-n alternatives come from the same window as its logprob (the same logits), so a greedy
  token's logprob equals its top-1 value exactly;
- the prediction after the last token (``next_token``) comes from the last window, the one that ends at
  the last token, with ``min(n, window)`` tokens of context; a one-token text gets a one-token window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ninfer.runtime.contract.types import ScoringProgram, TokenLogprob, TopLogprobs, WindowScores
from ninfer.types import MAX_TOP_LOGPROBS, ScoreResult


@dataclass(frozen=True)
class ScoreWindow:
    """One Program call: tokens ``[start, end)``; it assigns logprobs to tokens ``[first_new, end)``."""

    start: int
    end: int
    first_new: int


def plan_windows(n_tokens: int, window: int, stride: int) -> list[ScoreWindow]:
    """Windows that score tokens ``1..n_tokens-1`` exactly once, each with the most context available
    (see the module docstring): stride-aligned windows, then one window ending at the last token."""
    if window < 2 or not 1 <= stride < window:
        raise ValueError(f"need window >= 2 and 1 <= stride < window, got window={window}, stride={stride}")
    if n_tokens < 2:
        return []  # nothing to score: token 0 never has a logprob
    windows: list[ScoreWindow] = []
    first_new = 1  # tokens below this index already have their logprob
    start = 0
    while start + window < n_tokens:  # a full stride-aligned window that stops short of the last token
        windows.append(ScoreWindow(start, start + window, first_new))
        first_new = start + window
        start += stride
    # the last window ends at the last token with as much context as the window allows, so the tail
    # tokens and the next-token prediction never get a short window that merely starts at a stride multiple
    windows.append(ScoreWindow(max(0, n_tokens - window), n_tokens, first_new))
    return windows


class CausalScoreCore:
    """Scores token sequences serially through ``program.score_window`` (see module docstring)."""

    def __init__(self, program: ScoringProgram, window: int, stride: int) -> None:
        if window > program.max_context:
            raise ValueError(
                f"score_window={window} exceeds the Program's max_context={program.max_context}; "
                "lower score_window"
            )
        plan_windows(2, window, stride)  # validates window/stride
        self._program = program
        self.window = window
        self.stride = stride

    def score(self, token_ids: Sequence[int], *, top_n: int = 0, next_token: bool = False) -> ScoreResult:
        """Logprobs of ``token_ids[1:]``; with ``top_n`` their alternatives; with ``next_token`` the
        greedy prediction after the last token."""
        if not 0 <= top_n <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_n must be 0..{MAX_TOP_LOGPROBS}, got {top_n}")
        ids = tuple(token_ids)
        n = len(ids)
        logprobs: list[float | None] = [None] * n
        tops: list[TopLogprobs | None] = [None] * n
        windows = plan_windows(n, self.window, self.stride)
        if next_token and n == 1:
            windows = [ScoreWindow(0, 1, 1)]  # nothing to score, but the next token can be predicted
        predicted: TokenLogprob | None = None
        for w in windows:
            last = next_token and w.end == n  # only the final window ends at the last token
            scores = self._program.score_window(ids[w.start : w.end], top_n, predict_next=last)
            self._check(scores, w, top_n, last)
            for t in range(w.first_new, w.end):
                logprobs[t] = float(scores.logprobs[t - w.start - 1])
                if top_n:
                    tops[t] = _pairs(scores.top[t - w.start - 1])
            if last:
                next_top = _pairs(scores.next_top)
                predicted = TokenLogprob(next_top[0][0], next_top[0][1], next_top[:top_n])
        if next_token and n and predicted is None:
            raise RuntimeError(f"no scoring window ended at the last token ({n}); windows {windows}")
        total_nll = -math.fsum(lp for lp in logprobs if lp is not None)
        return ScoreResult(
            token_ids=ids,
            logprobs=tuple(logprobs),
            total_nll=total_nll,
            top_logprobs=tuple(tops) if top_n else (),
            next_token=predicted,
        )

    @staticmethod
    def _check(scores: WindowScores, w: ScoreWindow, top_n: int, predict_next: bool) -> None:
        """Refuse a malformed Program answer (wrong counts, NaN, positive logprobs, unsorted top-n):
        publishing it would hand users wrong numbers."""
        size = w.end - w.start
        if len(scores.logprobs) != size - 1:
            raise RuntimeError(f"score_window returned {len(scores.logprobs)} logprobs for {size} tokens")
        if len(scores.top) != (size - 1 if top_n else 0):
            raise RuntimeError(f"score_window returned {len(scores.top)} top-n lists for {size} tokens")
        if len(scores.next_top) != (max(top_n, 1) if predict_next else 0):
            raise RuntimeError(f"score_window returned {len(scores.next_top)} next-token alternatives")
        for i, value in enumerate(scores.logprobs):
            _check_logprob(value, f"token {w.start + i + 1}")
        for i, top in enumerate(scores.top):
            where = f"the top-n of token {w.start + i + 1}"
            if len(top) != top_n:
                raise RuntimeError(f"score_window returned {len(top)} alternatives in {where}, not {top_n}")
            _check_top(top, where)
        _check_top(scores.next_top, "the next-token top-n")


def _pairs(top: TopLogprobs) -> TopLogprobs:
    """Plain ``(int, float)`` pairs, whatever number types the Program used."""
    return tuple((int(token_id), float(value)) for token_id, value in top)


def _check_logprob(value: float, where: str) -> None:
    if math.isnan(value) or value > 1e-6:
        raise RuntimeError(f"score_window returned an invalid logprob {value} at {where}")


def _check_top(top: TopLogprobs, where: str) -> None:
    for _, value in top:
        _check_logprob(value, where)
    if any(a[1] < b[1] for a, b in zip(top, top[1:])):
        raise RuntimeError(f"score_window returned alternatives not sorted best first in {where}")
