"""Greedy agreement of two exact runs whose sums differ by the step's shape (a verify of K + 1 positions,
a prefill that starts at a checkpoint, a chunk padded to a graph's capacity): the tokens agree up to the
first position where the reference run's two best tokens are within ``NEAR_TIE[dtype]`` nats, and are
equal where they never come that close. In fp32 the shapes move logits by about 1e-6, so only true ties
may part; in bf16 by about 1e-2 of their size (logits of order 10), so the margin is wider there."""

from __future__ import annotations

from ninfer import GenerationResult

NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.25}


def assert_agree(got: GenerationResult, want: GenerationResult, dtype: str) -> None:
    """``want`` was asked with ``logprobs=True, top_logprobs=2``."""
    assert want.logprobs is not None
    for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
        if a != b:
            top = want.logprobs[i].top
            margin = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
            assert margin < NEAR_TIE[dtype], f"token {i}: {a} != {b} with a margin of {margin:.3f} nats"
            return
    assert len(got.token_ids) == len(want.token_ids)
