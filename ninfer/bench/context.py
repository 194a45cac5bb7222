"""Long-context decode: ``ninfer bench --context 32768,131072,262144``.

Decode ms/step of B rows at N positions each, for every context N and batch B, beside the floor of
reading the weights, the B rows' K and V of N positions and their GDN state (read and written). Cold
prompts would cost B prefills of N tokens per (N, B): minutes of device time at 256k on a 27B. Here the
B rows share ONE prefilled prompt through the context cache (``EngineConfig.prefix_cache=True``):

- the Engine captures a checkpoint every ``capture_interval`` prompt tokens (a token-id prompt has no
  Frontend boundary; a capture is at a position strictly inside the prompt). The bench picks the
  interval (`capture_interval`) and makes each prompt ``frontier + 1`` tokens long with the frontier a
  multiple of it, so a capture lands one token before the prompt's end;
- a primer request (the prompt, one output token) prefills it once; the B rows then submit the same
  prompt, each continues the checkpoint at the frontier (the full KV pages are shared by reference
  count, so B x 256k fits a pool that holds a few 256k requests) and prefills one token. Every row still
  reads its N positions in decode: the floor is per row. ``reused_prefix_tokens`` of every row is
  reported, so a run that did not reuse says so;
- the contexts' prompts are prefixes of one random token stream (ascending), so each primer continues the
  previous context's checkpoint and prefills only the difference;
- a (N, B) the Engine's pool or context limit cannot hold (`fit_problem`, from ``Engine.capacity()``)
  is skipped with the reason, not run.

The rows' pages are physically shared: a decode step reads the same K/V bytes once per row, and a cache
may serve the repeats (the floor still counts every row's read).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ninfer.bench.drive import (
    BenchPlan,
    DecodeSample,
    EngineDriver,
    Measurements,
    Skipped,
    _finished,
    greedy_request,
    measure_prefill,
)
from ninfer.runtime.engine.context_cache import MIN_CAPTURE_GAP
from ninfer.runtime.engine.engine import EngineCapacity

# the Engine's default capture interval (EngineConfig.capture_interval), the largest the bench picks: a
# shared prompt's frontier is a multiple of it, so a context at the model's positions ends at most this
# many tokens short of them (a capture also ends a prefill unit, so smaller intervals cut the primer's)
MAX_CAPTURE_INTERVAL = 4096

LONG_CONTEXT_NOTES = (
    "long-context decode: the B rows of a context share one prompt prefilled once (a primer request); "
    "each row continues its prompt-end checkpoint (the context cache: full KV pages shared by reference "
    "count) and prefills one token; reused_prefix_tokens per row says whether it did",
    "long-context floor = text weights + B x prompt positions x K/V bytes (every attention layer, compute "
    "dtype) + B x GDN state read and written, over the measured copy bandwidth; the rows' pages are "
    "physically shared, so a device cache may serve a row's repeat of another row's read",
)


def capture_interval(contexts: Sequence[int]) -> int:
    """The Engine's capture interval for these contexts: the largest divisor of all of them that is at
    most `MAX_CAPTURE_INTERVAL`, so every context's frontier is exactly it; when that divisor is below
    the cache's least capture gap, the largest power of two at most the smallest context (frontiers then
    fall up to an interval short of their context)."""
    common = math.gcd(*contexts)
    for interval in range(min(common, MAX_CAPTURE_INTERVAL), MIN_CAPTURE_GAP - 1, -1):
        if common % interval == 0:
            return interval
    return max(MIN_CAPTURE_GAP, min(MAX_CAPTURE_INTERVAL, 1 << (min(contexts).bit_length() - 1)))


@dataclass(frozen=True)
class SharedPrompt:
    """The prompt the B rows of one context share: ``frontier`` tokens come from its checkpoint."""

    context: int  # asked for
    prompt_tokens: int  # frontier + 1 (or the context itself when no capture fits below it)
    frontier: int  # the checkpoint's positions (a multiple of the capture interval; 0: none)

    @property
    def row_prefill(self) -> int:
        """Prompt tokens each row prefills after continuing the checkpoint."""
        return self.prompt_tokens - self.frontier


@dataclass(frozen=True)
class LongContextPlan:
    """Where the long-context decode's prompts end, and the Engine settings it needs."""

    plan: BenchPlan
    positions: int  # the model's
    interval: int  # EngineConfig.capture_interval
    prompts: tuple[SharedPrompt, ...]  # ascending context

    @classmethod
    def build(cls, plan: BenchPlan, positions: int) -> LongContextPlan:
        """Prompts ending one token after a capture point and leaving room for the largest B's budget
        within the model's positions (a context at the model's limit ends up to an interval short)."""
        too_long = [n for n in plan.contexts if n > positions]
        if too_long:
            raise ValueError(f"--context {too_long[0]} exceeds the model's {positions} positions")
        interval = capture_interval(plan.contexts)
        tail = plan.decode_max_tokens(max(plan.batches), row_prefill=1)
        prompts = []
        for n in sorted(set(plan.contexts)):
            target = min(n, positions - tail - 1)
            frontier = interval * (target // interval)
            prompts.append(SharedPrompt(n, frontier + 1 if frontier else max(1, target), frontier))
        return cls(plan, positions, interval, tuple(prompts))

    def budget(self, batch: int, prompt: SharedPrompt) -> int:
        """Each row's max_tokens: the plan's budget for rows that prefill ``prompt.row_prefill`` tokens."""
        return self.plan.decode_max_tokens(batch, row_prefill=prompt.row_prefill)

    @property
    def max_context(self) -> int:
        """Positions the longest request needs (the Engine's max_context off CUDA)."""
        rows = max(p.prompt_tokens + self.budget(max(self.plan.batches), p) for p in self.prompts)
        return min(self.positions, max(rows, self.plan.max_context))


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def fit_problem(prompt: SharedPrompt, batch: int, max_tokens: int, capacity: EngineCapacity) -> str | None:
    """Why B rows of ``prompt`` cannot run at once on this Engine (None: they fit): the context limit,
    or the pages of the shared prefix (once) plus every row's own (its growth past the frontier's full
    pages) against the whole pool (inactive checkpoints are evicted as needed)."""
    need = prompt.prompt_tokens + max_tokens
    if need > capacity.max_context:
        return (
            f"a row needs {need} positions (prompt {prompt.prompt_tokens} + {max_tokens} tokens), the "
            f"Engine's max_context is {capacity.max_context}"
        )
    page = capacity.page_size
    shared = prompt.frontier // page
    pages = pages_for(prompt.frontier, page) + batch * (pages_for(need, page) - shared)
    pool = capacity.kv_pool_tokens // page
    if pages > pool:
        page_bytes = capacity.kv_pool_bytes / pool if pool else 0.0
        return (
            f"{batch} rows sharing a {prompt.frontier}-token prefix need {pages} KV pages "
            f"({pages * page_bytes / 1e9:.2f} GB), the pool holds {pool} "
            f"({capacity.kv_pool_bytes / 1e9:.2f} GB)"
        )
    return None


class SharedPromptDriver(EngineDriver):
    """`EngineDriver` plus the long-context decode: a primer, then B rows continuing its checkpoint."""

    def prime(self, prompt: list[int]) -> int:
        """Prefill ``prompt`` once (one output token) so its interval points are captured; returns the
        prompt tokens it reused itself (the previous context's frontier, when the prompts chain)."""
        with self.engine.submit(greedy_request(prompt, 1)) as handle:
            return _finished(handle, 1).usage.reused_prefix_tokens

    def decode_shared(self, batch: int, prompt: list[int], context: int, max_tokens: int) -> DecodeSample:
        requests = [greedy_request(prompt, max_tokens) for _ in range(batch)]
        steps, reused = self.run_rows(requests)
        return DecodeSample(batch, steps, context=context, prompt_tokens=len(prompt), reused_tokens=reused)


def measure_long_context(
    driver: SharedPromptDriver, long_plan: LongContextPlan, log: Callable[[str], None]
) -> Measurements:
    """The prefill runs (cold, out of the cache), then per context: the fit check per B, one primer when
    any B fits, one decode run per B that fits (ascending)."""
    prefill = measure_prefill(driver, log)
    plan, capacity = long_plan.plan, driver.engine.capacity()
    stream = driver.prompts.take(max(p.prompt_tokens for p in long_plan.prompts))
    decode: list[DecodeSample] = []
    skipped: list[Skipped] = []
    for prompt in long_plan.prompts:
        runs = []
        for batch in sorted(set(plan.batches)):
            problem = fit_problem(prompt, batch, long_plan.budget(batch, prompt), capacity)
            if problem is None:
                runs.append(batch)
            else:
                skipped.append(Skipped(prompt.context, batch, problem))
                log(f"context {prompt.context} B={batch} skipped: {problem}")
        if not runs:
            continue
        ids = stream[: prompt.prompt_tokens]
        log(f"context {prompt.context}: priming one {prompt.prompt_tokens}-token prompt")
        reused = driver.prime(ids)
        log(f"context {prompt.context}: primed (it reused {reused} tokens); checkpoint at {prompt.frontier}")
        for batch in runs:
            log(
                f"decode at context {prompt.context} B={batch}: B rows of the shared prompt, "
                f"{plan.decode_steps} timed rounds"
            )
            max_tokens = long_plan.budget(batch, prompt)
            decode.append(driver.decode_shared(batch, ids, prompt.context, max_tokens))
    return Measurements(prefill, tuple(decode), tuple(skipped), capacity)
