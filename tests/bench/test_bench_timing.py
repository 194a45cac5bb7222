"""The bench's clocks and plans: which units count as decode steps, the prefill span, request budgets,
prompt ids, and the device probes on CPU."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ninfer import Engine, EngineConfig
from ninfer.bench.drive import (
    ROUND_SLACK,
    BenchError,
    BenchPlan,
    EngineDriver,
    PromptSource,
    full_round_intervals,
    prefill_span,
)
from ninfer.bench.probes import measure_copy_bandwidth, measure_matmul_flops, median_seconds
from ninfer.bench.runner import first_special_id
from ninfer.targets.qwen3_6.variant import SpecialTokens
from ninfer.targets.qwen3_6_demo import PACKAGE as DEMO

torch.set_num_threads(1)
CPU = torch.device("cpu")


def test_only_consecutive_full_rounds_count() -> None:
    marks = [
        (0.0, "prefill", 1),
        (1.0, "decode", 1),  # request 1 decodes while request 2 prefills: not a round of 2
        (2.0, "prefill", 1),
        (3.5, "decode", 2),
        (4.0, "decode", 2),
        (6.0, "decode", 2),
        (7.0, "decode", 1),  # request 1 ended: the round at 6.0 still lasted until 7.0
        (9.0, "decode", 2),  # a round of 2 not followed by one of 2: no end mark of its own kind
    ]
    assert full_round_intervals(marks, 2, 2) == [0.5, 2.0]
    assert full_round_intervals(marks, 1, 0) == []
    with pytest.raises(BenchError, match="only 2 consecutive decode rounds of 2 rows"):
        full_round_intervals(marks, 2, 3)


def test_prefill_span_runs_to_the_unit_after_the_last_chunk() -> None:
    marks = [(10.0, "prefill", 1), (12.0, "prefill", 1), (12.5, "prefill", 1), (15.0, "decode", 1)]
    assert prefill_span(marks) == 5.0
    with pytest.raises(BenchError):
        prefill_span(marks[:3])
    with pytest.raises(BenchError):
        prefill_span([(1.0, "decode", 1)])


def test_plan_budgets_cover_the_rounds_before_all_rows_are_ready() -> None:
    plan = BenchPlan(
        batches=(1, 8),
        context=2048,
        decode_steps=64,
        prefill_tokens=8192,
        prefill_repeats=3,
        prefill_chunk=1000,
    )
    # first token + 65 full rounds + one round after each of the other 7 prompts' units, each as small as
    # the prefill pacer may cut them (2048 / 64 = 32), + slack
    assert plan.decode_max_tokens(8) == 1 + 65 + 7 * 32 + ROUND_SLACK
    assert plan.decode_max_tokens(1) == 1 + 65 + ROUND_SLACK
    assert plan.max_context == max(2048 + plan.decode_max_tokens(8), 8192 + 65)
    ones = dict(context=1, prefill_tokens=1, prefill_repeats=1, prefill_chunk=1)
    with pytest.raises(ValueError):
        BenchPlan(batches=(0,), decode_steps=1, **ones)
    with pytest.raises(ValueError):
        BenchPlan(batches=(1,), decode_steps=0, **ones)


def test_decode_rows_get_their_rounds_when_the_pacer_cuts_prompts_small(tiny_artifact: Path) -> None:
    """The prefill pacer cuts each later row's prompt into units (here its first guess, 512 tokens; down to
    64), a decode round after each: the first row must not run out of budget before all four decode, and
    the driver stops the rows (cancels them) once it has its full rounds instead of running out every
    budget."""
    config = EngineConfig(
        max_concurrency=4, max_context=4096, max_decode_gap_ms=0.001, prefill_chunk_tokens=2048
    )
    plan = BenchPlan(
        batches=(4,), context=2048, decode_steps=4, prefill_tokens=64, prefill_repeats=1, prefill_chunk=2048
    )
    with Engine(tiny_artifact, config) as engine:
        driver = EngineDriver(engine, plan, PromptSource(200, seed=1))
        sample = driver.decode_at(4)
        units = [m for m in driver.timeline.marks if m[1] == "prefill"]
    assert len(sample.step_s) == 4 and min(sample.step_s) > 0
    assert len(units) >= 1 + 3 * 2048 // 512  # the pacer did cut the later rows' prompts
    decoded = sum(1 for m in driver.timeline.marks if m[1] == "decode")
    assert decoded < 4 * plan.decode_max_tokens(4)  # stopped early, not run to the budgets


def test_prompts_are_exact_length_ordinary_and_distinct() -> None:
    source = PromptSource(first_special_id(DEMO.variant.special), seed=3)
    prompts = [source.take(200) for _ in range(4)]
    assert all(len(p) == 200 for p in prompts)
    assert max(max(p) for p in prompts) < 8159 and min(min(p) for p in prompts) >= 0
    assert len({tuple(p[:8]) for p in prompts}) == 4
    assert PromptSource(8159, seed=3).take(50) == PromptSource(8159, seed=3).take(50)


def test_first_special_id() -> None:
    assert first_special_id(SpecialTokens()) == 248044  # <|endoftext|>, the first Qwen special token
    assert first_special_id(DEMO.variant.special) == 8159


def test_median_seconds_times_what_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """An injected clock that only the timed function advances: the median of the timed calls, exactly,
    and the warmup calls are not among them."""
    import ninfer.bench.probes as probes

    now = [0.0]
    durations = iter([5.0, 7.0, 0.03, 0.01, 0.02])  # two warmup calls, then three timed ones
    monkeypatch.setattr(probes, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    calls: list[int] = []

    def work() -> None:
        calls.append(1)
        now[0] += next(durations)

    seconds = median_seconds(work, CPU, repeats=3, warmup=2)
    assert len(calls) == 5
    assert seconds == pytest.approx(0.02)


def test_cpu_probes_are_positive_and_scale_with_the_work() -> None:
    bandwidth, nbytes = measure_copy_bandwidth(CPU, 1 << 22, repeats=3, warmup=1)
    assert nbytes == 1 << 22 and 1e8 < bandwidth < 1e13
    flops, n = measure_matmul_flops(CPU, torch.float32, 128, repeats=3, warmup=1)
    assert n == 128 and 1e6 < flops < 1e13
