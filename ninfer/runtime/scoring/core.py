"""CausalScoreCore: offline causal scoring of texts through a ``ScoringProgram``, one window at a time.

No request, continuation, checkpoint or cache entry exists here: each window runs on temporary, empty
State and Main KV inside the Program, serially. Window placement (``score_window``/``score_stride``):

- a text of ``n <= window`` tokens is scored in one window;
- a longer text is scored in windows ``[s, s + window)`` for ``s = 0, stride, 2*stride, ...`` until a
  window reaches the last token;
- each token takes its logprob from the *first* window that scores it (the earliest-starting window
  that holds the token with at least one token before it), which is the window giving it the most
  context; the first token of the text has no context and no logprob.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ninfer.runtime.contract.types import ScoringProgram
from ninfer.types import ScoreResult


@dataclass(frozen=True)
class ScoreWindow:
    """One Program call: tokens ``[start, end)``; it assigns logprobs to tokens ``[first_new, end)``."""

    start: int
    end: int
    first_new: int


def plan_windows(n_tokens: int, window: int, stride: int) -> list[ScoreWindow]:
    """Windows that score tokens ``1..n_tokens-1`` exactly once, each with the most context available."""
    if window < 2 or not 1 <= stride < window:
        raise ValueError(f"need window >= 2 and 1 <= stride < window, got window={window}, stride={stride}")
    windows: list[ScoreWindow] = []
    scored_upto = 1  # tokens below this index already have their logprob (token 0 never has one)
    start = 0
    while scored_upto < n_tokens:
        end = min(start + window, n_tokens)
        if end > scored_upto:
            windows.append(ScoreWindow(start, end, scored_upto))
            scored_upto = end
        start += stride
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

    def score(self, token_ids: Sequence[int]) -> ScoreResult:
        ids = tuple(token_ids)
        logprobs: list[float | None] = [None] * len(ids)
        for w in plan_windows(len(ids), self.window, self.stride):
            window_lps = list(self._program.score_window(ids[w.start : w.end]))
            if len(window_lps) != w.end - w.start - 1:
                raise RuntimeError(
                    f"score_window returned {len(window_lps)} logprobs for {w.end - w.start} tokens"
                )
            for t in range(w.first_new, w.end):
                value = float(window_lps[t - w.start - 1])
                if math.isnan(value) or value > 1e-6:
                    raise RuntimeError(f"score_window returned an invalid logprob {value} at token {t}")
                logprobs[t] = value
        total_nll = -math.fsum(lp for lp in logprobs if lp is not None)
        return ScoreResult(token_ids=ids, logprobs=tuple(logprobs), total_nll=total_nll)
