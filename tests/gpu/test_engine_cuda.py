"""The public Engine on CUDA: decode runs in CUDA graphs for every exact B up to max_concurrency, with
the same greedy tokens as eager decode; prints the host time per decode step."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from ninfer import Engine, EngineConfig, GenerationRequest

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

PROMPTS = [list(range(100 + 7 * i, 100 + 7 * i + 3 + 5 * i)) for i in range(8)]


def _run_all(engine: Engine) -> list[tuple[int, ...]]:
    # max_tokens 20..27: all rows join before the first ends, then they end one by one: every B 8..1
    handles = [
        engine.submit(GenerationRequest(prompt=p, max_tokens=20 + i, temperature=0.0, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
    return [h.result().token_ids for h in handles]


def _engine(artifact: Path, graphs: bool, package: str) -> Engine:
    config = EngineConfig(max_concurrency=8, device="cuda", dtype="bfloat16", cuda_graphs=graphs, warmup=True)
    return Engine(artifact, config)


@pytest.mark.parametrize("package", ["qwen3_6_tiny", "qwen3_6_tiny_moe"])
def test_decode_graphs_match_eager(package: str, tiny_artifact: Path, tiny_moe_artifact: Path) -> None:
    artifact = tiny_artifact if package == "qwen3_6_tiny" else tiny_moe_artifact
    with _engine(artifact, False, package) as eager:
        expected = _run_all(eager)
    with _engine(artifact, True, package) as graphed:
        program = graphed.core._program
        assert program._graphs is not None and program._graphs.sizes == list(range(1, 9))
        before = dict(program._graphs.replays)
        actual = _run_all(graphed)
        replayed = {b: n - before.get(b, 0) for b, n in program._graphs.replays.items()}
        # host time per decode step, one request (the tiny model's GPU work is small: this is overhead)
        torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        r = graphed.generate(
            GenerationRequest(prompt=PROMPTS[0], max_tokens=128, temperature=0.0, ignore_eos=True)
        )
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert actual == expected
    assert all(replayed.get(b, 0) > 0 for b in range(1, 9)), replayed
    n = len(r.token_ids)
    print(
        f"\n{package}: graph replays per B {sorted(replayed.items())}; B=1 decode: "
        f"{1e3 * wall / n:.2f} ms/token wall, {1e3 * cpu / n:.2f} ms/token process CPU over {n} tokens"
    )
