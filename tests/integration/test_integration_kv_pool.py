"""The shared KV pool through the public Engine and the real Qwen3.6 Program (CPU).

1. The pool is shared, not split per lane (max_concurrency 2, a pool of 8 pages of 16 positions): one
   request takes 7 of the 8 pages, more than half; a request that needs 4 pages waits as the blocked
   FIFO head while it runs, and runs once it finished (its tokens are transformers'). A request larger
   than the whole pool is refused `infeasible` with the pages it needs and the pool's.
2. `Engine.capacity()` says the pool (tokens, bytes) and the context limit; on a CPU Engine opened from
   an artifact the pool is max_context x max_concurrency pages plus the context cache's share, and it
   was not sized from device memory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from integration_helpers import hf_greedy, random_prompts
from tiny_artifacts import tiny_view

from ninfer import Engine, EngineConfig, GenerationRequest, RequestRejected
from ninfer.runtime.engine.engine_core import EngineCore
from ninfer.runtime.engine.scheduler import Unit
from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6.impl.runtime.program import ProgramConfig, Qwen36Program
from ninfer.targets.qwen3_6.model import StateStore
from ninfer.targets.registry import PACKAGES

torch.set_num_threads(1)
NAME = "qwen3_6_tiny"
PAGE = 16
POOL_PAGES = 8


def greedy(prompt: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def pool_engine(tiny_artifact: Path) -> Engine:
    """Two lanes over a pool of 8 pages (128 positions) although one request may reach 256."""
    program = Qwen36Program(
        PACKAGES[NAME].variant,
        tiny_view(NAME),
        ProgramConfig(
            max_concurrency=2, max_context=256, page_size=PAGE, kv_pages=POOL_PAGES,
            device=torch.device("cpu"), dtype=torch.float32,
        ),
    )  # fmt: skip
    config = EngineConfig(max_concurrency=2, queue_capacity=4, device="cpu", page_size=PAGE, warmup=False)
    return Engine.from_parts(program, load_frontend(str(tiny_artifact)), config, package_name=NAME)


def test_the_pool_is_shared_a_waiting_request_runs_later_and_a_too_large_one_is_refused(
    tiny_artifact: Path,
) -> None:
    big, waits, too_large = random_prompts((12, 20, 40), seed=71)
    engine = pool_engine(tiny_artifact)
    page_bytes = StateStore.page_bytes(PACKAGES[NAME].variant, PAGE, torch.float32)
    capacity = engine.capacity()
    assert (capacity.kv_pool_tokens, capacity.kv_pool_bytes) == (POOL_PAGES * PAGE, POOL_PAGES * page_bytes)
    assert (capacity.max_context, capacity.max_concurrency, capacity.gpu_memory_fraction) == (256, 2, None)
    units: list[tuple[int, ...]] = []

    def observe(_core: EngineCore, unit: Unit) -> None:
        units.append(tuple(r.request_id for r in unit.members))

    engine.core.observer = observe
    with engine:
        h_big = engine.submit(greedy(big, 88))  # 100 positions: 7 pages, more than a lane's half
        h_waits = engine.submit(greedy(waits, 40))  # 60 positions: 4 pages, free once big ends
        h_never = engine.submit(greedy(too_large, 100))  # 140 positions: 9 pages > 8 in the whole pool
        never = h_never.result(raise_on_error=False)
        assert never.finish_reason == "error" and never.token_ids == ()
        assert isinstance(never.error, RequestRejected) and never.error.kind == "infeasible"
        message = never.error.message
        assert "prompt (40 tokens) + max_tokens (100) needs 9 KV pages of 16 positions" in message
        assert "the whole KV pool holds 8 pages (128 positions)" in message and "lower max_tokens" in message
        assert h_big.result().token_ids == hf_greedy(NAME, tuple(big), 88)
        assert h_waits.result().token_ids == hf_greedy(NAME, tuple(waits), 40)
        assert engine.core.program.usage() == engine.core.baseline
    big_units = [i for i, ids in enumerate(units) if h_big.request_id in ids]
    wait_units = [i for i, ids in enumerate(units) if h_waits.request_id in ids]
    assert wait_units[0] > big_units[-1]  # it waited for big's pages, behind no one else
    assert h_never.request_id not in {rid for ids in units for rid in ids}


def test_capacity_of_a_cpu_engine_from_an_artifact(tiny_artifact: Path) -> None:
    variant = PACKAGES[NAME].variant
    config = EngineConfig(max_concurrency=2, device="cpu", dtype="float32", page_size=PAGE, warmup=False)
    with Engine(tiny_artifact, config) as engine:
        capacity = engine.capacity()
        program = engine.core.program
    context = variant.max_position_embeddings  # 16384 < the CPU default of 32768
    assert capacity.max_context == context and capacity.page_size == PAGE
    lane_tokens = context * 2
    assert capacity.kv_pool_tokens > lane_tokens  # the lanes' full contexts plus the cache's pages
    assert capacity.kv_pool_tokens == program.book.pages.size * PAGE
    assert capacity.gpu_memory_fraction is None
    assert capacity.memory_plan.startswith(f"KV pool {capacity.kv_pool_tokens:,} tokens")
    assert "max_context 16,384 (the CPU default)" in capacity.memory_plan and "(CPU)" in capacity.memory_plan
