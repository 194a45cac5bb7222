"""SamplingParams validation and SamplingBatch construction / in-place update."""

from __future__ import annotations

import pytest
import torch

from ninfer.ops.sampling import ALL_CANDIDATES, SamplingBatch, SamplingParams, sample, wrap_seed
from ninfer.runtime.contract.types import LogprobParams

torch.set_num_threads(1)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"temperature": -0.1}, r"temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, r"temperature must be a finite number >= 0"),
        ({"top_k": -1}, r"top_k must be an integer >= 0 \(0 = off\)"),
        ({"top_k": 2.5}, r"top_k must be an integer"),
        ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\]"),
        ({"min_p": -0.1}, r"min_p must be a number in \[0, 1\]"),
        ({"min_p": 1.01}, r"min_p must be a number in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be a finite number > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
        ({"frequency_penalty": -2.01}, r"frequency_penalty must be a number in \[-2, 2\]"),
        ({"seed": 1 << 64}, r"seed must be None or an integer in \[-2\*\*63, 2\*\*64 - 1\]"),
        ({"seed": True}, r"seed must be None or an integer"),
    ],
)
def test_validate_names_field_and_range(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern) as info:
        SamplingParams(**kwargs).validate()
    assert repr(next(iter(kwargs.values()))) in str(info.value)  # the bad value is echoed


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"top_n": 21}, r"logprobs must be None or an integer in \[0, 20\]"),
        ({"top_n": -1}, r"logprobs must be None or an integer in \[0, 20\]"),
    ],
)
def test_logprob_params_validate_names_field_and_range(kwargs: dict[str, object], pattern: str) -> None:
    """How many top log-probs a row carries is the request's LogprobParams (one value, not a twin field
    of the sampling settings)."""
    with pytest.raises(ValueError, match=pattern) as info:
        LogprobParams(enabled=True, **kwargs).validate()  # type: ignore[arg-type]
    assert repr(next(iter(kwargs.values()))) in str(info.value)  # the bad value is echoed


def test_validate_accepts_edges() -> None:
    for params in (
        SamplingParams(),
        SamplingParams(temperature=0.0, top_k=1, top_p=1e-6, min_p=1.0, seed=-(1 << 63)),
        SamplingParams(presence_penalty=-2, frequency_penalty=2, seed=(1 << 64) - 1),
    ):
        params.validate()
    for logprobs in (LogprobParams(True, 0), LogprobParams(True, 20)):
        logprobs.validate()


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams().greedy


def test_build_tensors_and_static_facts() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.95, min_p=0.05),
        SamplingParams(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5),
    ]
    batch = SamplingBatch.build(params, [1, -1, (1 << 64) - 2], "cpu")
    assert batch.size == 3
    assert batch.temperature.dtype == torch.float32 and batch.top_k.dtype == torch.int32
    assert batch.seed.dtype == torch.int64 and batch.greedy.dtype == torch.bool
    assert batch.greedy.tolist() == [True, False, False]
    assert batch.top_k.tolist() == [0, 20, 0]
    assert batch.seed.tolist() == [1, -1, -2]
    assert torch.allclose(batch.top_p, torch.tensor([1.0, 0.95, 1.0]))
    assert torch.allclose(batch.repetition_penalty, torch.tensor([1.0, 1.0, 1.1]))
    assert batch.candidates == 20 and not batch.all_greedy
    full = SamplingBatch.build([SamplingParams(top_p=0.5), SamplingParams(top_k=5)], [0, 0], "cpu")
    assert full.candidates == ALL_CANDIDATES
    assert SamplingBatch.build([SamplingParams()], [0], "cpu").candidates == 0
    assert SamplingBatch.build([SamplingParams(temperature=0)] * 2, [0, 0], "cpu").all_greedy


def test_build_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="2 SamplingParams but 1 seeds"):
        SamplingBatch.build([SamplingParams(), SamplingParams()], [0], "cpu")
    with pytest.raises(ValueError, match="top_p"):
        SamplingBatch.build([SamplingParams(top_p=2.0)], [0], "cpu")


def test_wrap_seed() -> None:
    assert wrap_seed(-1) == wrap_seed((1 << 64) - 1) == -1
    assert wrap_seed(1 << 63) == -(1 << 63)
    assert wrap_seed(12345) == 12345


def test_update_in_place_matches_fresh_build() -> None:
    logits = torch.linspace(-3, 3, 4 * 97).reshape(4, 97).sin() * 4
    positions = torch.tensor([5, 9, 11, 400])
    first = [SamplingParams(temperature=0)] * 4
    second = [
        SamplingParams(top_k=7),
        SamplingParams(temperature=0.5, top_p=0.8),
        SamplingParams(temperature=0),
        SamplingParams(min_p=0.1, temperature=2.0),
    ]
    seeds = [3, 4, 5, 6]
    batch = SamplingBatch.build(first, [0] * 4, "cpu")
    storage = [t.data_ptr() for t in (batch.temperature, batch.top_k, batch.seed, batch.greedy)]
    batch.update(second, seeds)
    assert storage == [t.data_ptr() for t in (batch.temperature, batch.top_k, batch.seed, batch.greedy)]
    fresh = SamplingBatch.build(second, seeds, "cpu")
    assert batch.candidates == fresh.candidates == ALL_CANDIDATES and not batch.all_greedy
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "greedy"):
        assert torch.equal(getattr(batch, name), getattr(fresh, name)), name
    assert torch.equal(sample(logits, batch, positions).tokens, sample(logits, fresh, positions).tokens)
    with pytest.raises(ValueError, match="batch has 4 rows"):
        batch.update(second[:2], seeds[:2])
