"""Penalties, greedy, top-k / top-p / min-p and log-probs against naive per-row implementations."""

from __future__ import annotations

import torch
from sampling_reference import naive_kept, naive_penalties

from ninfer.ops.sampling import (
    SamplingBatch,
    SamplingParams,
    apply_filters,
    apply_penalties,
    sample,
)

torch.set_num_threads(1)


def kept_sets(filtered: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in filtered]


ROW_FILTERS = [  # (top_k, top_p, min_p)
    (0, 1.0, 0.0),
    (1, 1.0, 0.0),
    (5, 1.0, 0.0),
    (0, 0.5, 0.0),
    (0, 0.9, 0.0),
    (10, 0.8, 0.0),
    (0, 1.0, 0.1),
    (20, 0.95, 0.05),
    (3, 0.3, 0.0),
    (0, 0.999, 0.3),
    (100, 1.0, 0.0),  # top_k above the vocabulary size
    (7, 1.0, 1.0),
]


def _filters_tensors(rows: list[tuple[int, float, float]]) -> tuple[torch.Tensor, ...]:
    top_k = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    top_p = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    min_p = torch.tensor([r[2] for r in rows], dtype=torch.float32)
    return top_k, top_p, min_p


def test_filters_match_naive_full_sort() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 60
    for trial in range(3):
        scaled = torch.randn(len(ROW_FILTERS), vocab, generator=gen) * (1.0 + 2 * trial)
        filtered = apply_filters(scaled, *_filters_tensors(ROW_FILTERS))
        expected = [naive_kept(row.tolist(), *f) for row, f in zip(scaled.double(), ROW_FILTERS)]
        assert kept_sets(filtered) == expected
        # kept values are untouched
        assert torch.equal(filtered[torch.isfinite(filtered)], scaled[torch.isfinite(filtered)])


def test_filters_match_naive_with_ties() -> None:
    """Coarse logits (like bf16) tie a lot; value thresholds keep whole tie groups."""
    gen = torch.Generator().manual_seed(1)
    scaled = (torch.randn(len(ROW_FILTERS), 40, generator=gen) * 2).round() / 2
    filtered = apply_filters(scaled, *_filters_tensors(ROW_FILTERS))
    expected = [naive_kept(row.tolist(), *f) for row, f in zip(scaled.double(), ROW_FILTERS)]
    assert kept_sets(filtered) == expected


def test_filters_candidate_width_path() -> None:
    """When every row has top_k > 0 only the top `candidates` values are sorted (torch.topk)."""
    gen = torch.Generator().manual_seed(2)
    rows = [(1, 1.0, 0.0), (4, 0.7, 0.0), (9, 0.9, 0.02), (12, 1.0, 0.2), (12, 0.5, 0.0)]
    scaled = torch.randn(len(rows), 500, generator=gen) * 2
    narrow = apply_filters(scaled, *_filters_tensors(rows), candidates=12)
    full = apply_filters(scaled, *_filters_tensors(rows))
    assert torch.equal(narrow, full)
    expected = [naive_kept(row.tolist(), *f) for row, f in zip(scaled.double(), rows)]
    assert kept_sets(narrow) == expected


def _penalty_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[SamplingParams]]:
    gen = torch.Generator().manual_seed(3)
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.8, presence_penalty=0.7),
        SamplingParams(frequency_penalty=0.4, presence_penalty=-1.0, repetition_penalty=2.0),
        SamplingParams(frequency_penalty=-2.0, temperature=0),
    ]
    vocab = 30
    logits = torch.randn(len(params), vocab, generator=gen) * 3
    prompt_mask = torch.rand(len(params), vocab, generator=gen) < 0.3
    counts = torch.randint(0, 4, (len(params), vocab), generator=gen, dtype=torch.int32)
    counts[torch.rand(len(params), vocab, generator=gen) < 0.6] = 0
    return logits, prompt_mask, counts, params


def test_penalties_match_naive_loop() -> None:
    logits, prompt_mask, counts, params = _penalty_case()
    batch = SamplingBatch.build(params, [0] * len(params), "cpu")
    got = apply_penalties(logits, prompt_mask, counts, batch)
    want = naive_penalties(logits.tolist(), prompt_mask.tolist(), counts.tolist(), params)
    assert torch.allclose(got, torch.tensor(want), rtol=1e-6, atol=1e-6)
    assert torch.equal(logits, _penalty_case()[0])  # input untouched
    # only one of the two sources given
    no_output = naive_penalties(logits.tolist(), prompt_mask.tolist(), [[0] * 30] * 5, params)
    assert torch.allclose(apply_penalties(logits, prompt_mask, None, batch), torch.tensor(no_output))
    no_prompt = naive_penalties(logits.tolist(), [[False] * 30] * 5, counts.tolist(), params)
    assert torch.allclose(apply_penalties(logits, None, counts, batch), torch.tensor(no_prompt), atol=1e-6)


def test_greedy_rows_take_argmax_of_penalised_logits() -> None:
    logits, prompt_mask, counts, _ = _penalty_case()
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=1.0),
        SamplingParams(temperature=0.9, top_k=3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, presence_penalty=2.0),
        SamplingParams(temperature=1.0),
    ]
    batch = SamplingBatch.build(params, [11, 12, 13, 14, 15], "cpu")
    want = naive_penalties(logits.tolist(), prompt_mask.tolist(), counts.tolist(), params)
    want_argmax = torch.tensor(want).argmax(-1)
    for start in (0, 1000, 77777):
        positions = torch.arange(5) + start
        result = sample(logits, batch, positions, prompt_mask, counts)
        assert result.tokens.dtype == torch.int64
        for row in (0, 2, 3):  # greedy: independent of seed and position
            assert result.tokens[row] == want_argmax[row]
    # an all-greedy batch is the plain argmax (bf16 input accepted)
    all_greedy = SamplingBatch.build([SamplingParams(temperature=0)] * 5, [0] * 5, "cpu")
    bf16 = logits.bfloat16()
    assert torch.equal(sample(bf16, all_greedy, torch.arange(5)).tokens, bf16.float().argmax(-1))


def test_sampled_tokens_stay_in_kept_set() -> None:
    gen = torch.Generator().manual_seed(4)
    vocab, draws = 50, 400
    base = torch.randn(vocab, generator=gen) * 2
    for top_k, top_p, min_p in ROW_FILTERS:
        params = SamplingParams(temperature=1.7, top_k=top_k, top_p=top_p, min_p=min_p)
        batch = SamplingBatch.build([params] * draws, [99] * draws, "cpu")
        tokens = sample(base.expand(draws, vocab), batch, torch.arange(draws)).tokens
        kept = naive_kept((base.double() / 1.7).tolist(), top_k, top_p, min_p)
        assert set(tokens.tolist()) <= kept
        if len(kept) >= 3:
            assert len(set(tokens.tolist())) >= 2  # it really samples


def test_logprobs_are_raw_log_softmax() -> None:
    logits, prompt_mask, counts, _ = _penalty_case()
    params = [
        SamplingParams(temperature=0.3, top_k=4, repetition_penalty=1.8),
        SamplingParams(temperature=0, frequency_penalty=2.0),
        SamplingParams(temperature=1.5, top_p=0.5, presence_penalty=-2.0),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=0.01),
    ]
    batch = SamplingBatch.build(params, [1, 2, 3, 4, 5], "cpu")
    result = sample(logits, batch, torch.arange(5) * 3, prompt_mask, counts, num_logprobs=5)
    reference = torch.log_softmax(logits.double(), dim=-1)
    chosen = reference.gather(1, result.tokens[:, None])[:, 0]
    assert torch.allclose(result.logprob.double(), chosen, atol=1e-5)
    top_values, top_ids = reference.topk(5, dim=-1)
    assert torch.equal(result.top_ids, top_ids)
    assert torch.allclose(result.top_logprobs.double(), top_values, atol=1e-5)
    assert result.logprob.dtype == torch.float32 and result.top_logprobs.dtype == torch.float32
    empty = sample(logits, batch, torch.arange(5), num_logprobs=0)
    assert empty.top_ids.shape == (5, 0) and empty.top_logprobs.shape == (5, 0)
