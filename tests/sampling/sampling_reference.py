"""Plain per-row reference implementations the sampling tests compare against (float64, loops)."""

from __future__ import annotations

import math

from ninfer.ops.sampling import SamplingParams


def naive_kept(values: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Kept token ids for one row of scaled logits, straight from the definitions (float64, ties kept)."""
    kept = set(range(len(values)))
    if top_k > 0:
        kth = sorted(values, reverse=True)[min(top_k, len(values)) - 1]
        kept = {i for i in kept if values[i] >= kth}
    if top_p < 1:
        top = max(values[i] for i in kept)
        weight = {i: math.exp(values[i] - top) for i in kept}
        total = sum(weight.values())
        mass, last = 0.0, None
        for i in sorted(kept, key=lambda i: -values[i]):
            if mass >= top_p:
                break
            mass += weight[i] / total
            last = values[i]
        kept = {i for i in kept if values[i] >= last}
    if min_p > 0:
        top = max(values)
        total = sum(math.exp(v - top) for v in values)
        probs = [math.exp(v - top) / total for v in values]
        kept = {i for i in kept if probs[i] >= min_p * max(probs)}
    return kept


def naive_penalties(
    logits: list[list[float]],
    prompt: list[list[bool]],
    counts: list[list[int]],
    params: list[SamplingParams],
) -> list[list[float]]:
    out = []
    for row, seen_prompt, row_counts, p in zip(logits, prompt, counts, params):
        new_row = []
        for value, in_prompt, count in zip(row, seen_prompt, row_counts):
            if in_prompt or count > 0:
                value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            value -= p.frequency_penalty * count
            if count > 0:
                value -= p.presence_penalty
            new_row.append(value)
        out.append(new_row)
    return out
