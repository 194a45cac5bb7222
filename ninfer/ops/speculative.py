"""Lossless verification of deterministic drafts (MTP, DFlash, a known continuation): the target's
choice at every position of a verify step, and how many drafts it accepts.

A verify step runs B rows of T = K + 1 tokens: row b's inputs are its last committed token and its K
drafts ``d_1..d_K``; the logits at position i (0-based) give the target's distribution ``p_i`` of the
token after input i. With deterministic drafts (the draft distribution is one-hot) the exact rule
(speculative-decoding.md section 5) is:

- greedy rows: ``y_i = argmax p_i``; draft ``d_{i+1}`` is accepted while it equals ``y_i``;
- sampled rows: draft ``d_{i+1}`` is accepted with probability ``p_i(d_{i+1})``; at the first rejection
  the token is drawn from ``p_i`` with ``d_{i+1}`` removed and renormalised; when every draft is accepted
  a bonus token is drawn from ``p_K``.

The row then produces ``a + 1`` tokens ``y_0..y_a`` (``a`` accepted drafts, ``y_i = d_{i+1}`` for
``i < a``), each distributed exactly as plain sampling would give it. ``p_i`` is the plain sampler's
distribution: penalties (output counts include the accepted drafts before position i), temperature,
top-k, top-p and min-p (`ninfer.ops.sampling`). Randomness is counter-based from the request's seed and
the absolute position of the token: the acceptance test draws from its own stream, the token draws use
the plain sampler's Gumbel noise, so a seeded row's output does not depend on the batch. No host sync
and static shapes: a verify step with this rule can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import fields
from typing import NamedTuple

import torch

from ninfer.ops.sampling import (
    MIN_TEMPERATURE,
    SamplingBatch,
    _log_exponential,
    apply_filters,
    apply_penalties,
    counter_uniform,
)

__all__ = ["ACCEPT_STREAM", "VerifyResult", "verify_drafts"]

ACCEPT_STREAM = 1  # the counter stream of the acceptance tests (the token draws use stream 0)


class VerifyResult(NamedTuple):
    tokens: torch.Tensor  # [B, T] int64: the target's token at each position (y_0..y_K)
    accepted: torch.Tensor  # [B] int64: drafts accepted, 0..K; the row produces tokens[:accepted + 1]
    logprob: torch.Tensor  # [B, T] float32: log_softmax(raw logits)[token] (zeros without with_logprob)
    top_ids: torch.Tensor  # [B, T, n] int64
    top_logprobs: torch.Tensor  # [B, T, n] float32


def _per_position(batch: SamplingBatch, tokens: int) -> SamplingBatch:
    """The rows' settings repeated for each of their ``tokens`` positions (row-major)."""
    values = {}
    for f in fields(SamplingBatch):
        value = getattr(batch, f.name)
        values[f.name] = value.repeat_interleave(tokens, dim=0) if isinstance(value, torch.Tensor) else value
    return SamplingBatch(**values)


def verify_drafts(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    batch: SamplingBatch,
    positions: torch.Tensor,
    prompt_mask: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
    num_logprobs: int = 0,
    with_logprob: bool = False,
    logit_bias: torch.Tensor | None = None,
) -> VerifyResult:
    """logits [B*T, V] (row-major, any float dtype); drafts [B, K] int64 (K = T - 1, may be 0);
    positions [B] int64, the absolute position of each row's first produced token (its frontier + 1);
    prompt_mask [B, V] / output_counts [B, V]: the plain sampler's penalty inputs (counts of the committed
    output, the drafts are added per position here); logit_bias [B*T, V] (row-major, like logits): added
    after the penalties, as in `sample`. See the module docstring."""
    rows, k = drafts.shape
    t = k + 1
    vocab = logits.shape[-1]
    if logits.shape[0] != rows * t:
        raise ValueError(f"logits has {logits.shape[0]} rows, expected {rows} x {t}")
    raw = logits.float()
    steps = _per_position(batch, t)
    token_positions = (positions.long().unsqueeze(1) + torch.arange(t, device=positions.device)).flatten()
    if prompt_mask is None and output_counts is None:
        penalised = raw
    else:
        counts = None
        if output_counts is not None:
            # position i sees the output so far plus the drafts d_1..d_i it was fed
            seen = torch.zeros(rows, t, vocab, dtype=output_counts.dtype, device=output_counts.device)
            if k:
                onehot = torch.zeros(rows, k, vocab, dtype=output_counts.dtype, device=output_counts.device)
                onehot.scatter_(2, drafts.unsqueeze(2), 1)
                seen[:, 1:] = onehot.cumsum(dim=1)
            counts = (seen + output_counts.unsqueeze(1)).flatten(0, 1)
        mask = prompt_mask.repeat_interleave(t, dim=0) if prompt_mask is not None else None
        penalised = apply_penalties(raw, mask, counts, steps)
    if logit_bias is not None:
        penalised = penalised + logit_bias
    argmax = penalised.argmax(dim=-1).view(rows, t)
    if batch.all_greedy:
        tokens = argmax
        accept = drafts == argmax[:, :k]
    else:
        temperature = torch.where(steps.greedy, 1.0, steps.temperature.clamp(min=MIN_TEMPERATURE))
        filtered = apply_filters(
            penalised / temperature.unsqueeze(1), steps.top_k, steps.top_p, steps.min_p, steps.candidates
        ).view(rows, t, vocab)
        draft_prob = filtered[:, :k].softmax(dim=-1).gather(2, drafts.unsqueeze(2)).squeeze(2)
        seeds = batch.seed.repeat_interleave(k)
        draft_positions = token_positions.view(rows, t)[:, :k].flatten()
        zero = torch.zeros(1, dtype=torch.int64, device=logits.device)
        uniform = counter_uniform(seeds, draft_positions, zero, stream=ACCEPT_STREAM).view(rows, k)
        noise = _log_exponential(steps.seed, token_positions, vocab, stream=0).view(rows, t, vocab)
        # rejected draft i: a draw from p_i without d_{i+1}; the last position: a draw from p_K
        without = filtered.clone()
        without[:, :k].scatter_(2, drafts.unsqueeze(2), float("-inf"))
        drawn = (without - noise).argmax(dim=-1)
        sampled_accept = uniform < draft_prob
        sampled = torch.where(sampled_accept, drafts, drawn[:, :k])
        sampled = torch.cat((sampled, drawn[:, k:]), dim=1)
        greedy = batch.greedy.unsqueeze(1)
        tokens = torch.where(greedy, argmax, sampled)
        accept = torch.where(greedy, drafts == argmax[:, :k], sampled_accept)
    accepted = accept.long().cumprod(dim=1).sum(dim=1) if k else torch.zeros_like(positions.long())

    if not with_logprob:
        if num_logprobs:
            raise ValueError("num_logprobs needs with_logprob=True")
        empty = torch.empty((rows, t, 0), device=logits.device)
        return VerifyResult(tokens, accepted, torch.zeros(rows, t, device=logits.device), empty.long(), empty)
    log_normaliser = torch.logsumexp(raw, dim=-1)
    chosen = raw.gather(1, tokens.view(-1, 1)).squeeze(1) - log_normaliser
    if num_logprobs > 0:
        top_values, top_ids = raw.topk(num_logprobs, dim=-1)
        top_logprobs = (top_values - log_normaliser.unsqueeze(1)).view(rows, t, -1)
        top_ids = top_ids.view(rows, t, -1)
    else:
        top_ids = torch.empty((rows, t, 0), dtype=torch.int64, device=logits.device)
        top_logprobs = torch.empty((rows, t, 0), dtype=torch.float32, device=logits.device)
    return VerifyResult(tokens, accepted, chosen.view(rows, t), top_ids, top_logprobs)
