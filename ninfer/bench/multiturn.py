"""`ninfer bench --multi-turn TURNS`: a synthetic agent conversation through the context cache.

One Engine with the context cache on (``EngineConfig.prefix_cache=True``) runs one chat conversation
under one session id: turn k appends a user message of exactly ``turn_tokens`` tokens (words the
tokenizer encodes as one token each, counted by encoding the message) to the history and asks for a
reply of ``reply_tokens`` tokens (greedy, ``ignore_eos``), which goes back into the history as the
assistant message an OpenAI client sends. Each turn continues the checkpoint the previous turn's prefill
captured at its reply start, so it prefills only the previous reply and the new message.

Beside every turn, on the same Engine, a **cold-new** request: a token-id prompt of exactly the tokens the
turn prefilled (its prompt less its reused prefix), with the cache opted out (``prefix_cache=False``:
it neither continues nor leaves a checkpoint). The issue's target is turn-k TTFT <= 1.15 x cold-new TTFT
+ 5 ms: continuing a long conversation costs about what its new tokens alone cost.

Then decode ms/step at B = 1 and the same prompt length with the cache on (this Engine) and off (a
second Engine over the same weights with ``EngineConfig.prefix_cache=False``: no catalog at all), the
device time of every capture (CUDA events around the Program's ``capture``), the bytes per checkpoint
and how many fit in the cache budget.
"""

from __future__ import annotations

import random
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ninfer.bench.drive import BenchError, BenchPlan, EngineDriver, PromptSource, TimedDriver
from ninfer.bench.report import DecodeRow, RunHeader
from ninfer.bench.roofline import decode_step_bytes
from ninfer.bench.runner import (
    BenchOptions,
    engine_config,
    first_special_id,
    options_package,
    probe_and_start,
    run_header,
)
from ninfer.bench.startup import restart
from ninfer.runtime.engine.engine import Engine
from ninfer.targets.open import resolve_kernels
from ninfer.types import EngineConfig, GenerationRequest

SESSION_ID = "ninfer-bench-multi-turn"
# the target of the issue: turn-k TTFT <= RATIO_ALLOWANCE x cold-new TTFT + SLACK_MS
RATIO_ALLOWANCE = 1.15
SLACK_MS = 5.0
SYSTEM_PROMPT = (
    "You are a coding agent working in a large repository. Read the files the user shows you, keep "
    "track of what changed between turns, and answer with the next edit to make."
)
# the untimed warm-up conversation's: shares no token with the timed one's system prompt
WARMUP_SYSTEM_PROMPT = "Warm-up only. Answer each question in one short paragraph."
# the template's own reasoning is off: the replies are content, sent back as the history's assistant turns
TEMPLATE_KWARGS = {"enable_thinking": False}
WORD = re.compile(r" [A-Za-z]{2,12}")
WORD_SCAN_IDS = 40_000  # token ids looked at for one-token words (the ordinary ones come first)
MIN_WORDS = 64


@dataclass(frozen=True)
class MultiTurnPlan:
    turns: int
    turn_tokens: int  # new user-message tokens per turn
    reply_tokens: int  # max_tokens of every turn (ignore_eos: exactly this many)
    context: int  # prompt tokens of the decode comparison's request
    decode_steps: int
    prefill_chunk: int

    def __post_init__(self) -> None:
        for name in ("turns", "turn_tokens", "context", "decode_steps", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.reply_tokens < 2:
            raise ValueError(
                f"reply_tokens must be >= 2 (a decode unit must follow the prefill), got {self.reply_tokens}"
            )

    @property
    def decode_plan(self) -> BenchPlan:
        return BenchPlan(
            batches=(1,), context=self.context, decode_steps=self.decode_steps, prefill_tokens=self.context,
            prefill_repeats=1, prefill_chunk=self.prefill_chunk,
        )  # fmt: skip

    @property
    def conversation_tokens(self) -> int:
        """A bound on the last turn's prompt plus its reply: the system turn, every message with its
        turn markers, every reply as re-encoded text (at most twice its tokens, plus its markers)."""
        per_turn = self.turn_tokens + 2 * self.reply_tokens + 32
        return 64 + len(SYSTEM_PROMPT) + self.turns * per_turn

    @property
    def max_context(self) -> int:
        return max(self.conversation_tokens, self.decode_plan.max_context)


class WordSource:
    """User messages of an exact token count: words the tokenizer encodes as one token each (a space and
    letters), drawn at random; the count is checked by encoding the message and corrected."""

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], id_bound: int,
                 seed: int) -> None:  # fmt: skip
        self._encode = encode
        words = []
        for i in range(min(id_bound, WORD_SCAN_IDS)):
            text = decode([i])
            if WORD.fullmatch(text) and encode(text) == [i]:
                words.append(text)
        if len(words) < MIN_WORDS:
            raise BenchError(f"the tokenizer has only {len(words)} one-token words among its first ids")
        self.words = words
        self._rng = random.Random(seed)

    def text(self, tokens: int) -> str:
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        words = [self._rng.choice(self.words) for _ in range(tokens)]
        for _ in range(64):
            n = len(self._encode("".join(words)))
            if n == tokens:
                return "".join(words)
            if n > tokens:
                del words[-max(1, (n - tokens) // 2) :]
            else:
                words += [self._rng.choice(self.words) for _ in range(tokens - n)]
        raise BenchError(f"no message of exactly {tokens} tokens was found")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reuse_lower_bound(previous: Sequence[int], boundaries: Sequence[int], current: Sequence[int]) -> int:
    """Prompt tokens the turn after ``previous`` must reuse at least: the previous prompt's last reuse
    boundary (its reply start, which its prefill captured) that lies in the common prefix of both prompts
    and before the end of ``current`` (at least one prompt token is always prefilled)."""
    shared = common_prefix(previous, current)
    return max((b for b in boundaries if b <= shared and b < len(current)), default=0)


class TransitionClock:
    """Times the Program's checkpoint transitions: instance attributes that shadow its ``capture`` and
    ``retain`` (what the Engine's ResourceManager calls) with the same call between two clocks: CUDA
    events on the worker's stream (the device copies the capture queues; no synchronisation, read after
    the run) and the host time of the call. Nothing in ``ninfer/runtime`` or the Program changes."""

    NAMES = ("capture", "retain")

    def __init__(self, program: Any, device: torch.device) -> None:
        self.program = program
        self.cuda = device.type == "cuda"
        self.calls: dict[str, list[tuple[float, Any, Any, bool]]] = {name: [] for name in self.NAMES}
        for name in self.NAMES:
            setattr(program, name, self._timed(name, getattr(program, name)))

    def _timed(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            begin = end = None
            if self.cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            t0 = time.perf_counter()
            result = call(*args, **kwargs)
            host = time.perf_counter() - t0
            if end is not None:
                end.record()
            self.calls[name].append((host, begin, end, bool(getattr(result, "published", ()))))
            return result

        return timed

    def clear(self) -> None:
        """Forget the calls so far (the warm-up's)."""
        for calls in self.calls.values():
            calls.clear()

    def remove(self) -> None:
        for name in self.NAMES:
            self.program.__dict__.pop(name, None)
        self.program = None

    def device_ms(self, name: str) -> list[float]:
        """Device time of each call that published a checkpoint (CPU: its host time)."""
        out = []
        for host, begin, end, published in self.calls[name]:
            if not published:
                continue
            if begin is not None:
                end.synchronize()
                out.append(begin.elapsed_time(end))
            else:
                out.append(host * 1e3)
        return out

    def host_ms(self, name: str) -> list[float]:
        return [host * 1e3 for host, _, _, published in self.calls[name] if published]


@dataclass(frozen=True)
class TurnRow:
    turn: int
    prompt_tokens: int
    reused_tokens: int
    expected_reused_min: int  # reuse_lower_bound of the prompts (0 for the first turn)
    ttft_ms: float
    submit_ms: float
    prefill_ms: float
    cold_tokens: int  # the cold-new prompt: prompt_tokens - reused_tokens
    cold_reused_tokens: int
    cold_ttft_ms: float
    cold_submit_ms: float
    cold_prefill_ms: float

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens

    @property
    def ratio(self) -> float:
        return self.ttft_ms / self.cold_ttft_ms

    @property
    def allowance_ms(self) -> float:
        return RATIO_ALLOWANCE * self.cold_ttft_ms + SLACK_MS

    @property
    def within_allowance(self) -> bool:
        return self.ttft_ms <= self.allowance_ms

    def to_json(self) -> dict[str, Any]:
        return {
            "turn": self.turn,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "expected_reused_min": self.expected_reused_min,
            "new_tokens": self.new_tokens,
            "ttft_ms": round(self.ttft_ms, 3),
            "submit_ms": round(self.submit_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "cold_new": {
                "tokens": self.cold_tokens,
                "reused_tokens": self.cold_reused_tokens,
                "ttft_ms": round(self.cold_ttft_ms, 3),
                "submit_ms": round(self.cold_submit_ms, 3),
                "prefill_ms": round(self.cold_prefill_ms, 3),
            },
            "ratio": round(self.ratio, 4),
            "allowance_ms": round(self.allowance_ms, 3),
            "within_allowance": self.within_allowance,
        }


@dataclass(frozen=True)
class CaptureRow:
    captures: int  # Program.capture calls that published a checkpoint
    device_ms: tuple[float, ...]
    host_ms: tuple[float, ...]
    retains: int  # CacheStats.retains
    retain_host_ms: tuple[float, ...]
    timing: str  # "cuda events" or "host (cpu)"

    def to_json(self) -> dict[str, Any]:
        def stats(values: tuple[float, ...]) -> dict[str, float] | None:
            if not values:
                return None
            return {
                "median": round(statistics.median(values), 4),
                "min": round(min(values), 4),
                "max": round(max(values), 4),
            }

        return {
            "captures": self.captures,
            "device_ms": stats(self.device_ms),
            "host_ms": stats(self.host_ms),
            "timing": self.timing,
            "retains": self.retains,
            "retain_host_ms": stats(self.retain_host_ms),
        }


@dataclass(frozen=True)
class CacheRow:
    checkpoints: int
    checkpoint_bytes: int
    hits: int
    hit_tokens: int
    captures: int
    retains: int
    evictions: int
    checkpoint_slots: int | None  # state slots for checkpoints beyond the lanes' (one per checkpoint)
    budget_bytes: int | None  # the cache's memory beyond the lanes' own (cache_memory_gb, or the sizing)
    budget_source: str
    conversation_bytes: int | None  # one state slot + the KV pages of the whole last prompt

    @property
    def bytes_per_checkpoint(self) -> int | None:
        return self.checkpoint_bytes // self.checkpoints if self.checkpoints else None

    @property
    def fit(self) -> int | None:
        """Checkpoints of this size the budget holds: its bytes over the size, at most its state slots."""
        per = self.bytes_per_checkpoint
        if not per or self.budget_bytes is None:
            return None
        by_bytes = self.budget_bytes // per
        return by_bytes if self.checkpoint_slots is None else min(by_bytes, self.checkpoint_slots)

    @property
    def fit_conversations(self) -> int | None:
        if not self.conversation_bytes or self.budget_bytes is None:
            return None
        by_bytes = self.budget_bytes // self.conversation_bytes
        return by_bytes if self.checkpoint_slots is None else min(by_bytes, self.checkpoint_slots)

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoints": self.checkpoints,
            "checkpoint_bytes": self.checkpoint_bytes,
            "bytes_per_checkpoint": self.bytes_per_checkpoint,
            "hits": self.hits,
            "hit_tokens": self.hit_tokens,
            "captures": self.captures,
            "retains": self.retains,
            "evictions": self.evictions,
            "checkpoint_slots": self.checkpoint_slots,
            "budget_bytes": self.budget_bytes,
            "budget_source": self.budget_source,
            "fit": self.fit,
            "conversation_bytes": self.conversation_bytes,
            "fit_conversations": self.fit_conversations,
        }


def _decode_json(row: DecodeRow) -> dict[str, Any]:
    return {
        "batch": row.batch,
        "context": row.context,
        "steps": row.steps,
        "ms_step": round(row.ms_step, 4),
        "ms_step_min": round(row.ms_step_min, 4),
        "ms_step_max": round(row.ms_step_max, 4),
        "tok_s": round(row.tok_s, 2),
        "floor_ms": round(row.floor_ms, 4),
        "pct_floor": round(row.pct_floor, 2),
    }


@dataclass(frozen=True)
class MultiTurnReport:
    header: RunHeader
    turns: tuple[TurnRow, ...]
    decode_on: DecodeRow
    decode_off: DecodeRow
    capture: CaptureRow
    cache: CacheRow
    settings: dict[str, Any]
    assumptions: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        out = self.header.to_json()
        out.update(
            mode="multi_turn",
            turns=[t.to_json() for t in self.turns],
            target={
                "ratio": RATIO_ALLOWANCE,
                "slack_ms": SLACK_MS,
                "turns_within": sum(t.within_allowance for t in self.turns[1:]),
                "turns_checked": len(self.turns) - 1,
            },  # fmt: skip
            decode={
                "cache_on": _decode_json(self.decode_on),
                "cache_off": _decode_json(self.decode_off),
                "on_over_off": round(self.decode_on.ms_step / self.decode_off.ms_step, 4),
            },
            capture=self.capture.to_json(),
            cache=self.cache.to_json(),
            settings=self.settings,
            assumptions=list(self.assumptions),
        )
        return out


def _ms(x: float) -> str:
    return f"{x:.3g}" if x < 10 else f"{x:.1f}"


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.3g} GiB"


def render_multi_turn(report: MultiTurnReport) -> str:
    s = report.settings
    lines = report.header.lines("--multi-turn")
    lines += [
        f"context cache on (capture interval {s['capture_interval']}); one session of {s['turns']} turns: "
        f"{s['turn_tokens']} new user tokens + a {s['reply_tokens']}-token reply each (greedy, ignore_eos)",
        "",
        f"{'turn':>4} {'prompt':>7} {'reused':>7} {'>=min':>7} {'new':>6} {'TTFT ms':>9} {'submit':>7} "
        f"{'prefill':>8} | {'cold-new':>8} {'TTFT ms':>9} {'reused':>6} | {'ratio':>6} {'allow ms':>9} ok",
    ]
    for t in report.turns:
        lines.append(
            f"{t.turn:>4} {t.prompt_tokens:>7} {t.reused_tokens:>7} {t.expected_reused_min:>7} "
            f"{t.new_tokens:>6} {_ms(t.ttft_ms):>9} {_ms(t.submit_ms):>7} {_ms(t.prefill_ms):>8} | "
            f"{t.cold_tokens:>8} {_ms(t.cold_ttft_ms):>9} {t.cold_reused_tokens:>6} | {t.ratio:>6.3f} "
            f"{_ms(t.allowance_ms):>9} {'yes' if t.within_allowance else 'NO'}"
        )
    checked = report.turns[1:]
    on, off, cap, cache = report.decode_on, report.decode_off, report.capture, report.cache
    lines += [
        f"target turn-k TTFT <= {RATIO_ALLOWANCE} x cold-new TTFT + {SLACK_MS:g} ms: "
        f"{sum(t.within_allowance for t in checked)} of {len(checked)} turns after the first",
        "",
        f"decode B=1 at context {on.context} (median of {on.steps} rounds): cache on "
        f"{_ms(on.ms_step)} ms/step, off {_ms(off.ms_step)} ms/step (on/off {on.ms_step / off.ms_step:.3f}; "
        f"floor {_ms(on.floor_ms)} ms)",
    ]
    if cap.device_ms:
        lines.append(
            f"captures: {cap.captures}, device time median {_ms(statistics.median(cap.device_ms))} ms "
            f"({_ms(min(cap.device_ms))}..{_ms(max(cap.device_ms))}, {cap.timing}); host "
            f"{_ms(statistics.median(cap.host_ms))} ms"
        )
    else:
        lines.append("captures: none published")
    lines.append(
        f"turn-end retains: {cap.retains}"
        + (
            ""
            if cap.retains
            else " (every turn ends by length under ignore_eos: only a turn ending with "
            "<|im_end|> is retained; the next turn continues the reply-start capture instead)"
        )  # fmt: skip
    )
    per = cache.bytes_per_checkpoint
    lines.append(
        f"checkpoints held {cache.checkpoints}, {cache.checkpoint_bytes / 2**20:.3g} MiB, "
        f"{'?' if per is None else f'{per / 2**20:.3g} MiB'} each "
        f"(state slot + own partial page); budget {_gib(cache.budget_bytes)} ({cache.budget_source}), "
        f"{cache.checkpoint_slots} checkpoint slots: {cache.fit} such checkpoints fit, "
        f"{cache.fit_conversations} whole conversations of {_gib(cache.conversation_bytes)}"
    )
    lines.append(f"cache: {cache.hits} hits, {cache.hit_tokens} tokens reused, {cache.evictions} evictions")
    lines += ["", *(f"note: {a}" for a in report.assumptions)]
    return "\n".join(lines)


ASSUMPTIONS = (
    "warm-up: one untimed conversation of the same turns and sizes (another system prompt, words and "
    "session) runs first and the cache is reset after it, so the timed turns meet compiled kernels; the "
    "cache counters are the timed conversation's",
    "TTFT: before submit -> first token delta, at the caller (submit: the Frontend renders and tokenizes "
    "the whole conversation on the caller, reported as submit); prefill: worker time from the first "
    "prefill unit to the unit after the last",
    "cold-new: a token-id prompt of exactly the turn's prefilled tokens (prompt - reused), random ordinary "
    "ids, prefix_cache=False on the request, on the same Engine right after the turn",
    ">=min: the reuse the prompts guarantee: the previous prompt's last reuse boundary (its reply start, "
    "captured by its prefill) inside the prefix both prompts share; computed from the prompts, not the cache",
    "decode cache off: a second Engine over the same weights with EngineConfig(prefix_cache=False) (no "
    "catalog, no checkpoint memory); both decode B=1 on a fresh random prompt of the same length",
    "capture device time: CUDA events around Program.capture on the worker's stream (the state-slot and "
    "partial-page copies it queues); on CPU its host time",
    "bytes per checkpoint = CacheStats.checkpoint_bytes / checkpoints: what each holds alone when published "
    "(full KV pages are shared with the sequence and the later checkpoints of the conversation); a whole "
    "conversation holds one state slot and the pages of its last prompt",
)


def multi_turn_config(options: BenchOptions, plan: MultiTurnPlan) -> EngineConfig:
    base = engine_config(replace(options, plan=plan.decode_plan, prefix_cache=True))
    return replace(base, max_concurrency=1, queue_capacity=1, max_context=plan.max_context)


def _cache_budget(program: Any, config: EngineConfig) -> tuple[int | None, int | None, str]:
    """(checkpoint slots, budget bytes, where the budget comes from), read from the Program's
    configuration and resource book where it has them."""
    slots = getattr(getattr(program, "config", None), "checkpoint_slots", None)
    book = getattr(program, "book", None)
    pconf = getattr(program, "config", None)
    backend = getattr(program, "backend", None)
    plan = getattr(pconf, "memory", None)
    shared_pool = plan is not None and plan.device == "cuda"  # checkpoint pages come from the whole pool
    if config.cache_memory_gb is not None and not shared_pool:
        return slots, int(config.cache_memory_gb * 2**30), "--cache-memory-gb"
    try:
        lane_pages = -(-(pconf.max_context + backend.extra_tokens) // pconf.page_size) * pconf.max_concurrency
        budget = slots * book.slot_bytes + max(0, pconf.kv_pages - lane_pages) * book.page_bytes
    except (AttributeError, TypeError):
        return slots, None, "unknown"
    source = "--cache-memory-gb slots + " if config.cache_memory_gb is not None else ""
    return slots, budget, source + "sized by the Engine (docs/resources-and-context-cache.md, Sizing)"


def _conversation_bytes(program: Any, tokens: int) -> int | None:
    book, pconf = getattr(program, "book", None), getattr(program, "config", None)
    try:
        return book.slot_bytes + -(-tokens // pconf.page_size) * book.page_bytes
    except (AttributeError, TypeError):
        return None


def _decode_row(engine: Engine, plan: BenchPlan, prompts: PromptSource, variant: Any, dtype: torch.dtype,
                bandwidth: float) -> DecodeRow:  # fmt: skip
    sample = EngineDriver(engine, plan, prompts).decode_at(1)
    bytes_step = decode_step_bytes(variant, 1, plan.context, dtype).total
    return DecodeRow(
        batch=1, context=plan.context, steps=len(sample.step_s), ms_step=sample.median_s * 1e3,
        ms_step_min=min(sample.step_s) * 1e3, ms_step_max=max(sample.step_s) * 1e3,
        floor_ms=bytes_step / bandwidth * 1e3, bytes_step=bytes_step,
    )  # fmt: skip


def _conversation(
    driver: TimedDriver, plan: MultiTurnPlan, words: WordSource, prompts: PromptSource,
    log: Callable[[str], None], *, system: str = SYSTEM_PROMPT, session: str = SESSION_ID,
) -> tuple[list[TurnRow], int]:  # fmt: skip
    """The turns, each beside its cold-new request; returns the rows and the last prompt's length."""
    frontend = driver.engine.frontend
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    previous: tuple[Sequence[int], Sequence[int]] | None = None
    rows = []
    last = 0
    for k in range(1, plan.turns + 1):
        messages.append({"role": "user", "content": words.text(plan.turn_tokens)})
        prompt = frontend.prepare_chat(messages, **TEMPLATE_KWARGS)  # type: ignore[attr-defined]
        ids = list(prompt.token_ids)
        expected = 0 if previous is None else reuse_lower_bound(previous[0], previous[1], ids)
        log(f"turn {k}/{plan.turns}: {len(ids)} prompt tokens, >= {expected} to reuse")
        turn = driver.timed(
            GenerationRequest(
                messages=list(messages),
                chat_template_kwargs=dict(TEMPLATE_KWARGS),
                max_tokens=plan.reply_tokens,
                temperature=0.0,
                ignore_eos=True,
                session_id=session,
            )  # fmt: skip
        )
        if turn.prompt_tokens != len(ids):
            raise BenchError(
                f"turn {k}: the Engine's prompt has {turn.prompt_tokens} tokens, {len(ids)} expected"
            )
        reply: dict[str, Any] = {"role": "assistant", "content": turn.result.text}
        if turn.result.reasoning_text:
            reply["reasoning_content"] = turn.result.reasoning_text
        messages.append(reply)
        previous = (ids, tuple(getattr(prompt, "boundaries", ())))
        cold = driver.timed(
            GenerationRequest(
                prompt=prompts.take(turn.prompt_tokens - turn.reused_tokens),
                max_tokens=2,
                temperature=0.0,
                ignore_eos=True,
                prefix_cache=False,
            )  # fmt: skip
        )
        rows.append(
            TurnRow(
                turn=k,
                prompt_tokens=turn.prompt_tokens,
                reused_tokens=turn.reused_tokens,
                expected_reused_min=expected,
                ttft_ms=turn.ttft_s * 1e3,
                submit_ms=turn.submit_s * 1e3,
                prefill_ms=turn.prefill_s * 1e3,
                cold_tokens=cold.prompt_tokens,
                cold_reused_tokens=cold.reused_tokens,
                cold_ttft_ms=cold.ttft_s * 1e3,
                cold_submit_ms=cold.submit_s * 1e3,
                cold_prefill_ms=cold.prefill_s * 1e3,
            )  # fmt: skip
        )
        last = turn.prompt_tokens + plan.reply_tokens
    return rows, last


def _with_cache(
    started: Any, plan: MultiTurnPlan, config: EngineConfig, prompts: PromptSource, bandwidth: float,
    log: Callable[[str], None],
) -> tuple[list[TurnRow], CacheRow, DecodeRow, CaptureRow]:  # fmt: skip
    """Everything measured on the cache-on Engine; returns holding no reference to it (its Program must
    go before the cache-off one is built)."""
    engine, program, variant = started.engine, started.program, started.package.variant
    clock = TransitionClock(program, started.device)
    try:
        frontend: Any = engine.frontend
        words = WordSource(frontend.encode, frontend.decode, first_special_id(variant.special), prompts.seed)
        driver = TimedDriver(engine, plan.decode_plan, prompts)
        log(f"warm-up: a {plan.turn_tokens}-token cold prompt and a short chat, both outside the cache")
        driver.timed(
            GenerationRequest(
                prompt=prompts.take(plan.turn_tokens), max_tokens=2, temperature=0.0, ignore_eos=True,
                prefix_cache=False,
            )
        )  # fmt: skip
        driver.timed(
            GenerationRequest(
                messages=[{"role": "user", "content": words.text(16)}],
                chat_template_kwargs=dict(TEMPLATE_KWARGS), max_tokens=2, temperature=0.0, ignore_eos=True,
                prefix_cache=False,
            )
        )  # fmt: skip
        # one untimed conversation of the same shape first (its own system prompt, words and session), so
        # the timed turns' prefill units meet compiled kernels as a serving Engine's would; then a reset
        log(f"warm-up: a whole {plan.turns}-turn conversation, then the cache reset")
        _conversation(driver, plan, words, prompts, lambda _: None, system=WARMUP_SYSTEM_PROMPT,
                      session=f"{SESSION_ID}-warmup")  # fmt: skip
        engine.reset_cache()
        before = engine.cache_stats()
        clock.clear()
        turns, last_tokens = _conversation(driver, plan, words, prompts, log)
        stats = engine.cache_stats()
        slots, budget, source = _cache_budget(program, config)
        cache = CacheRow(
            checkpoints=stats.checkpoints, checkpoint_bytes=stats.checkpoint_bytes,
            hits=stats.hits - before.hits, hit_tokens=stats.hit_tokens - before.hit_tokens,
            captures=stats.captures - before.captures, retains=stats.retains - before.retains,
            evictions=stats.evictions - before.evictions, checkpoint_slots=slots, budget_bytes=budget,
            budget_source=source, conversation_bytes=_conversation_bytes(program, last_tokens),
        )  # fmt: skip
        log(f"decode B=1 at context {plan.context}, cache on: {plan.decode_steps} timed rounds")
        decode_on = _decode_row(engine, plan.decode_plan, prompts, variant, started.dtype, bandwidth)
        capture = CaptureRow(
            captures=len(clock.device_ms("capture")), device_ms=tuple(clock.device_ms("capture")),
            host_ms=tuple(clock.host_ms("capture")), retains=stats.retains - before.retains,
            retain_host_ms=tuple(clock.host_ms("retain")),
            timing="cuda events" if started.device.type == "cuda" else "host (cpu)",
        )  # fmt: skip
    finally:
        clock.remove()
    return turns, cache, decode_on, capture


def run_multi_turn(
    options: BenchOptions, plan: MultiTurnPlan, log: Callable[[str], None] = lambda _: None
) -> MultiTurnReport:
    package, _ = options_package(options)
    variant = package.variant
    if plan.max_context > variant.max_position_embeddings:
        raise ValueError(
            f"the conversation needs up to {plan.max_context} positions ({plan.turns} turns of "
            f"{plan.turn_tokens} tokens + replies) but the model holds {variant.max_position_embeddings}; "
            "lower --multi-turn or --turn-tokens"
        )
    config = multi_turn_config(options, plan)
    probe, started = probe_and_start(options, config, log)
    header = run_header(started, probe)
    bandwidth = probe.bandwidth_bytes_per_s
    prompts = PromptSource(first_special_id(variant.special), options.seed)
    try:
        turns, cache, decode_on, capture = _with_cache(started, plan, config, prompts, bandwidth, log)
    except BaseException:
        started.engine.close()
        raise
    log("a second Engine over the same weights with the context cache off")
    off = restart(started, replace(config, prefix_cache=False, cache_memory_gb=None))
    try:
        log(f"decode B=1 at context {plan.context}, cache off: {plan.decode_steps} timed rounds")
        decode_off = _decode_row(off.engine, plan.decode_plan, prompts, variant, off.dtype, bandwidth)
        if off.engine.cache_stats().enabled:
            raise BenchError("the cache-off Engine has its context cache on")
    finally:
        off.engine.close()
    settings = {
        "turns": plan.turns,
        "turn_tokens": plan.turn_tokens,
        "reply_tokens": plan.reply_tokens,
        "context": plan.context,
        "decode_steps": plan.decode_steps,
        "prefill_chunk": plan.prefill_chunk,
        "max_context": config.max_context,
        "capture_interval": config.capture_interval,
        "cache_memory_gb": config.cache_memory_gb,
        "session_id": SESSION_ID,
        "chat_template_kwargs": dict(TEMPLATE_KWARGS),
        "cuda_graphs": options.cuda_graphs and started.device.type == "cuda",
        "kernels": resolve_kernels(started.device, options.kernels),
        "seed": options.seed,
    }
    return MultiTurnReport(header, tuple(turns), decode_on, decode_off, capture, cache, settings, ASSUMPTIONS)
