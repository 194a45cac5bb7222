"""Drive a running Engine through its public API and time what it does.

Requests are token-id prompts of exact lengths, greedy (temperature 0), ``ignore_eos``, so every request
produces exactly the tokens asked for. Two kinds of clocks:

- Worker-side: a `UnitTimeline` installed with ``Engine.observe_units`` records the start time, kind
  and row count of every execution unit (one list append on the worker, nothing else). A unit ends
  where the next one starts (every unit ends in a host sync: the sampled tokens are read back), so the
  gap between two consecutive decode rounds of ``B`` rows is one full decode step at ``B``, the
  worker's own bookkeeping between units included.
- Client-side: TTFT and TPOT are what a caller sees, from ``submit`` to the first token delta and
  between the first and the last delta.

A decode measurement at ``B`` submits ``B`` prompts together. They are admitted and prefilled one at a
time, so the early ones already decode in rounds of fewer rows; only rounds of all ``B`` rows count.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ninfer.runtime.engine.engine import Engine, EngineCapacity, GenerationHandle
from ninfer.runtime.engine.prefill_pacer import GRANULE
from ninfer.types import GenerationDelta, GenerationRequest, GenerationResult, GenerationStart

DECODE = "decode"
PREFILL = "prefill"
# decode rounds a request may run beyond the bound below before all B are decode-ready (a request can
# also decode while the caller is still submitting the next one)
ROUND_SLACK = 8
POLL_S = 0.005  # how often the caller looks at its handles while the worker runs decode rounds

Mark = tuple[float, str, int]  # (perf_counter at unit start, unit kind, rows)


class BenchError(RuntimeError):
    """The run did not produce the measurement it was set up for."""


class UnitTimeline:
    """Unit observer (`Engine.observe_units`): appends ``(time, kind, rows)`` for every execution unit,
    before it runs."""

    def __init__(self) -> None:
        self.marks: list[Mark] = []

    def __call__(self, kind: str, rows: int) -> None:
        self.marks.append((time.perf_counter(), kind, rows))


@dataclass(frozen=True)
class BenchPlan:
    batches: tuple[int, ...]
    context: int  # prompt tokens of each decode-measurement request (cold prompts)
    decode_steps: int  # decode rounds of all B rows timed per B (and TPOT intervals)
    prefill_tokens: int
    prefill_repeats: int
    prefill_chunk: int  # EngineConfig.prefill_chunk_tokens
    tokens_per_round: int = 1  # the most tokens a row may produce per decode round (K + 1 speculating)
    # long-context decode (`ninfer.bench.context`): the contexts whose B rows share one prefilled prompt
    # through the context cache; empty: cold prompts of ``context`` tokens
    contexts: tuple[int, ...] = ()
    # output tokens of each prefill request (None: decode_steps + 1); fewer lets a prompt near the model's
    # positions be measured
    prefill_output_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batches}")
        for name in ("context", "decode_steps", "prefill_tokens", "prefill_repeats", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if any(n < 1 for n in self.contexts):
            raise ValueError(f"contexts must be >= 1, got {self.contexts}")
        if self.prefill_output_tokens is not None and self.prefill_output_tokens < 2:
            raise ValueError(f"prefill_output_tokens must be >= 2 (TPOT), got {self.prefill_output_tokens}")

    @property
    def prefill_max_tokens(self) -> int:
        """Output tokens of each prefill request (the first from the prefill, the rest time TPOT)."""
        return self.prefill_output_tokens or self.decode_steps + 1

    def decode_max_tokens(self, batch: int, row_prefill: int | None = None) -> int:
        """Output budget of each request at ``batch``: the first token (from prefill), ``decode_steps + 1``
        full rounds, and the rounds the first request may run while the other ``batch - 1`` prefill (one
        after each of their prompt units, as small as the prefill pacer may cut them), plus slack.
        ``row_prefill``: prompt tokens each row prefills (default ``context``; fewer when it continues a
        checkpoint). A bound, not a target: `EngineDriver.run_rows` stops the rows once it has its rounds."""
        unit = min(self.prefill_chunk, GRANULE)  # the prefill pacer's smallest unit while rows decode
        chunks = math.ceil((self.context if row_prefill is None else row_prefill) / unit)
        rounds = (self.decode_steps + 1) + (batch - 1) * chunks + ROUND_SLACK
        return 1 + rounds * self.tokens_per_round

    @property
    def max_context(self) -> int:
        """Positions one request may need: the Engine's max_context (cold decode and prefill; the
        long-context decode's own need is `ninfer.bench.context.LongContextPlan.max_context`)."""
        prefill = self.prefill_tokens + self.prefill_max_tokens
        if self.contexts:
            return prefill
        return max(self.context + self.decode_max_tokens(max(self.batches)), prefill)


@dataclass(frozen=True)
class DecodeSample:
    batch: int
    step_s: tuple[float, ...]  # the timed full rounds, in order
    context: int = 0  # the context asked for (long-context decode; 0: the plan's cold ``context``)
    prompt_tokens: int = 0  # each row's prompt (long-context decode)
    reused_tokens: tuple[int, ...] = ()  # each row's reused_prefix_tokens (long-context decode)

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)


@dataclass(frozen=True)
class PrefillSample:
    prefill_s: float  # worker: first prompt chunk start -> start of the unit after the last chunk
    ttft_s: float  # caller: submit -> first token delta
    tpot_s: float  # caller: (last delta - first delta) / (tokens - 1)


def _round_intervals(marks: Sequence[Mark], rows: int) -> list[float]:
    return [
        b[0] - a[0]
        for a, b in zip(marks, marks[1:])
        if a[1] == DECODE and b[1] == DECODE and a[2] == rows and b[2] == rows
    ]


def full_round_intervals(marks: Sequence[Mark], rows: int, count: int) -> list[float]:
    """The first ``count`` durations of decode rounds of exactly ``rows`` rows, each measured to the start
    of the directly following round of ``rows`` rows. Raises BenchError when there are fewer."""
    out = _round_intervals(marks, rows)
    if len(out) < count:
        raise BenchError(
            f"only {len(out)} consecutive decode rounds of {rows} rows were observed, {count} needed"
        )
    return out[:count]


def prefill_span(marks: Sequence[Mark]) -> float:
    """Seconds from the start of the first prefill unit to the start of the unit after the last one."""
    starts = [i for i, m in enumerate(marks) if m[1] == PREFILL]
    if not starts or starts[-1] + 1 >= len(marks):
        raise BenchError("the prefill was not followed by another unit (no first decode round observed)")
    return marks[starts[-1] + 1][0] - marks[starts[0]][0]


class PromptSource:
    """Distinct random token-id prompts of exact lengths below ``id_bound`` (the first special id), so
    no two requests share a prefix and none contains a control token."""

    def __init__(self, id_bound: int, seed: int) -> None:
        if id_bound < 2:
            raise ValueError(f"id_bound must be >= 2, got {id_bound}")
        self._bound = id_bound
        self.seed = seed
        self._rng = random.Random(seed)

    def take(self, length: int) -> list[int]:
        return [self._rng.randrange(self._bound) for _ in range(length)]


def greedy_request(prompt: list[int], max_tokens: int, prefix_cache: bool = True) -> GenerationRequest:
    """A bench request: greedy, past end-of-sequence tokens, exactly ``max_tokens`` tokens;
    ``prefix_cache=False`` keeps it out of the context cache (no lookup, no capture)."""
    return GenerationRequest(
        prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prefix_cache=prefix_cache
    )


def _finished(handle: GenerationHandle, expected_tokens: int) -> GenerationResult:
    return _whole_budget(handle.result(), expected_tokens)


def _whole_budget(result: GenerationResult, expected_tokens: int) -> GenerationResult:
    if result.finish_reason != "length" or result.usage.completion_tokens != expected_tokens:
        raise BenchError(
            f"request {result.request_id} ended with {result.finish_reason!r} after "
            f"{result.usage.completion_tokens} tokens, {expected_tokens} expected"
        )
    return result


def _ended(handle: GenerationHandle, budget: int) -> GenerationResult:
    """A decode-measurement row's result: its whole budget, or cancelled by the driver."""
    result = handle.result(raise_on_error=False)
    if result.error is not None:
        raise result.error
    return result if result.finish_reason == "cancelled" else _whole_budget(result, budget)


class EngineDriver:
    """Runs the bench's requests on one Engine whose worker has a `UnitTimeline` installed."""

    def __init__(self, engine: Engine, plan: BenchPlan, prompts: PromptSource) -> None:
        self.engine = engine
        self.plan = plan
        self.prompts = prompts
        self.timeline = UnitTimeline()
        # the long-context decode runs the cache on for its shared prompts; its prefill figures stay cold
        # and in whole chunks (a capture would end a unit early)
        self.prefill_cache = not plan.contexts
        engine.observe_units(self.timeline)

    def warm_up(self) -> None:
        """One untimed prefill of the measured length (allocator growth, kernel selection)."""
        prompt = self.prompts.take(self.plan.prefill_tokens)
        with self.engine.submit(greedy_request(prompt, 2, self.prefill_cache)) as handle:
            _finished(handle, 2)

    def prefill_once(self) -> PrefillSample:
        tokens = self.plan.prefill_max_tokens
        first = len(self.timeline.marks)
        token_times: list[float] = []
        request = greedy_request(self.prompts.take(self.plan.prefill_tokens), tokens, self.prefill_cache)
        t0 = time.perf_counter()
        with self.engine.submit(request) as handle:
            for event in handle:
                if isinstance(event, GenerationDelta) and event.token_ids:
                    now = time.perf_counter()
                    token_times.extend(now for _ in event.token_ids)
            _finished(handle, tokens)
        return PrefillSample(
            prefill_s=prefill_span(self.timeline.marks[first:]),
            ttft_s=token_times[0] - t0,
            tpot_s=(token_times[-1] - token_times[0]) / (len(token_times) - 1),
        )

    def decode_at(self, batch: int) -> DecodeSample:
        """B cold rows: distinct prompts of ``context`` tokens, each prefilled."""
        max_tokens = self.plan.decode_max_tokens(batch)
        requests = [greedy_request(self.prompts.take(self.plan.context), max_tokens) for _ in range(batch)]
        steps, _ = self.run_rows(requests)
        return DecodeSample(batch, steps)

    def run_rows(self, requests: Sequence[GenerationRequest]) -> tuple[tuple[float, ...], tuple[int, ...]]:
        """Submit ``requests`` together; the first ``decode_steps`` rounds of all of them, and each one's
        reused prompt tokens (``Usage.reused_prefix_tokens``). Rows still running once those rounds are
        observed are cancelled (their budget is a bound: `BenchPlan.decode_max_tokens`)."""
        batch = len(requests)
        limit = self.engine.config.max_concurrency
        if batch > limit:
            raise BenchError(f"B={batch} exceeds the Engine's max_concurrency {limit}")
        first = len(self.timeline.marks)
        handles = [self.engine.submit(r) for r in requests]
        try:
            # poll instead of blocking on the event queues: a blocked consumer would wake on every token
            stopped = False
            while not all(h.done for h in handles):
                seen = len(_round_intervals(self.timeline.marks[first:], batch))
                if not stopped and seen >= self.plan.decode_steps:
                    for handle in handles:
                        handle.cancel()
                    stopped = True
                time.sleep(POLL_S)
            results = [_ended(h, r.max_tokens or 0) for h, r in zip(handles, requests)]
        finally:
            for handle in handles:
                handle.close()
        steps = full_round_intervals(self.timeline.marks[first:], batch, self.plan.decode_steps)
        return tuple(steps), tuple(r.usage.reused_prefix_tokens for r in results)


@dataclass(frozen=True)
class RequestSample:
    prompt_tokens: int
    reused_tokens: int
    submit_s: float  # the submit call: the Frontend's rendering and tokenizing, on the caller
    ttft_s: float  # before submit -> the first token delta
    prefill_s: float  # worker: first prefill unit -> the unit after the last one
    result: GenerationResult


class TimedDriver(EngineDriver):
    """`EngineDriver` plus one timed request of any shape."""

    def timed(self, request: GenerationRequest) -> RequestSample:
        first = len(self.timeline.marks)
        start: GenerationStart | None = None
        first_token: float | None = None
        t0 = time.perf_counter()
        with self.engine.submit(request) as handle:
            submitted = time.perf_counter()
            for event in handle:
                if isinstance(event, GenerationStart):
                    start = event
                elif isinstance(event, GenerationDelta) and event.token_ids and first_token is None:
                    first_token = time.perf_counter()
            result = handle.result()
        expected = request.max_tokens
        if result.finish_reason != "length" or result.usage.completion_tokens != expected:
            raise BenchError(
                f"request {result.request_id} ended with {result.finish_reason!r} after "
                f"{result.usage.completion_tokens} tokens, {expected} expected"
                + (f": {result.error}" if result.error is not None else "")
            )
        if start is None or first_token is None:
            raise BenchError(f"request {result.request_id} published no start or no token")
        return RequestSample(
            prompt_tokens=start.prompt_tokens,
            reused_tokens=start.reused_prefix_tokens,
            submit_s=submitted - t0,
            ttft_s=first_token - t0,
            prefill_s=prefill_span(self.timeline.marks[first:]),
            result=result,
        )


@dataclass(frozen=True)
class Skipped:
    """A (context, B) of the long-context decode that was not run, and why."""

    context: int
    batch: int
    reason: str


@dataclass(frozen=True)
class Measurements:
    prefill: tuple[PrefillSample, ...]
    decode: tuple[DecodeSample, ...]
    skipped: tuple[Skipped, ...] = ()
    capacity: EngineCapacity | None = None  # the Engine's pool and limit (the long-context decode reads it)


def measure_prefill(driver: EngineDriver, log: Callable[[str], None]) -> tuple[PrefillSample, ...]:
    """Warm-up, then ``prefill_repeats`` prefill runs."""
    plan = driver.plan
    log(f"warm-up: one {plan.prefill_tokens}-token prefill")
    driver.warm_up()
    prefill = []
    for i in range(plan.prefill_repeats):
        log(
            f"prefill {i + 1}/{plan.prefill_repeats}: {plan.prefill_tokens} tokens + "
            f"{plan.prefill_max_tokens - 1}"
        )
        prefill.append(driver.prefill_once())
    return tuple(prefill)


def measure(driver: EngineDriver, log: Callable[[str], None]) -> Measurements:
    """Warm-up, ``prefill_repeats`` prefill runs, then one decode run per B (ascending)."""
    plan = driver.plan
    prefill = measure_prefill(driver, log)
    decode = []
    for batch in sorted(set(plan.batches)):
        log(f"decode B={batch}: {batch} x {plan.context}-token prompts, {plan.decode_steps} timed rounds")
        decode.append(driver.decode_at(batch))
    return Measurements(prefill, tuple(decode))
