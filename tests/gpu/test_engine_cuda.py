"""The public Engine on CUDA: decode runs in CUDA graphs for every exact B up to max_concurrency, with
the decode lookahead (the default on CUDA), and gives the same tokens as eager decode without it;
prints the host time per decode step."""

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
    """Graphed: as `ninfer serve` runs (graphs, lookahead). Eager: the plain baseline, neither."""
    config = EngineConfig(
        max_concurrency=8,
        device="cuda",
        dtype="bfloat16",
        cuda_graphs=graphs,
        decode_lookahead=None if graphs else False,
        warmup=True,
    )
    return Engine(artifact, config)


def _count_sampler_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from ninfer.targets.qwen3_6.impl.runtime import draws as program_module

    calls: list[int] = []
    sample = program_module.sample

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return sample(*args, **kwargs)

    monkeypatch.setattr(program_module, "sample", counted)
    return calls


@pytest.mark.parametrize("package", ["qwen3_6_tiny", "qwen3_6_tiny_moe"])
def test_decode_graphs_match_eager(
    package: str, tiny_artifact: Path, tiny_moe_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy rows: graphed decode takes its tokens from the graph's own argmax, so the sampler runs only
    after each request's prefill."""
    artifact = tiny_artifact if package == "qwen3_6_tiny" else tiny_moe_artifact
    with _engine(artifact, False, package) as eager:
        expected = _run_all(eager)
    with _engine(artifact, True, package) as graphed:
        program = graphed.core.program
        graphs = program.executor.graphs
        assert graphs is not None and graphs.sizes == list(range(1, 9))
        assert program.config.decode_lookahead
        before = {b: n for (b, t), n in graphs.replays.items() if t == 1}
        sampler_calls = _count_sampler_calls(monkeypatch)
        actual = _run_all(graphed)
        assert len(sampler_calls) == len(PROMPTS)
        monkeypatch.undo()
        replayed = {b: n - before.get(b, 0) for (b, t), n in graphs.replays.items() if t == 1}
        # host time per decode step, one request (the tiny model's GPU work is small: this is overhead)
        torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        r = graphed.generate(
            GenerationRequest(prompt=PROMPTS[0], max_tokens=128, temperature=0.0, ignore_eos=True)
        )
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert actual == expected
    assert all(replayed.get(b, 0) > 0 for b in range(1, 9)), replayed
    assert program.backend.lookahead["taken"] > 0, program.backend.lookahead
    n = len(r.token_ids)
    print(
        f"\n{package}: graph replays per B {sorted(replayed.items())}; B=1 decode: "
        f"{1e3 * wall / n:.2f} ms/token wall, {1e3 * cpu / n:.2f} ms/token process CPU over {n} tokens"
    )


def test_sampled_rows_in_graphs_match_eager(tiny_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that sample (temperature, a seed) next to greedy ones: the graphed decode runs the sampler
    on the graph's logits and draws the same tokens as eager decode."""

    def run(engine: Engine) -> list[tuple[int, ...]]:
        requests = [
            GenerationRequest(prompt=p, max_tokens=16 + i, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
            for i, p in enumerate(PROMPTS[:4])
        ]
        handles = [engine.submit(r) for r in requests]
        return [h.result().token_ids for h in handles]

    with _engine(tiny_artifact, False, "qwen3_6_tiny") as eager:
        expected = run(eager)
    with _engine(tiny_artifact, True, "qwen3_6_tiny") as graphed:
        sampler_calls = _count_sampler_calls(monkeypatch)
        actual = run(graphed)
    assert actual == expected
    assert len(sampler_calls) > 4 + 15, "the decode rounds with sampled rows run the sampler"


def test_warmup_runs_a_prompt_of_each_prefill_unit_size(tiny_artifact: Path) -> None:
    """The fast table's warm-up (Engine._warmup_requests): the short prompt, then one prompt of each prefill
    unit size the pacer cuts that max_context holds, each a prefill unit and a decode round, before the
    Engine says ready; it leaves the Program's usage at its baseline."""
    config = EngineConfig(max_concurrency=2, device="cuda", dtype="bfloat16", max_context=4096, warmup=True)
    with Engine(tiny_artifact, config) as engine:
        sizes = [s for s in engine.core.pacer.sizes if s + 2 <= 4096]
        assert sizes == [64, 128, 256, 512, 1024, 2048]
        assert engine.core.units_run >= 2 * (1 + len(sizes))
        assert engine.availability.state == "ready"
        assert engine.core.program.usage() == engine.core.baseline
