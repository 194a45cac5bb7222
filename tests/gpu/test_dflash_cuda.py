"""DFlash decoding on CUDA (the fast op table; the verify in step graphs and the prompt in prefill
graphs, both returning the tap layers' outputs), against plain decoding on the same device and dtype
(up to near ties, `near_tie.assert_agree`), and its drafts against an eager reference-table run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from near_tie import assert_agree

from ninfer import Engine, EngineConfig, GenerationRequest, GenerationResult
from ninfer.targets.qwen3_6.impl.runtime.backends.dflash import DFlashDraft

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

PROMPTS = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate((3, 40, 130, 9, 300, 17))]


def _engine(artifact: Path, dtype: str, **fields: object) -> Engine:
    config = EngineConfig(
        device="cuda", dtype=dtype, max_concurrency=4, max_context=1024, prefix_cache=False, **fields
    )  # type: ignore[arg-type]
    return Engine(artifact, config)


def _run(engine: Engine) -> list[GenerationResult]:
    requests = [
        GenerationRequest(prompt=p, max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True)
        for p in PROMPTS
    ]
    handles = [engine.submit(r) for r in requests]
    return [h.result() for h in handles]


def _recorded_drafts(engine: Engine) -> list[tuple[tuple[int, ...], int, list[int]]]:
    backend = engine.core.program.backend
    assert isinstance(backend, DFlashDraft)
    rounds: list[tuple[tuple[int, ...], int, list[int]]] = []
    drafts = backend.drafts

    def record(seq):  # type: ignore[no-untyped-def]
        out = drafts(seq)
        rounds.append((tuple(seq.prompt), seq.frontier, out))
        return out

    backend.drafts = record  # type: ignore[method-assign]
    return rounds


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [3, 15])
def test_dflash_decodes_the_plain_tokens_on_cuda(tiny_dflash_artifact: Path, dtype: str, k: int) -> None:
    with _engine(tiny_dflash_artifact, dtype) as engine:
        plain = _run(engine)
    with _engine(tiny_dflash_artifact, dtype, speculative=f"dflash:{k}") as engine:
        assert engine.core.program.executor.graphs is not None  # the verify replays its graphs
        got = _run(engine)
    for a, b in zip(got, plain):
        assert_agree(a, b, dtype)


def test_graph_drafts_equal_eager_reference_drafts(tiny_dflash_artifact: Path) -> None:
    """The drafter's context from graph replays (verify and prefill chunks) gives the drafts of an
    eager run on the reference op table, up to near ties between draft candidates."""
    with _engine(tiny_dflash_artifact, "float32", speculative="dflash:7") as engine:
        fast = _recorded_drafts(engine)
        _run(engine)
    with _engine(
        tiny_dflash_artifact, "float32", speculative="dflash:7", kernels="reference", cuda_graphs=False
    ) as engine:
        eager = _recorded_drafts(engine)
        _run(engine)
    assert len(fast) == len(eager) > 0
    same = sum(a == b for a, b in zip(fast, eager))
    assert same >= 0.95 * len(fast), (same, len(fast))
