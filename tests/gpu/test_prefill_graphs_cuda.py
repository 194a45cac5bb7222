"""Prefill chunks replayed as CUDA graphs (padded to a capacity) against the same chunks run
eagerly: the same first-token log-probabilities and the same greedy continuation.

A chunk of n tokens replays the graphs of the smallest capacity T >= n with T - n padding tokens after
it. The padding must leave the GDN state after the last real token, write no KV and never reach a real
token's output; a continuation decoded from the chunk's states shows any of those going wrong. Sums
depend on the GEMM's row count (T against n), so two exact runs may part at a near tie (as in
test_speculative_and_cache_gpu.py): tokens must agree up to the first position where the eager run's two
best tokens are within ``NEAR_TIE`` nats (`near_tie`). The context cache's suffix chunks in graphs against
a cold eager conversation: `test_speculative_and_cache_gpu.test_reused_turns_decode_the_cold_tokens_on_cuda`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from near_tie import assert_agree

from ninfer import Engine, EngineConfig, GenerationRequest, GenerationResult
from ninfer.cli.common import bundled_artifact

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

FIRST_LOGPROB = {"float32": 1e-3, "bfloat16": 0.1}  # |log p| of the first token, graphs against eager
WORDS = ["the", "graph", "of", "a", "chunk", "replays", "its", "pieces", "while", "attention", "runs"]


def _prompts() -> list[str]:
    """Prompts of about 15 to 700 tokens (1.6 a word): chunks that fill a capacity, fall short of one, or
    span several."""
    return [" ".join(WORDS[i % len(WORDS)] for i in range(k)) for k in (9, 40, 90, 200, 420)]


def _run(
    artifact: Path, dtype: str, graph_tokens: int, chunk: int | None
) -> tuple[list[GenerationResult], dict[int, int]]:
    config = EngineConfig(
        device="cuda", dtype=dtype, max_concurrency=2, max_context=1024, prefix_cache=False,  # type: ignore[arg-type]
        prefill_graph_tokens=graph_tokens, prefill_chunk_tokens=chunk,
    )  # fmt: skip
    requests = [
        GenerationRequest(prompt=p, max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=2)
        for p in _prompts()
    ]
    with Engine(artifact, config) as engine:
        results = [engine.generate(r) for r in requests]
        graphs = engine.core.program.executor.prefill_graphs  # type: ignore[attr-defined]
        replays = dict(graphs.replays) if graphs is not None else {}
    return results, replays


def _agree(got: GenerationResult, want: GenerationResult, dtype: str) -> None:
    assert got.logprobs is not None and want.logprobs is not None
    assert abs(got.logprobs[0].logprob - want.logprobs[0].logprob) <= FIRST_LOGPROB[dtype]
    assert_agree(got, want, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [None, 96])
def test_prefill_graphs_decode_the_eager_tokens(dtype: str, chunk: int | None) -> None:
    """``chunk`` 96: every prompt in 96-token units (capacity 128, 32 padding tokens) and a remainder;
    None: each prompt in one unit (capacities 64 to 1024)."""
    eager, none = _run(bundled_artifact(), dtype, 0, chunk)
    graphs, replays = _run(bundled_artifact(), dtype, 1024, chunk)
    assert none == {}
    assert sum(replays.values()) >= len(_prompts())  # every prompt's chunks replayed graphs
    if chunk == 96:
        assert replays.get(128, 0) > len(_prompts())
    for a, b in zip(graphs, eager):
        _agree(a, b, dtype)

