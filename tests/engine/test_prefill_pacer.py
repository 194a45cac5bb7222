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
from ninfer.runtime.engine.prefill_pacer import GRANULE, PrefillPacer  # noqa: E402

torch.set_num_threads(1)


def test_a_measured_pacer_sizes_the_chunk_to_the_gap() -> None:
    pacer = PrefillPacer(0.1, full_chunk=8192, first_chunk=512)
    assert pacer.chunk(decoding=False) == 8192  # nothing decodes: full chunks
    assert pacer.chunk(decoding=True) == 512  # nothing measured yet
    t = 0.0
    for _ in range(3):  # plain rounds of 10 ms
        t += 0.010
        pacer.decode_committed(t)
    pacer.prefill_ran(512)
    t += 0.010 + 512 * 1e-4  # one round + 512 tokens at 0.1 ms
    pacer.decode_committed(t)
    assert pacer.round_s == pytest.approx(0.010) and pacer.token_s == pytest.approx(1e-4)
    assert pacer.chunk(decoding=True) == (0.09 / 1e-4) // GRANULE * GRANULE  # 896 tokens: 99.6 ms
    assert pacer.chunk(decoding=False) == 8192


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
    assert pacer.token_s is None and pacer.round_s == pytest.approx(0.01)


def test_the_chunk_stays_within_one_granule_and_the_full_chunk() -> None:
    pacer = PrefillPacer(0.05, full_chunk=2048)
    pacer.round_s, pacer.token_s = 0.2, 1e-3  # a round alone exceeds the bound
    assert pacer.chunk(decoding=True) == GRANULE
    pacer.round_s, pacer.token_s = 0.001, 1e-9
    assert pacer.chunk(decoding=True) == 2048
    assert PrefillPacer(None, full_chunk=2048).chunk(decoding=True) == 2048


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
        second = engine.submit(
            GenerationRequest(prompt=long, max_tokens=4, temperature=0.0, ignore_eos=True)
        )
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
