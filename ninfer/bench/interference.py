"""`ninfer bench --interference PROMPT_TOKENS`: decoding streams while a long prompt arrives.

``streams`` requests decode; once each has its first token, one cold prompt of ``prompt_tokens`` tokens
arrives. The report gives, with prefill pacing on (`EngineConfig.max_decode_gap_ms`: the Engine's
default for its op table, or each bound given) and off (0), the streams' gaps between two tokens while
that prompt is prefilled (from its arrival to its first token), and its TTFT beside its TTFT alone on the
same Engine. One Engine per bound and one unpaced, over the same weights (the setting is fixed at
start), so the bounds compare on one machine. Times are the caller's (`time.perf_counter` at each
streamed event), as a client sees them.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ninfer.bench.drive import BenchError, PromptSource, greedy_request
from ninfer.bench.report import RunHeader
from ninfer.bench.runner import (
    BenchOptions,
    engine_config,
    first_special_id,
    options_package,
    probe_and_start,
    run_header,
)
from ninfer.bench.startup import StartedEngine, restart
from ninfer.runtime.engine.engine import Engine
from ninfer.types import EngineConfig, GenerationDelta


@dataclass(frozen=True)
class InterferencePlan:
    prompt_tokens: int  # the long prompt
    streams: int = 4  # requests decoding when it arrives
    context: int = 512  # each stream's prompt
    stream_tokens: int = 4096  # each stream's budget (it is cancelled once the long prompt has its token)
    # the paced runs' bounds, one Engine each (None: the Engine's default)
    bounds_ms: tuple[float | None, ...] = (None,)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 2 or self.streams < 1 or self.context < 1 or self.stream_tokens < 2:
            raise ValueError("--interference needs a prompt of 2+ tokens and at least one stream")
        if not self.bounds_ms or any(b is not None and not b > 0 for b in self.bounds_ms):
            raise ValueError(f"--interference needs pacing bounds > 0 ms, got {self.bounds_ms}")

    @property
    def max_context(self) -> int:
        return max(self.prompt_tokens + 2, self.context + self.stream_tokens)


@dataclass(frozen=True)
class InterferenceRow:
    pacing: str  # "on" or "off"
    max_decode_gap_ms: float  # the Engine's bound (0: off)
    solo_ttft_ms: float  # the long prompt alone
    ttft_ms: float  # the long prompt while the streams decode
    gaps_ms: tuple[float, ...]  # every stream's gaps between two tokens while it was prefilled

    def to_json(self) -> dict[str, Any]:
        gaps = sorted(self.gaps_ms)
        return {
            "pacing": self.pacing,
            "max_decode_gap_ms": self.max_decode_gap_ms,
            "solo_ttft_ms": round(self.solo_ttft_ms, 3),
            "ttft_ms": round(self.ttft_ms, 3),
            "ttft_vs_solo": round(self.ttft_ms / self.solo_ttft_ms, 4) if self.solo_ttft_ms else None,
            "gap_max_ms": round(gaps[-1], 3) if gaps else None,
            "gap_p99_ms": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 3) if gaps else None,
            "gap_median_ms": round(statistics.median(gaps), 3) if gaps else None,
            "gaps": len(gaps),
        }


@dataclass(frozen=True)
class InterferenceReport:
    header: RunHeader
    plan: InterferencePlan
    rows: tuple[InterferenceRow, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            **self.header.to_json(),
            "mode": "interference",
            "settings": {
                "prompt_tokens": self.plan.prompt_tokens,
                "streams": self.plan.streams,
                "context": self.plan.context,
            },
            "rows": [row.to_json() for row in self.rows],
        }


def render_interference(report: InterferenceReport) -> str:
    plan = report.plan
    lines = [
        f"{report.header.package} on {report.header.device}: {plan.streams} streams decoding while a "
        f"{plan.prompt_tokens}-token prompt arrives",
        f"{'pacing':>8} {'bound ms':>9} {'gap max':>9} {'gap p99':>9} {'gap med':>9} {'TTFT ms':>9} "
        f"{'solo ms':>9} {'x solo':>7}",
    ]
    for row in report.rows:
        j = row.to_json()
        lines.append(
            f"{row.pacing:>8} {row.max_decode_gap_ms:>9.1f} {j['gap_max_ms'] or 0:>9.1f} "
            f"{j['gap_p99_ms'] or 0:>9.1f} {j['gap_median_ms'] or 0:>9.1f} {row.ttft_ms:>9.1f} "
            f"{row.solo_ttft_ms:>9.1f} {j['ttft_vs_solo'] or 0:>7.3f}"
        )
    return "\n".join(lines)


def _first_token_ms(engine: Engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    with engine.submit(greedy_request(prompt, 2)) as handle:
        for event in handle:
            if isinstance(event, GenerationDelta) and event.token_ids:
                return (time.perf_counter() - start) * 1e3
    raise BenchError("the long prompt produced no token")


def _scenario(engine: Engine, plan: InterferencePlan, prompts: PromptSource) -> tuple[float, list[float]]:
    """The long prompt's TTFT (ms) while ``plan.streams`` requests decode, and their gaps (ms) meanwhile."""
    arrivals: list[list[float]] = [[] for _ in range(plan.streams)]
    started = [threading.Event() for _ in range(plan.streams)]
    requests = [greedy_request(prompts.take(plan.context), plan.stream_tokens) for _ in arrivals]
    handles = [engine.submit(r) for r in requests]

    def consume(i: int) -> None:
        for event in handles[i]:
            if isinstance(event, GenerationDelta) and event.token_ids:
                arrivals[i].append(time.perf_counter())
                started[i].set()

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(plan.streams)]
    for thread in threads:
        thread.start()
    try:
        for event in started:
            if not event.wait(600):
                raise BenchError("a stream produced no token in 600 s")
        time.sleep(0.05)  # a few steady rounds first
        sent = time.perf_counter()
        ttft = _first_token_ms(engine, prompts.take(plan.prompt_tokens))
        done = sent + ttft / 1e3
    finally:
        for handle in handles:
            handle.cancel()
        for thread in threads:
            thread.join(60)
    gaps = []
    for times in arrivals:  # the gaps that overlap the long prompt's prefill
        gaps += [(b - a) * 1e3 for a, b in zip(times, times[1:]) if b > sent and a < done]
    if not gaps:
        raise BenchError("no stream produced a token while the long prompt was prefilled")
    return ttft, gaps


def _row(
    started: StartedEngine, plan: InterferencePlan, prompts: PromptSource, pacing: str
) -> InterferenceRow:
    engine = started.engine
    bound = engine.config.max_decode_gap_ms or 0.0
    _first_token_ms(engine, prompts.take(plan.prompt_tokens))  # the long prompt's shapes, warm
    solo = _first_token_ms(engine, prompts.take(plan.prompt_tokens))
    ttft, gaps = _scenario(engine, plan, prompts)
    return InterferenceRow(pacing, bound, solo, ttft, tuple(gaps))


def interference_config(
    options: BenchOptions, plan: InterferencePlan, bound_ms: float | None
) -> EngineConfig:
    base = engine_config(options)
    return replace(
        base, max_concurrency=plan.streams + 1, queue_capacity=plan.streams + 1, max_context=plan.max_context,
        max_decode_gap_ms=bound_ms, prefix_cache=False, cache_memory_gb=None,
    )  # fmt: skip


def run_interference(
    options: BenchOptions, plan: InterferencePlan, log: Callable[[str], None] = lambda _: None
) -> InterferenceReport:
    package, _ = options_package(options)
    positions = package.variant.max_position_embeddings
    plan = replace(plan, stream_tokens=max(2, min(plan.stream_tokens, positions - plan.context)))
    if plan.max_context > positions:
        raise ValueError(
            f"--interference {plan.prompt_tokens} needs {plan.max_context} positions; the model holds "
            f"{package.variant.max_position_embeddings}"
        )
    first = plan.bounds_ms[0]
    probe, started = probe_and_start(options, interference_config(options, plan, first), log)
    header = run_header(started, probe)
    prompts = PromptSource(first_special_id(package.variant.special), options.seed)
    rows = []
    try:
        for i, bound in enumerate(plan.bounds_ms):
            if i:
                started = restart(started, interference_config(options, plan, bound))
            log(f"pacing on at {started.engine.config.max_decode_gap_ms} ms: {plan.streams} streams + one "
                f"{plan.prompt_tokens}-token prompt")  # fmt: skip
            rows.append(_row(started, plan, prompts, "on"))
        log("pacing off: another Engine over the same weights")
        started = restart(started, interference_config(options, plan, 0.0))
        rows.append(_row(started, plan, prompts, "off"))
    finally:
        if started.engine is not None:
            started.engine.close()
    return InterferenceReport(header, plan, tuple(rows))
