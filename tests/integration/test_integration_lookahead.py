"""The decode lookahead through the public Engine: the same requests on an Engine with it and on one
without give the same results, event for event.

The mix makes the unit queued ahead wrong in every way a server sees: rows ending on a stop token the
Program cannot foresee (one in steady decode, where the Engine expects the round to repeat), rows ending
by length, a thinking budget that makes the Frontend force tokens, prompts of several prefill chunks
joining the rounds, seeded sampling, log-probs and a penalised row (which never runs ahead).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from integration_helpers import PACKAGE_NAMES, artifact_for, generation_config, hf_greedy, random_prompts

from ninfer import Engine, GenerationRequest

torch.set_num_threads(1)
PROMPTS = random_prompts([3, 40, 17, 9, 25, 60], seed=5)


def requests(name: str) -> list[GenerationRequest]:
    stop_at = hf_greedy(name, tuple(PROMPTS[0]), 12)[5]  # ends request 0 at its sixth token
    return [
        GenerationRequest(prompt=PROMPTS[0], max_tokens=12, temperature=0.0, stop_token_ids=[stop_at]),
        GenerationRequest(prompt=PROMPTS[1], max_tokens=9, temperature=0.0, ignore_eos=True),
        GenerationRequest(prompt=PROMPTS[2], max_tokens=10, temperature=0.9, seed=7, ignore_eos=True),
        GenerationRequest(
            prompt=PROMPTS[3], max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2, ignore_eos=True
        ),
        GenerationRequest(prompt=PROMPTS[4], max_tokens=8, repetition_penalty=1.3, seed=3, ignore_eos=True),
        GenerationRequest(
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=12,
            temperature=0.0,
            thinking_budget=2,
        ),
        GenerationRequest(prompt=PROMPTS[5], max_tokens=11, temperature=0.0, ignore_eos=True),
    ]


Stream = list[tuple[str, dict[str, object]]]


def steady_pair(name: str) -> list[GenerationRequest]:
    """Two requests decoding together once both are prefilled; one ends on a stop token mid-stream."""
    stop_at = hf_greedy(name, tuple(PROMPTS[3]), 14)[9]
    return [
        GenerationRequest(prompt=PROMPTS[3], max_tokens=14, temperature=0.0, stop_token_ids=[stop_at]),
        GenerationRequest(prompt=PROMPTS[0], max_tokens=16, temperature=0.0, ignore_eos=True),
    ]


def run(artifact: object, name: str, lookahead: bool) -> tuple[list[Stream], dict[str, int]]:
    with Engine(artifact, generation_config(4, decode_lookahead=lookahead)) as engine:
        events = []
        for batch in (requests(name), steady_pair(name)):
            handles = [engine.submit(r) for r in batch]
            events += [list(h) for h in handles]
        program = engine.core.program  # idle once every result is out
        assert program.usage() == engine.core.baseline
        counts = dict(program.backend.lookahead)
    # request ids differ between the two Engines only by their start; everything else must match
    return [[_without_ids(e) for e in stream] for stream in events], counts


def _without_ids(event: object) -> tuple[str, dict[str, object]]:
    fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event) if f.name != "request_id"}  # type: ignore[arg-type]
    return type(event).__name__, fields


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_lookahead_engine_equals_plain_engine(request: pytest.FixtureRequest, name: str) -> None:
    artifact = artifact_for(request, name)
    plain, plain_counts = run(artifact, name, False)
    ahead, counts = run(artifact, name, True)
    results = [stream[-1] for stream in plain]
    assert [r[0] for r in results] == ["GenerationResult"] * len(results)
    finish = [r[1]["finish_reason"] for r in results]  # type: ignore[index]
    assert finish[0] == finish[-2] == "stop" and "length" in finish, finish
    assert ahead == plain
    assert not any(plain_counts.values()), plain_counts
    assert counts["taken"] > 0 and counts["dropped"] > 0, counts
