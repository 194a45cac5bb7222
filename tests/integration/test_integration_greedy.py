"""Greedy generation through the public Engine equals transformers' `generate` on both tiny packages.

16 raw token-id prompts (1..80 tokens) go to one Engine all at once with max_concurrency=8 (decode
rounds of varying exact B, 16-token prefill chunks interleaving with decode) and to another with
max_concurrency=1 (one request at a time). Both must give transformers' greedy tokens exactly, which is
also batch invariance: a request's tokens do not depend on which requests share its rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from integration_helpers import (
    PACKAGE_NAMES,
    PREFILL_CHUNK,
    PROMPT_LENGTHS,
    artifact_for,
    generation_config,
    hf_greedy,
)
from integration_helpers import random_prompts as make_prompts

from ninfer import Engine, GenerationDelta, GenerationRequest, GenerationResult, GenerationStart
from ninfer.runtime.engine.engine_core import EngineCore
from ninfer.runtime.engine.scheduler import Unit, UnitKind

torch.set_num_threads(1)
NEW_TOKENS = 10
PROMPTS = make_prompts(PROMPT_LENGTHS, seed=11)


@dataclass
class Run:
    """Everything one Engine produced for the 16 prompts, plus the units its worker ran."""

    results: list[GenerationResult]
    events: list[list[object]]
    units: list[tuple[UnitKind, tuple[int, ...]]]  # (kind, request ids in row order)
    request_ids: list[int]
    usage_back_at_baseline: bool


def run_all(engine: Engine) -> Run:
    units: list[tuple[UnitKind, tuple[int, ...]]] = []

    def observe(_core: EngineCore, unit: Unit) -> None:  # runs on the worker thread
        units.append((unit.kind, tuple(r.request_id for r in unit.members)))

    engine.core.observer = observe
    handles = [
        engine.submit(GenerationRequest(prompt=p, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
        for p in PROMPTS
    ]
    events = [list(h) for h in handles]  # each handle's full event stream, the result last
    results = [e[-1] for e in events]
    assert all(isinstance(r, GenerationResult) for r in results)
    program = engine.core.program  # the Program is the worker's; it is idle once every result is out
    return Run(
        results=results,  # type: ignore[arg-type]
        events=events,
        units=units,
        request_ids=[h.request_id for h in handles],
        usage_back_at_baseline=program.usage() == engine.core.baseline,
    )


@pytest.fixture(scope="module", params=PACKAGE_NAMES)
def runs(request: pytest.FixtureRequest) -> tuple[str, Run, Run]:
    name = request.param
    artifact = artifact_for(request, name)
    with Engine(artifact, generation_config(8)) as together:
        batched = run_all(together)
    with Engine(artifact, generation_config(1)) as alone:
        serial = run_all(alone)
    return name, batched, serial


def test_batched_greedy_equals_transformers(runs: tuple[str, Run, Run]) -> None:
    name, batched, _ = runs
    for i, (prompt, result) in enumerate(zip(PROMPTS, batched.results)):
        assert result.finish_reason == "length", (i, result.error)
        assert result.token_ids == hf_greedy(name, tuple(prompt), NEW_TOKENS), f"prompt {i} ({len(prompt)})"


def test_one_at_a_time_equals_batched(runs: tuple[str, Run, Run]) -> None:
    _, batched, serial = runs
    for i, (a, b) in enumerate(zip(batched.results, serial.results)):
        assert b.finish_reason == "length", (i, b.error)
        assert a.token_ids == b.token_ids, f"prompt {i}: batch composition changed the tokens"


def test_schedules_really_differ(runs: tuple[str, Run, Run]) -> None:
    """The concurrent run formed decode rounds of many different B and split prompts into chunks that
    interleaved with decode; the serial run decoded one row at a time."""
    _, batched, serial = runs
    decode_sizes = [len(ids) for kind, ids in batched.units if kind is UnitKind.DECODE]
    assert max(decode_sizes) == 8 and len(set(decode_sizes)) >= 4, sorted(set(decode_sizes))
    assert {len(ids) for kind, ids in serial.units if kind is UnitKind.DECODE} == {1}

    def prefill_units(rid: int) -> list[int]:
        return [i for i, (kind, ids) in enumerate(batched.units) if (kind, ids) == (UnitKind.PREFILL, (rid,))]

    interleaved = False
    for rid in batched.request_ids:
        chunks = prefill_units(rid)
        between = {batched.units[i][0] for i in range(chunks[0], chunks[-1])}
        interleaved |= UnitKind.DECODE in between
    assert interleaved, "no multi-chunk prefill had a decode round between its chunks"
    for rid, length in zip(batched.request_ids, PROMPT_LENGTHS):  # ceil(length / chunk) units each
        assert len(prefill_units(rid)) == -(-length // PREFILL_CHUNK), (rid, length)


def test_event_streams_and_accounting(runs: tuple[str, Run, Run]) -> None:
    """One GenerationStart first, deltas whose token ids concatenate to the result, one result last;
    usage counts; the Program's resource usage back at its baseline once every request ended."""
    _, batched, serial = runs
    for run in (batched, serial):
        assert run.usage_back_at_baseline
        for prompt, events in zip(PROMPTS, run.events):
            start, *deltas, result = events
            assert isinstance(start, GenerationStart) and start.prompt_tokens == len(prompt)
            assert start.reused_prefix_tokens == 0
            assert all(isinstance(d, GenerationDelta) for d in deltas)
            assert isinstance(result, GenerationResult)
            streamed = tuple(t for d in deltas for t in d.token_ids)  # type: ignore[union-attr]
            assert streamed == result.token_ids
            assert result.usage.prompt_tokens == len(prompt)
            assert result.usage.completion_tokens == NEW_TOKENS
