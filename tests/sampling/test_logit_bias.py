"""logit_bias and min_tokens in the sampler (`sample`, `verify_drafts`) and end to end through the public
Engine on the bundled demo model: -100 never yields the token, +100 always does, greedy and sampled; the
end-of-sequence ids are held back for the first min_tokens tokens; the reported log-probs stay the model's."""

from __future__ import annotations

import pytest
import torch

from ninfer import Engine, EngineConfig, GenerationRequest
from ninfer.cli.common import bundled_artifact
from ninfer.ops.sampling import SamplingBatch, SamplingParams, sample
from ninfer.ops.speculative import verify_drafts
from ninfer.types import RequestRejected

VOCAB = 64


def _batch(params: list[SamplingParams]) -> SamplingBatch:
    return SamplingBatch.build(params, [11 + i for i in range(len(params))], "cpu")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_bias_bans_and_forces(temperature: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, VOCAB) * 3
    batch = _batch([SamplingParams(temperature=temperature)] * 16)
    positions = torch.arange(16)
    plain = sample(logits, batch, positions).tokens
    ban = torch.zeros(16, VOCAB)
    ban[torch.arange(16), plain] = -100.0
    banned = sample(logits, batch, positions, logit_bias=ban).tokens
    assert not (banned == plain).any()
    force = torch.zeros(16, VOCAB)
    force[:, 5] = 100.0
    forced = sample(logits, batch, positions, logit_bias=force, num_logprobs=2)
    assert (forced.tokens == 5).all()
    # the reported log-probs are the model's own, not the biased ones
    expected = torch.log_softmax(logits, -1)[:, 5]
    assert torch.allclose(forced.logprob, expected)


def test_verify_bias_per_position() -> None:
    """A verify step of T = 3 positions per row: a ban at the draft's own id rejects it."""
    torch.manual_seed(1)
    rows, t = 2, 3
    logits = torch.randn(rows * t, VOCAB)
    batch = _batch([SamplingParams(temperature=0.0)] * rows)
    greedy = logits.argmax(-1).view(rows, t)
    drafts = greedy[:, :2].clone()  # the target's own tokens: both accepted
    positions = torch.tensor([10, 20])
    assert verify_drafts(logits, drafts, batch, positions).accepted.tolist() == [2, 2]
    bias = torch.zeros(rows * t, VOCAB)
    bias[0, drafts[0, 0]] = -100.0  # row 0, position 0
    result = verify_drafts(logits, drafts, batch, positions, logit_bias=bias)
    assert result.accepted.tolist() == [0, 2]
    assert result.tokens[0, 0] != drafts[0, 0]


def test_sampling_params_validate_bias() -> None:
    SamplingParams(logit_bias=((3, -100.0), (4, 100.0)), min_tokens=2, min_tokens_ids=(1,)).validate()
    for bad in (((3, 101.0),), ((-1, 1.0),), ((3, float("nan")),)):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad).validate()  # type: ignore[arg-type]
    assert SamplingParams(min_tokens=3, min_tokens_ids=(0,)).biased
    assert not SamplingParams(min_tokens=3).biased


def test_request_problems() -> None:
    assert GenerationRequest(prompt="x", logit_bias={5: 100}).problems() == []
    assert "logit_bias values" in GenerationRequest(prompt="x", logit_bias={5: 200}).problems()[0]
    assert "logit_bias keys" in GenerationRequest(prompt="x", logit_bias={"5": 1}).problems()[0]  # type: ignore[dict-item]
    assert "min_tokens" in GenerationRequest(prompt="x", min_tokens=-1).problems()[0]
    assert "must not exceed" in GenerationRequest(prompt="x", min_tokens=5, max_tokens=4).problems()[0]


@pytest.fixture(scope="module")
def demo() -> Engine:
    engine = Engine(bundled_artifact(), EngineConfig(max_concurrency=4, warmup=False))
    yield engine
    engine.close()


PROMPT = "def fibonacci(n):"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_engine_bias_ban_and_force(demo: Engine, temperature: float) -> None:
    base = demo.generate(GenerationRequest(prompt=PROMPT, max_tokens=16, temperature=temperature, seed=4))
    banned = set(base.token_ids[:3])
    out = demo.generate(
        GenerationRequest(
            prompt=PROMPT,
            max_tokens=16,
            temperature=temperature,
            seed=4,
            logit_bias={t: -100 for t in banned},
        )
    )
    assert len(out.token_ids) == 16 and not banned & set(out.token_ids)
    forced = demo.generate(
        GenerationRequest(
            prompt=PROMPT, max_tokens=12, temperature=temperature, seed=4, logit_bias={258: 100}
        )
    )
    assert forced.token_ids == (258,) * 12


def test_engine_bias_rows_share_a_batch(demo: Engine) -> None:
    """A biased row beside plain rows in one decode batch: the plain rows' tokens are unchanged."""
    plain = GenerationRequest(prompt=PROMPT, max_tokens=12, temperature=0.0)
    alone = demo.generate(plain).token_ids
    handles = [
        demo.submit(plain),
        demo.submit(GenerationRequest(prompt=PROMPT, max_tokens=12, temperature=0.0, logit_bias={258: 100})),
        demo.submit(plain),
    ]
    results = [h.result().token_ids for h in handles]
    assert results[0] == alone and results[2] == alone and results[1] == (258,) * 12


def test_engine_min_tokens(demo: Engine) -> None:
    eos = demo.frontend.eos_token_ids[0]
    stop_now = demo.generate(
        GenerationRequest(prompt=PROMPT, max_tokens=12, temperature=0, logit_bias={eos: 100})
    )
    assert stop_now.token_ids == (eos,) and stop_now.finish_reason == "stop"
    held = demo.generate(
        GenerationRequest(prompt=PROMPT, max_tokens=12, temperature=0, logit_bias={eos: 100}, min_tokens=5)
    )
    assert len(held.token_ids) == 6 and held.token_ids[-1] == eos and held.finish_reason == "stop"
    assert eos not in held.token_ids[:5]
    # stop_token_ids are held back the same way
    stop = 258
    out = demo.generate(
        GenerationRequest(
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            logit_bias={stop: 100},
            stop_token_ids=(stop,),
            min_tokens=3,
        )
    )
    assert len(out.token_ids) == 4 and stop not in out.token_ids[:3]
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        demo.generate(GenerationRequest(prompt=PROMPT, max_tokens=2, logit_bias={10**6: 1.0}))
