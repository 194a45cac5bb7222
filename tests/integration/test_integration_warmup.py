"""Warmup through the public path leaves nothing behind.

An Engine built with warmup=True ran its warmup request through the worker (units ran) and ends up
with the Program's resource usage of a fresh Program, no outstanding capacity, availability ready, and
exactly the outputs of an Engine built without warmup.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from integration_helpers import artifact_for, generation_config, hf_greedy
from integration_helpers import random_prompts as make_prompts

from ninfer import Engine, GenerationRequest
from ninfer.runtime.contract.types import ResourceUsage
from ninfer.runtime.engine.engine_core import EngineSnapshot
from ninfer.runtime.engine.resource_manager import LaneState

torch.set_num_threads(1)
NAME = "qwen3_6_tiny"
NEW_TOKENS = 6
PROMPTS = make_prompts((7, 20), seed=31)


@dataclass(frozen=True)
class Started:
    """The two Engines and what they looked like right after construction, before any test request."""

    warm: Engine
    cold: Engine
    warm_units: int
    cold_units: int
    warm_usage: ResourceUsage
    fresh_usage: ResourceUsage
    warm_snapshot: EngineSnapshot


@pytest.fixture(scope="module")
def engines(request: pytest.FixtureRequest) -> Iterator[Started]:
    artifact = artifact_for(request, NAME)
    warm = Engine(artifact, generation_config(2, warmup=True))
    cold = Engine(artifact, generation_config(2, warmup=False))
    assert warm.core.program is not cold.core.program
    yield Started(
        warm=warm,
        cold=cold,
        warm_units=warm.core.units_run,
        cold_units=cold.core.units_run,
        warm_usage=warm.core.program.usage(),
        fresh_usage=cold.core.program.usage(),
        warm_snapshot=warm.core.snapshot(),
    )
    warm.close()
    cold.close()


def requests() -> list[GenerationRequest]:
    greedy = GenerationRequest(prompt=PROMPTS[0], max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    seeded = GenerationRequest(
        prompt=PROMPTS[1], max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, top_k=50, seed=99,
        ignore_eos=True,
    )
    return [greedy, seeded]


def test_warmup_ran_and_left_no_resources(engines: Started) -> None:
    assert engines.warm.availability.state == "ready" and engines.cold.availability.state == "ready"
    assert engines.warm_units >= 2 and engines.cold_units == 0  # prefill + decode of the warmup request
    assert engines.warm_usage == engines.fresh_usage == engines.warm.core.baseline
    assert engines.warm.core.outstanding == 0
    snapshot = engines.warm_snapshot
    assert not snapshot.states and not snapshot.waiting and snapshot.staged_prefill is None
    assert snapshot.transition is None
    assert all(lane.state is LaneState.FREE and lane.request_id is None for lane in snapshot.lanes)


def test_outputs_equal_an_engine_without_warmup(engines: Started) -> None:
    warm, cold = engines.warm, engines.cold
    warm_out = [warm.generate(r).token_ids for r in requests()]
    cold_out = [cold.generate(r).token_ids for r in requests()]
    assert warm_out == cold_out
    assert warm_out[0] == hf_greedy(NAME, tuple(PROMPTS[0]), NEW_TOKENS)
    assert warm.core.program.usage() == warm.core.baseline


def test_the_fast_table_warms_each_prefill_unit_size_that_fits(engines: Started) -> None:
    """With the fast op table (Triton kernels, compiled per shape class on first use) the warm-up adds one
    prompt of each prefill unit size the pacer cuts, up to what ``max_context`` holds; the reference table
    warms with the short prompt alone. (tests/gpu/test_engine_cuda.py runs it on CUDA.)"""
    engine = engines.cold
    sizes = engine.core.pacer.sizes
    fast = engine._warmup_requests("fast", sizes)
    assert [len(r.prompt) for r in fast[1:]] == [s for s in sizes if s + 2 <= engine.max_context]
    assert all(r.prefix_cache is False and r.ignore_eos for r in fast[1:])
    assert len(engine._warmup_requests("reference", sizes)) == 1
    assert len(engine._warmup_requests("fast", (64, 10**9))) == 2  # a size beyond max_context is left out
