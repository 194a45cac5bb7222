"""Request-level errors through the real family Program fail only their request.

1. The public Engine (max_context=64): a prompt beyond the context, a max_tokens beyond it and an
   unrepresentable request are rejected at submit with a message that says what to change, while a
   request already running completes with transformers' tokens and the Engine stays ready.
2. The real Program with a KV pool smaller than one full-context request (Engine.from_parts): a request
   whose complete growth reservation can never fit is rejected `infeasible` by the Program on the
   worker; a request that does not fit *now* waits as the blocked FIFO head and runs once an incumbent
   released its pages; a submit beyond max_concurrency + queue_capacity is an `overload`. The others
   complete with transformers' tokens and every resource returns to its baseline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from integration_helpers import generation_config, hf_greedy
from integration_helpers import random_prompts as make_prompts
from tiny_artifacts import tiny_view

from ninfer import Engine, EngineConfig, GenerationRequest, GenerationResult, RequestRejected
from ninfer.runtime.engine.engine_core import EngineCore
from ninfer.runtime.engine.scheduler import Unit, UnitKind
from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6.impl.runtime.program import ProgramConfig, Qwen36Program
from ninfer.targets.registry import PACKAGES

torch.set_num_threads(1)
NAME = "qwen3_6_tiny"
NEW_TOKENS = 6


def greedy(prompt: list[int], max_tokens: int = NEW_TOKENS) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def rejected(engine: Engine, request: GenerationRequest) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        engine.submit(request)
    return info.value


def test_context_errors_fail_only_their_request(tiny_artifact: Path) -> None:
    running, too_long, long_enough = make_prompts((10, 70, 30), seed=41)
    with Engine(tiny_artifact, generation_config(2, max_context=64)) as engine:
        handle = engine.submit(greedy(running))

        error = rejected(engine, greedy(too_long))
        assert error.kind == "context_too_long"
        assert "70 tokens" in error.message and "max_context is 64" in error.message
        assert "shorten the prompt or start the Engine with a larger max_context" in error.message

        error = rejected(engine, greedy(long_enough, max_tokens=40))
        assert error.kind == "context_too_long" and "lower max_tokens to at most 34" in error.message

        error = rejected(engine, GenerationRequest(prompt=running, temperature=-1.0, max_tokens=4))
        assert error.kind == "invalid_request" and "temperature must be" in error.message

        result = handle.result()
        assert result.finish_reason == "length"
        assert result.token_ids == hf_greedy(NAME, tuple(running), NEW_TOKENS)
        assert engine.availability.state == "ready"
        after = engine.generate(greedy(long_enough, max_tokens=34))  # exactly at the limit still runs
        assert len(after.token_ids) == 34


def small_pool_engine(tiny_artifact: Path) -> Engine:
    """The real Program with 4 KV pages of 16 positions (64 in all) although max_context is 128."""
    variant = PACKAGES[NAME].variant
    program = Qwen36Program(
        variant,
        tiny_view(NAME),
        ProgramConfig(
            max_concurrency=2,
            max_context=128,
            page_size=16,
            kv_pages=4,
            device=torch.device("cpu"),
            dtype=torch.float32,
        ),
    )
    config = EngineConfig(max_concurrency=2, queue_capacity=2, device="cpu", page_size=16, warmup=False)
    return Engine.from_parts(program, load_frontend(str(tiny_artifact)), config, package_name=NAME)


def test_program_infeasible_and_blocked_requests(tiny_artifact: Path) -> None:
    small, never_fits, big, blocked = make_prompts((10, 40, 30, 20), seed=43)
    engine = small_pool_engine(tiny_artifact)
    units: list[tuple[UnitKind, tuple[int, ...]]] = []

    def observe(_core: EngineCore, unit: Unit) -> None:
        units.append((unit.kind, tuple(r.request_id for r in unit.members)))

    engine.core.observer = observe
    with engine:
        h_small = engine.submit(greedy(small))  # 16 positions: 1 page
        h_never = engine.submit(greedy(never_fits, max_tokens=40))  # 80 positions: 5 pages > 4 in the pool
        h_big = engine.submit(greedy(big, max_tokens=8))  # 38 positions: 3 pages
        h_blocked = engine.submit(greedy(blocked, max_tokens=8))  # 28: 2 pages, free only once big ends
        # 4 outstanding = max_concurrency + queue_capacity (no result consumed yet): the next is refused
        error = rejected(engine, greedy(small))
        assert error.kind == "overload" and "retry later" in error.message

        never: GenerationResult = h_never.result(raise_on_error=False)
        assert never.finish_reason == "error" and never.token_ids == ()
        assert isinstance(never.error, RequestRejected) and never.error.kind == "infeasible"
        assert "lower max_tokens" in never.error.message

        outputs = {h.request_id: h.result() for h in (h_small, h_big, h_blocked)}
        for prompt, handle, n in ((small, h_small, NEW_TOKENS), (big, h_big, 8), (blocked, h_blocked, 8)):
            result = outputs[handle.request_id]
            assert result.finish_reason == "length"
            assert result.token_ids == hf_greedy(NAME, tuple(prompt), n)
        assert engine.availability.state == "ready"
        assert engine.core.program.usage() == engine.core.baseline

    # the blocked head ran only after `big` had finished (its pages were needed), never next to it
    big_units = [i for i, (_, ids) in enumerate(units) if h_big.request_id in ids]
    blocked_units = [i for i, (_, ids) in enumerate(units) if h_blocked.request_id in ids]
    assert blocked_units[0] > big_units[-1]
    assert all(kind is not UnitKind.DECODE or len(ids) <= 2 for kind, ids in units)
    assert h_never.request_id not in {rid for _, ids in units for rid in ids}  # never ran a unit
