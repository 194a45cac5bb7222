"""Prefill pacing: while requests decode, the staged prefill's chunks keep their inter-token gap under
``max_decode_gap_ms``; with nothing decoding a chunk is full. First the pacer alone on given times, then
the public Engine on the tiny package, on a clock that the Program advances by a cost model of each unit
(so every time is exact and no test reads the wall clock)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "integration"))

from cache_helpers import build_engine  # noqa: E402
from integration_helpers import random_prompts  # noqa: E402

from ninfer import GenerationRequest  # noqa: E402
from ninfer.runtime.engine.prefill_pacer import FLOOR_SLACK, GRANULE, PrefillPacer  # noqa: E402

torch.set_num_threads(1)


def paced(pacer: PrefillPacer, cost, round_s: float, chunks: int = 60) -> tuple[list[int], list[float]]:  # noqa: ANN001
    """The pacer alone on a given cost model: decode rounds of ``round_s``, then ``chunks`` times a chunk of
    the size it asks for (costing ``cost(tokens)``) and a round. Returns the sizes and the gaps."""
    t = 0.0
    for _ in range(3):
        t += round_s
        pacer.decode_committed(t)
    sizes, gaps = [], []
    for _ in range(chunks):
        n = pacer.chunk(decoding=True)
        pacer.prefill_ran(n)
        gap = cost(n) + round_s
        t += gap
        pacer.decode_committed(t)
        sizes.append(n)
        gaps.append(gap)
    return sizes, gaps


def test_a_measured_pacer_sizes_the_chunk_to_the_gap() -> None:
    """Costs proportional to the tokens (0.1 ms each), rounds of 10 ms, a 100 ms bound: 512 tokens fit
    (61 ms), 1024 do not (112 ms). The size below is run once to measure the cost's line, which predicts
    1024 over the bound, so 1024 is never tried and no gap breaks the bound."""
    pacer = PrefillPacer(0.1, full_chunk=8192, first_chunk=512)
    assert pacer.chunk(decoding=False) == 8192  # nothing decodes: full chunks
    assert pacer.chunk(decoding=True) == 512  # nothing measured yet
    sizes, gaps = paced(pacer, lambda n: n * 1e-4, 0.010)
    assert pacer.round_s == pytest.approx(0.010) and pacer.cost_s[512] == pytest.approx(0.0512)
    assert sizes[:2] == [512, 256] and set(sizes[2:]) == {512}
    assert max(gaps) <= 0.1
    assert pacer.chunk(decoding=False) == 8192


def test_probes_up_keep_the_bound_with_prefill_graphs() -> None:
    """The 27B with its prefill chunks in CUDA graphs (run 25): about 5 ms a chunk and 0.085 ms a token,
    rounds of 16 ms, a 100 ms bound. 512 tokens keep it (64.5 ms gaps), 1024 would not (108 ms): the old
    rule tried 1024 once and again every REPROBE chunks, each a gap over the bound."""
    pacer = PrefillPacer(0.1, full_chunk=8192)
    sizes, gaps = paced(pacer, lambda n: 0.005 + n * 0.085e-3, 0.016, chunks=100)
    assert 1024 not in sizes and sizes.count(512) >= len(sizes) - 1
    assert max(gaps) <= 0.1


def test_a_loose_bound_still_grows_chunks_whose_cost_is_fixed() -> None:
    """Eager prefill's fixed host cost (110 ms whatever the size) under a 200 ms bound: the line through
    two sizes is flat, so the chunk grows to the full one (a proportional guess would have kept 512)."""
    pacer = PrefillPacer(0.2, full_chunk=4096)
    sizes, gaps = paced(pacer, lambda n: 0.110 + n * 1e-6, 0.014, chunks=12)
    assert sizes[-1] == 4096 and max(gaps) <= 0.2


def test_a_fixed_cost_per_unit_makes_the_chunk_as_large_as_it_is_cheap() -> None:
    """The 27B on an H200 (serving run 24, docs/benchmarks.md): a prefill unit costs at least 90 ms of host
    work, and 0.087 ms a token on the device; a round 14 ms. No chunk keeps a 100 ms gap, and shrinking
    below 1,024 tokens saves nothing: the pacer settles on 1,024 (two units of 64 tokens would cost
    twice the gaps for a sixteenth of the tokens)."""
    pacer = PrefillPacer(0.1, full_chunk=8192)
    sizes, gaps = paced(pacer, lambda n: max(0.090, n * 0.087e-3) + 0.002, 0.014)
    steady = sizes[len(sizes) // 2 :]
    assert max(set(steady), key=steady.count) == 1024
    assert min(sizes) >= GRANULE and sizes.count(GRANULE) <= 1  # it tried down to one granule, once
    assert max(gaps[len(gaps) // 2 :]) < 0.2  # a tried 2,048 at most (194 ms); otherwise 106 ms
    assert sorted(gaps)[len(gaps) // 2] < FLOOR_SLACK * 0.092 + 0.014


def test_a_first_chunk_over_the_bound_shrinks_until_it_fits() -> None:
    """Device-bound costs (0.4 ms a token, 5 ms fixed) and 10 ms rounds: 512 tokens cost 210 ms; the pacer
    halves to 128 (56 ms), the largest that fits 90 ms, and stays there."""
    pacer = PrefillPacer(0.1, full_chunk=8192)
    sizes, gaps = paced(pacer, lambda n: 0.005 + n * 4e-4, 0.010)
    assert sizes[:4] == [512, 256, 128, 64]  # 64 once: the line through 64 and 128 predicts 256 over
    assert set(sizes[4:]) == {128}
    assert max(gaps[3:]) <= 0.1


def test_cheap_chunks_grow_to_the_full_chunk_and_only_table_sizes_are_learned() -> None:
    pacer = PrefillPacer(0.1, full_chunk=3000)
    assert pacer.sizes == (64, 128, 256, 512, 1024, 2048, 3000)
    sizes, _ = paced(pacer, lambda n: n * 1e-6, 0.001, chunks=8)
    assert sizes[:6] == [512, 256, 1024, 2048, 3000, 3000]
    tail = PrefillPacer(0.1, full_chunk=3000)
    paced(tail, lambda n: n * 1e-6, 0.001, chunks=0)
    tail.prefill_ran(700)  # a prompt's tail, or a chunk cut at a capture point: no table size
    tail.decode_committed(1.0)
    assert tail.cost_s == {}
    assert PrefillPacer(None, full_chunk=2048).chunk(decoding=True) == 2048


def test_gaps_that_are_not_one_unit_measure_nothing() -> None:
    pacer = PrefillPacer(0.1, full_chunk=4096)
    pacer.decode_committed(0.0)
    pacer.decode_committed(0.01)
    pacer.idle()  # the worker waited: the next gap counts the wait
    pacer.decode_committed(5.0)
    assert pacer.round_s == pytest.approx(0.01)
    pacer.prefill_ran(256)
    pacer.other_unit_ran()  # forced control between: not a chunk + a round
    pacer.decode_committed(5.5)
    assert pacer.cost_s == {} and pacer.round_s == pytest.approx(0.01)


class UnitClock:
    """The Engine's clock, advanced by the Program: a decode round costs ``round_s``, a prefill chunk
    ``fixed_s`` + ``token_s`` a token. Records each prefill unit's budget and each decode commit time."""

    def __init__(self, round_s: float = 0.02, fixed_s: float = 0.005, token_s: float = 2e-4) -> None:
        self.now = 0.0
        self.round_s, self.fixed_s, self.token_s = round_s, fixed_s, token_s
        self.chunks: list[tuple[int, bool]] = []  # (budget, whether a request was decoding)

    def __call__(self) -> float:
        return self.now

    def drive(self, engine) -> None:  # noqa: ANN001 - the Engine under test
        program, core = engine.core.program, engine.core
        prefill, decode = program.prefill, program.decode

        def timed_prefill(handle, budget):  # noqa: ANN001, ANN202
            record = next(r for r in core.laned.values() if r.handle == handle)
            decoding = any(r.state.name in ("DECODE_READY", "CONTROL_READY") for r in core.laned.values())
            self.chunks.append((budget, decoding))
            self.now += self.fixed_s + self.token_s * min(budget, record.prompt_remaining)
            return prefill(handle, budget)

        def timed_decode(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.now += self.round_s
            return decode(*args, **kwargs)

        program.prefill, program.decode = timed_prefill, timed_decode


def _run(gap_ms: float) -> tuple[UnitClock, list[list[int]], list[float]]:
    """One request decoding 40 tokens while a 900-token prompt arrives behind it (max_concurrency 2,
    stepped by hand so the schedule is exact); returns the clock, both outputs and the decoding
    request's commit times."""
    clock = UnitClock()
    short, long = random_prompts([20, 900], seed=4)
    engine = build_engine(
        "qwen3_6_tiny", prefix_cache=False, max_concurrency=2, chunk=768, start_worker=False,
        clock=clock, max_decode_gap_ms=gap_ms,
    )  # fmt: skip
    clock.drive(engine)
    times: list[float] = []
    with engine:
        first = engine.submit(
            GenerationRequest(prompt=short, max_tokens=40, temperature=0.0, ignore_eos=True)
        )
        for _ in range(6):  # the short request prefills and starts decoding
            engine.core.step()
        second = engine.submit(GenerationRequest(prompt=long, max_tokens=4, temperature=0.0, ignore_eos=True))
        seen = len(engine.core.live[first.request_id].token_ids)
        times.append(clock.now)  # the decoding request's last token before the long prompt arrives
        while not (first.done and second.done):
            engine.core.step()
            produced = len(engine.core.live[first.request_id].token_ids) if not first.done else None
            if produced is not None and produced > seen:
                seen = produced
                times.append(clock.now)
        outputs = [first.result().token_ids, second.result().token_ids]
    return clock, [list(o) for o in outputs], times


def test_a_long_prompt_is_paced_while_another_request_decodes_and_outputs_are_unchanged() -> None:
    paced_clock, paced, paced_times = _run(gap_ms=100.0)
    plain_clock, plain, plain_times = _run(gap_ms=0.0)
    assert paced == plain  # pacing changes chunk sizes, never tokens (fp32, chunked == one-shot)
    assert [b for b, _ in plain_clock.chunks] == [768] * len(plain_clock.chunks)  # off: full chunks
    paced_budgets = [b for b, decoding in paced_clock.chunks if decoding]
    assert paced_budgets and max(paced_budgets) < 768  # smaller while the first request decodes
    gaps = [b - a for a, b in zip(paced_times, paced_times[1:])]
    plain_gaps = [b - a for a, b in zip(plain_times, plain_times[1:])]
    assert max(plain_gaps) > 0.1  # a full chunk between two tokens breaks the bound
    assert sum(g > 0.1 + 1e-9 for g in gaps) <= 1  # only the first chunk, before any was measured
