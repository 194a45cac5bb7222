"""MTP decoding and the context cache on CUDA (the fast op table, CUDA graphs), against plain cold
decoding on the same device and in the same dtype, up to near ties (`near_tie.assert_agree`)."""

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

TEXTS = [
    "def fibonacci(n):\n    ",
    "import numpy as np\nimport",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    print(",
    "with open(path) as f:\n",
    "x = [1, 2, 3]\ny = [",
]


def _engine(artifact: str | Path, dtype: str, **fields: object) -> Engine:
    config = EngineConfig(device="cuda", dtype=dtype, max_concurrency=4, max_context=1024, **fields)  # type: ignore[arg-type]
    return Engine(artifact, config)


def _run(engine: Engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    handles = [engine.submit(r) for r in requests]
    return [h.result() for h in handles]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_decodes_the_plain_tokens_on_cuda(k: int, dtype: str) -> None:
    requests = [
        GenerationRequest(prompt=t, max_tokens=48, temperature=0.0, logprobs=True, top_logprobs=2)
        for t in TEXTS
    ]
    with _engine(bundled_artifact(), dtype, prefix_cache=False) as engine:
        plain = _run(engine, requests)
    with _engine(bundled_artifact(), dtype, prefix_cache=False, speculative=f"mtp:{k}") as engine:
        mtp = _run(engine, requests)
        backend = engine.core.program.backend
    for a, b in zip(mtp, plain):
        assert_agree(a, b, dtype)
    assert backend.accepted > 0  # type: ignore[attr-defined]
    assert backend.graph_replays > 0  # type: ignore[attr-defined]  # the rounds' MTP work ran as graphs
    assert sum(r.usage.accepted_draft_tokens for r in mtp) > 0


def test_a_shortlist_draft_head_decodes_the_plain_tokens_on_cuda() -> None:
    """``draft_vocab`` slices lm_head for the draft head (the fast GEMV over a row block of it)."""
    requests = [GenerationRequest(prompt=t, max_tokens=48, temperature=0.0, logprobs=True, top_logprobs=2)
                for t in TEXTS]  # fmt: skip
    with _engine(bundled_artifact(), "float32", prefix_cache=False) as engine:
        plain = _run(engine, requests)
    shortlist = {"speculative": "mtp:3", "draft_vocab": 2048}
    with _engine(bundled_artifact(), "float32", prefix_cache=False, **shortlist) as engine:
        mtp = _run(engine, requests)
    for a, b in zip(mtp, plain):
        assert_agree(a, b, "float32")
    assert sum(r.usage.accepted_draft_tokens for r in mtp) > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reused_turns_decode_the_cold_tokens_on_cuda(tiny_artifact: Path, dtype: str) -> None:
    """The reused turns' suffixes run as prefill graphs (the default), the cold run's chunks eagerly
    (``prefill_graph_tokens=0``): reuse and the graphs' padding against plain cold prefill at once."""

    def conversation(cache: bool, replies: list[str] | None = None) -> list[GenerationResult]:
        """Four turns; the history holds ``replies`` where given (the cold run's: the same prompts)."""
        graphs = {} if cache else {"prefill_graph_tokens": 0}
        with _engine(tiny_artifact, dtype, prefix_cache=cache, capture_interval=128, **graphs) as engine:
            messages = [{"role": "system", "content": "You answer briefly. " * 20}]
            out = []
            for turn in range(4):
                messages.append({"role": "user", "content": f"Question {turn}: why? " * 6})
                request = GenerationRequest(
                    messages=list(messages), max_tokens=16, temperature=0.0, logprobs=True, top_logprobs=2,
                    chat_template_kwargs={"enable_thinking": False}, session_id="s",
                )  # fmt: skip
                result = engine.generate(request)
                out.append(result)
                messages.append({"role": "assistant", "content": replies[turn] if replies else result.text})
            stats = engine.cache_stats()
            assert stats.hits == (3 if cache else 0)
            return out

    cold = conversation(False)
    warm = conversation(True, [r.text for r in cold])
    assert all(r.usage.reused_prefix_tokens > 0 for r in warm[1:])
    for a, b in zip(warm, cold):
        assert_agree(a, b, dtype)


def test_turns_continued_from_the_host_tier_decode_the_cold_tokens_on_cuda(tiny_artifact: Path) -> None:
    """The host tier on CUDA: pinned host copies of checkpoints and their restores. Two sessions take turns
    on a device budget of one checkpoint state slot, so each one's checkpoints go to the host while the
    other runs and come back for its next turn; one-token prefill units in both runs (as the CPU test,
    tests/integration/test_integration_prefix_cache_host_tier.py) make the positions after a restore run
    the cold run's own operations."""
    from ninfer.targets.qwen3_6.memory import GIB

    def rotation(config: EngineConfig) -> tuple[list[GenerationResult], object]:
        with Engine(tiny_artifact, config) as engine:
            histories = [
                [{"role": "system", "content": f"System {i}: answer briefly. " * 6}] for i in range(2)
            ]
            out = []
            for turn in range(3):
                for i, history in enumerate(histories):
                    history.append({"role": "user", "content": f"question {turn} of {i}: what, and why?"})
                    request = GenerationRequest(
                        messages=list(history), max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2,
                        chat_template_kwargs={"enable_thinking": False}, session_id=f"s{i}",
                    )  # fmt: skip
                    result = engine.generate(request)
                    out.append(result)
                    history.append({"role": "assistant", "content": result.text})
            return out, engine.cache_stats()

    common = dict(max_concurrency=1, device="cuda", dtype="float32", max_context=1024, prefill_chunk_tokens=1)
    cold, _ = rotation(EngineConfig(prefix_cache=False, **common))  # type: ignore[arg-type]
    slot_bytes = 48384  # qwen3_6_tiny fp32: one checkpoint state slot
    # on CUDA the cache budget buys state slots alone (cached KV pages share the memory-sized pool): one
    budget = 1.5 * slot_bytes / GIB
    warm, stats = rotation(EngineConfig(cache_memory_gb=budget, host_cache_gb=0.004, **common))  # type: ignore[arg-type]
    assert stats.offloads > 0 and stats.restores > 0, stats  # type: ignore[attr-defined]
    assert all(r.usage.reused_prefix_tokens > 0 for r in warm[2:])
    for a, b in zip(warm, cold):
        assert_agree(a, b, "float32")
        assert a.logprobs is not None and b.logprobs is not None
        for x, y in zip(a.logprobs, b.logprobs):
            if x.token_id != y.token_id:
                break
            assert abs(x.logprob - y.logprob) <= 1e-4
