"""The host tier on the tiny packages in fp32, against cold runs (``prefix_cache=False``): sessions take
turns on a device with room for one checkpoint, so each session's checkpoints move to the host while the
others run and back when its next turn continues them. Every token and every log-prob (and its top
alternatives) equals the cold run's: the prefill runs one token a unit in both, so the positions after a
restored checkpoint run the very operations the cold run does and any byte the round trip got wrong would
show. ``cache_stats()`` counts the offloads, the restores and the checkpoints and bytes of each tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from cache_helpers import (
    MAX_CONTEXT,
    PACKAGE_NAMES,
    PAGE_SIZE,
    _turn_request,
    assistant_message,
    build_engine,
)

from ninfer import Engine, EngineConfig, GenerationResult
from ninfer.targets.qwen3_6.memory import GIB

torch.set_num_threads(1)

KWARGS = {"enable_thinking": False}


def interleaved(engine: Engine, sessions: int = 2, turns: int = 3) -> list[list[GenerationResult]]:
    """``sessions`` chats, turn by turn in rotation (session 0's turn 1, session 1's turn 1, session 0's
    turn 2, ...), each reply sent back as a client would, with log-probs."""
    histories: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": f"System {i}: answer briefly and exactly. " * 6}]
        for i in range(sessions)
    ]
    results: list[list[GenerationResult]] = [[] for _ in range(sessions)]
    for turn in range(turns):
        for i, history in enumerate(histories):
            history.append({"role": "user", "content": f"question {turn} of {i}: what, and why?"})
            request = _turn_request(history, 8, KWARGS, None, f"s{i}", logprobs=True, top_logprobs=2)
            result = engine.generate(request)
            results[i].append(result)
            history.append(assistant_message(result))
    return results


def outputs(results: list[list[GenerationResult]]) -> list[Any]:
    return [
        [(r.token_ids, [(lp.logprob, lp.top) for lp in r.logprobs or ()]) for r in session]
        for session in results
    ]


def check_host_round_trips(warm: list[list[GenerationResult]], stats: Any) -> None:
    assert stats.offloads > 0 and stats.restores > 0, stats
    assert stats.host_checkpoints > 0 and stats.host_checkpoint_bytes > 0, stats
    assert stats.checkpoint_bytes > stats.host_checkpoint_bytes
    assert all(r.usage.reused_prefix_tokens > 0 for session in warm for r in session[1:])


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_turns_continued_from_the_host_tier_give_the_cold_tokens_and_logprobs(name: str) -> None:
    with build_engine(name, prefix_cache=False, chunk=1) as engine:
        cold = interleaved(engine)
    with build_engine(
        name, checkpoint_slots=1, kv_pages=MAX_CONTEXT // PAGE_SIZE + 8, host_slots=8, host_pages=200, chunk=1
    ) as engine:
        warm = interleaved(engine)
        stats = engine.cache_stats()
        assert engine.reset_cache() == stats.checkpoints
        after = engine.cache_stats()
        usage = engine.core.program.usage()
    assert outputs(warm) == outputs(cold)
    check_host_round_trips(warm, stats)
    assert (after.checkpoints, after.host_checkpoints, after.host_checkpoint_bytes) == (0, 0, 0)
    assert (usage.checkpoints, usage.host_checkpoints, usage.host_kv_pages) == (0, 0, 0)


def test_the_engine_config_sizes_the_host_tier_from_the_artifact(tiny_artifact: Path) -> None:
    """Through the public constructor: ``cache_memory_gb`` small enough for one checkpoint state slot,
    ``host_cache_gb`` a few MB; the same rotation of sessions gives the cold tokens and log-probs."""
    common = dict(
        max_concurrency=1, device="cpu", dtype="float32", max_context=1024, page_size=16,
        prefill_chunk_tokens=1, warmup=False,
    )  # fmt: skip
    with Engine(tiny_artifact, EngineConfig(prefix_cache=False, **common)) as engine:  # type: ignore[arg-type]
        cold = interleaved(engine)
    slot_bytes = 48384  # qwen3_6_tiny fp32: one checkpoint state slot, a quarter of the budget
    config = EngineConfig(cache_memory_gb=5 * slot_bytes / GIB, host_cache_gb=0.004, **common)  # type: ignore[arg-type]
    with Engine(tiny_artifact, config) as engine:
        capacity = engine.core.program.capacity()
        assert capacity.host_state_slots > 0 and capacity.host_kv_pages > capacity.host_state_slots
        assert capacity.state_slots == 2 + 1  # the lane's two and one checkpoint's
        assert "host tier" in engine.capacity().memory_plan
        warm = interleaved(engine)
        stats = engine.cache_stats()
    assert outputs(warm) == outputs(cold)
    check_host_round_trips(warm, stats)
