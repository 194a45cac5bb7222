"""`ninfer.ops.speculative.verify_drafts`: the exact acceptance rule for deterministic drafts.

- Greedy rows: the target's argmax at every position (penalties counting the drafts the position was
  fed), drafts accepted while they equal it.
- Sampled rows: the first produced token is distributed exactly as plain sampling's (chi-square over
  many seeds, at several temperatures, with top-k and top-p), and so is the token after an accepted
  draft; a deliberately wrong rule (resampling a rejected draft without removing it) fails the same
  test (the negative control). Seeded rows repeat exactly and do not depend on the rows beside them.
"""

from __future__ import annotations

import math

import pytest
import torch

from ninfer.ops.sampling import SamplingBatch, SamplingParams, apply_filters, sample
from ninfer.ops.speculative import verify_drafts

torch.set_num_threads(1)

VOCAB = 6
SAMPLES = 6000


def _batch(params: list[SamplingParams], seeds: list[int]) -> SamplingBatch:
    return SamplingBatch.build(params, seeds, "cpu")


def _target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Plain sampling's distribution of one row: temperature, then the filters."""
    batch = _batch([params], [0])
    scaled = logits.unsqueeze(0) / params.temperature
    filtered = apply_filters(scaled, batch.top_k, batch.top_p, batch.min_p, batch.candidates)
    return filtered.softmax(-1)[0]


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of a chi-square goodness-of-fit test (cells with expected count > 0)."""
    n = counts.sum().item()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was produced"
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum().item()
    dof = int(keep.sum()) - 1
    # survival function of chi-square via the regularised upper incomplete gamma (torch.special)
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)
        )
    )


def _logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=g) * 1.5


def _first_tokens(logits: torch.Tensor, draft: int, params: SamplingParams, start: int) -> torch.Tensor:
    """y_0 of SAMPLES rows (distinct seeds) verifying one draft against the same two positions."""
    rows = SAMPLES
    both = torch.stack([logits, logits.roll(1)])  # positions 0 and 1 (position 1's logits differ)
    result = verify_drafts(
        both.repeat(rows, 1),
        torch.full((rows, 1), draft, dtype=torch.long),
        _batch([params] * rows, list(range(start, start + rows))),
        torch.full((rows,), 17, dtype=torch.long),
    )
    return result.tokens, result.accepted


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(temperature=0.9, top_p=0.8),
    ],
    ids=["t1", "t0.6", "topk", "topp"],
)
def test_first_token_is_distributed_as_plain_sampling(params: SamplingParams) -> None:
    logits = _logits(1)
    probs = _target_probs(logits, params)
    draft = int(probs.argsort()[-2])  # a likely, not the likeliest, token
    tokens, accepted = _first_tokens(logits, draft, params, start=1000)
    counts = torch.bincount(tokens[:, 0], minlength=VOCAB).double()
    assert _chi_square_p(counts, probs.double()) > 1e-3
    # acceptance happens with probability p(draft)
    rate = accepted.double().mean().item()
    assert abs(rate - probs[draft].item()) < 4 * math.sqrt(probs[draft].item() / SAMPLES)
    # after an accepted draft, the next token follows position 1's distribution
    after = tokens[accepted == 1, 1]
    counts = torch.bincount(after, minlength=VOCAB).double()
    assert _chi_square_p(counts, _target_probs(logits.roll(1), params).double()) > 1e-3


def test_a_wrong_rule_fails_the_same_test() -> None:
    """Negative control: resampling a rejected draft from p without removing the draft (a classic bug)
    over-produces the draft; the chi-square test that the real rule passes rejects it."""
    params = SamplingParams(temperature=1.0)
    logits = _logits(1)
    probs = _target_probs(logits, params)
    draft = int(probs.argsort()[-2])
    rows = SAMPLES
    batch = _batch([params] * rows, list(range(1000, 1000 + rows)))
    accepted = torch.rand(rows, generator=torch.Generator().manual_seed(3)) < probs[draft]
    resampled = sample(logits.repeat(rows, 1), batch, torch.full((rows,), 17)).tokens
    wrong = torch.where(accepted, torch.tensor(draft), resampled)
    counts = torch.bincount(wrong, minlength=VOCAB).double()
    assert _chi_square_p(counts, probs.double()) < 1e-6


def test_greedy_rows_take_the_argmax_and_accept_matching_drafts() -> None:
    g = torch.Generator().manual_seed(4)
    rows, k = 3, 3
    logits = torch.randn(rows * (k + 1), 50, generator=g)
    argmax = logits.argmax(-1).view(rows, k + 1)
    drafts = argmax[:, :k].clone()
    drafts[0, 1] += 1  # row 0: rejected at its second draft
    drafts[2, 0] += 1  # row 2: its first draft is wrong
    result = verify_drafts(
        logits,
        drafts % 50,
        _batch([SamplingParams(temperature=0.0)] * rows, [1, 2, 3]),
        torch.tensor([5, 6, 7]),
    )
    assert torch.equal(result.tokens, argmax)
    assert result.accepted.tolist() == [1, 3, 0]


def test_penalties_count_the_drafts_each_position_was_fed() -> None:
    """With a frequency penalty, position i's logits are penalised for the drafts d_1..d_i it saw (on top
    of the committed output): the same tokens as plain greedy sampling with those counts."""
    g = torch.Generator().manual_seed(5)
    vocab, k = 8, 2
    logits = torch.randn(k + 1, vocab, generator=g)
    drafts = torch.tensor([[3, 5]])
    params = SamplingParams(temperature=0.0, frequency_penalty=1.5, repetition_penalty=1.2)
    counts = torch.zeros(1, vocab, dtype=torch.int32)
    counts[0, 1] = 2
    mask = torch.zeros(1, vocab, dtype=torch.bool)
    mask[0, 4] = True
    batch = _batch([params], [9])
    got = verify_drafts(logits, drafts, batch, torch.tensor([3]), prompt_mask=mask, output_counts=counts)
    for i in range(k + 1):
        seen = counts.clone()
        for d in drafts[0, :i].tolist():
            seen[0, d] += 1
        want = sample(logits[i : i + 1], batch, torch.tensor([3 + i]), prompt_mask=mask, output_counts=seen)
        assert got.tokens[0, i] == want.tokens[0], i


def test_seeded_rows_repeat_and_ignore_their_neighbours() -> None:
    g = torch.Generator().manual_seed(6)
    k, vocab = 2, 40
    logits = torch.randn(4 * (k + 1), vocab, generator=g)
    drafts = torch.randint(0, vocab, (4, k), generator=g)
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0), SamplingParams(top_p=0.7),
              SamplingParams(temperature=1.2, top_k=5)]  # fmt: skip
    seeds = [11, 12, 13, 14]
    positions = torch.tensor([30, 31, 32, 33])
    full = verify_drafts(logits, drafts, _batch(params, seeds), positions, with_logprob=True, num_logprobs=2)
    again = verify_drafts(logits, drafts, _batch(params, seeds), positions, with_logprob=True, num_logprobs=2)
    assert torch.equal(full.tokens, again.tokens) and torch.equal(full.accepted, again.accepted)
    for r in range(4):  # each row alone gives its own result
        alone = verify_drafts(
            logits[r * (k + 1) : (r + 1) * (k + 1)], drafts[r : r + 1], _batch([params[r]], [seeds[r]]),
            positions[r : r + 1], with_logprob=True, num_logprobs=2,
        )  # fmt: skip
        assert torch.equal(alone.tokens[0], full.tokens[r]) and alone.accepted[0] == full.accepted[r]
        torch.testing.assert_close(alone.logprob[0], full.logprob[r])
    raw = logits.log_softmax(-1).view(4, k + 1, vocab)
    torch.testing.assert_close(full.logprob, raw.gather(2, full.tokens.unsqueeze(2)).squeeze(2))
