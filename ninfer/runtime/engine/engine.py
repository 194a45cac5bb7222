"""The public Engine facade and GenerationHandle.

``Engine(artifact_path, config)`` opens the exact target package through ``ninfer.targets.open_target``
(imported lazily, so this module stays free of torch and targets), then starts the worker. Tests and
embedders that bring their own Program and Frontend use ``Engine.from_parts``.

Generation requests are validated and prepared on the caller's thread (Frontend tokenization and chat
template), then handed to the worker through a bounded ingress. Everything after that happens on the
worker; the caller holds a ``GenerationHandle``.

At interpreter exit an ``atexit`` hook closes every Engine whose worker still runs and joins it: a
daemon worker killed inside torch during interpreter teardown can abort the process ("terminate
called without an active exception").
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from types import TracebackType

from ninfer.runtime.contract.constraint import ConstraintInvalid
from ninfer.runtime.contract.frontend import (
    FrontendLike,
    OutputOptions,
    OutputSessionLike,
    PreparedPromptLike,
)
from ninfer.runtime.contract.types import LogprobParams, Program, RequestPlan, SamplingParams, ScoringProgram
from ninfer.runtime.engine.context_cache import CacheStats
from ninfer.runtime.engine.engine_core import EngineCore
from ninfer.runtime.engine.request_record import ResponseChannel
from ninfer.runtime.scoring.core import CausalScoreCore
from ninfer.types import (
    MAX_TOP_LOGPROBS,
    NEUTRAL_SAMPLING,
    Availability,
    EngineConfig,
    EngineFailed,
    GenerationEvent,
    GenerationRequest,
    GenerationResult,
    RequestRejected,
    ScoreResult,
    default_decode_gap_ms,
    default_prefill_chunk,
    resolve_sampling,
    sampling_problems,
)

WARMUP_PROMPT = "Hello"
WARMUP_MAX_TOKENS = 2
CLOSE_JOIN_S = 30.0  # how long close() (and the exit hook) waits for the worker to finish its unit


@dataclasses.dataclass(frozen=True)
class EngineCapacity:
    """What a generation Engine can hold, fixed at start (docs/resources-and-context-cache.md, "Sizing").

    The KV pool is shared by every active request and the context cache's checkpoints; ``max_concurrency``
    bounds the active requests and does not split it. A request reserves its complete growth (prompt +
    max_tokens) at admission and waits while the pool is held by others."""

    max_context: int  # longest prompt + generated tokens of one request
    max_concurrency: int
    kv_pool_tokens: int  # positions the shared KV pool holds (pages x page size)
    kv_pool_bytes: int  # device bytes of the pool (0 when the Program does not say)
    page_size: int
    gpu_memory_fraction: float | None  # the share of the device memory the pool was sized under (None: CPU)
    memory_plan: str  # one line: how the memory was divided ("" when the Program does not say)

    def describe(self) -> str:
        """One line for a start-up message."""
        if self.memory_plan:
            return self.memory_plan
        return (
            f"KV pool {self.kv_pool_tokens:,} tokens, max_context {self.max_context:,}, up to "
            f"{self.max_concurrency} requests at once"
        )


class GenerationHandle:
    """The caller's side of one request: iterate events (sync or async, same queue), ``result()``,
    ``cancel()``. Closing it, leaving its ``with`` block, or dropping it (garbage collection) releases
    the consumer side and cancels the request if it is still running."""

    def __init__(self, channel: ResponseChannel) -> None:
        self._channel = channel
        self.request_id = channel.request_id
        # the finalizer holds the channel, never the handle, so the handle can be collected; it may run
        # on any thread inside any lock, so it only signals the worker (which then releases)
        self._dropped = weakref.finalize(self, channel.signal_dropped)

    # ---- events ----
    def __iter__(self) -> Iterator[GenerationEvent]:
        return self

    def __next__(self) -> GenerationEvent:
        event = self._channel.get()
        if event is None:
            raise StopIteration
        return event

    def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        return self

    async def __anext__(self) -> GenerationEvent:
        event = await self._channel.aget()
        if event is None:
            raise StopAsyncIteration
        return event

    # ---- result ----
    def result(self, timeout: float | None = None, *, raise_on_error: bool = True) -> GenerationResult:
        """Wait for the terminal result (consuming remaining events). With ``raise_on_error`` an
        ``error`` result raises its ``RequestRejected``/``EngineFailed`` instead of returning."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            event = self._channel.get(remaining)  # None: the final result was already taken
            if event is None or isinstance(event, GenerationResult):
                break
        final = self._channel.final
        assert final is not None
        if raise_on_error and final.error is not None:
            raise final.error
        return final

    async def aresult(self, *, raise_on_error: bool = True) -> GenerationResult:
        async for _ in self:
            pass
        final = self._channel.final
        assert final is not None
        if raise_on_error and final.error is not None:
            raise final.error
        return final

    @property
    def done(self) -> bool:
        """The worker formed the final result (it may not have been consumed yet)."""
        return self._channel.response_done

    # ---- consumer release ----
    def cancel(self) -> None:
        """Ask the worker to stop this request at its next boundary (finish_reason ``cancelled``)."""
        self._channel.cancel()

    def close(self) -> None:
        """Release the consumer side (cancels the request if it is still running). Idempotent."""
        if self._dropped.detach() is not None:  # the first close; ordinary code, so locks are fine
            self._channel.abandon()

    def __enter__(self) -> GenerationHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Engine:
    """One resident model behind one worker: submit generation requests, or score texts.

    The purpose (``EngineConfig.purpose``) is fixed at construction. ``availability`` says whether the
    Engine is starting, warming, ready, failed (with the reason) or closed.
    """

    def __init__(self, artifact_path: str | os.PathLike[str], config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        from ninfer.targets import open_target  # lazy: the only place the Engine meets a target

        opened = open_target(artifact_path, config)
        self._setup(opened.program, opened.frontend, config, opened.package_name, None, True)

    @classmethod
    def from_parts(
        cls,
        program: Program | ScoringProgram,
        frontend: FrontendLike,
        config: EngineConfig | None = None,
        *,
        package_name: str = "",
        clock: Callable[[], float] | None = None,
        start_worker: bool = True,
    ) -> Engine:
        """Build an Engine around an existing Program and Frontend (tests, embedding).

        With ``start_worker=False`` no thread runs: the caller drives ``engine.core.step()`` itself,
        which makes schedules deterministic; warmup is then skipped.
        """
        engine = cls.__new__(cls)
        engine._setup(program, frontend, config or EngineConfig(), package_name, clock, start_worker)
        return engine

    def _setup(
        self,
        program: Program | ScoringProgram,
        frontend: FrontendLike,
        config: EngineConfig,
        package_name: str,
        clock: Callable[[], float] | None,
        start_worker: bool,
    ) -> None:
        table = getattr(getattr(program, "kernels", None), "name", "reference")
        if config.prefill_chunk_tokens is None:  # the defaults of the op table the Program runs
            config = dataclasses.replace(config, prefill_chunk_tokens=default_prefill_chunk(table))
        if config.max_decode_gap_ms is None:
            config = dataclasses.replace(config, max_decode_gap_ms=default_decode_gap_ms(table))
        self.config = config
        self.package_name = package_name
        self._frontend = frontend
        self._core: EngineCore | None = None
        self._scorer: CausalScoreCore | None = None
        self._score_lock = threading.Lock()
        self._scoring_availability = Availability("starting")
        program_context = program.max_context
        if config.max_context is not None and config.max_context > program_context:
            raise ValueError(
                f"max_context={config.max_context} exceeds what the Program holds ({program_context})"
            )
        self.max_context = config.max_context or program_context
        if config.purpose == "causal_scoring":
            if not isinstance(program, ScoringProgram):
                raise TypeError("a causal_scoring Engine needs a Program with score_window()")
            self._scorer = CausalScoreCore(program, config.score_window, config.score_stride)
            self._scoring_availability = Availability("ready")
            return
        if not isinstance(program, Program):
            raise TypeError("a generation Engine needs a Program implementing the runtime contract")
        core = EngineCore(program, config, max_context=self.max_context, clock=clock or time.monotonic)
        self._core = core
        if not start_worker:
            core.set_availability("ready")
            return
        core.start_thread()
        _RUNNING_CORES.add(core)
        if config.warmup:
            core.set_availability("warming")
            for request in self._warmup_requests(table, core.pacer.sizes):
                with self.submit(request) as handle:
                    handle.result(raise_on_error=False)
        core.set_availability("ready")

    def _warmup_requests(self, table: str, unit_sizes: Sequence[int]) -> list[GenerationRequest]:
        """What the Engine runs before it is ready, through the same public path as any request, with
        the context cache off (it leaves no checkpoint): a short prompt, and with the fast op table one
        prompt of each prefill unit size the Scheduler and the prefill pacer cut (`PrefillPacer.sizes`)
        that fits ``max_context``. Triton compiles a kernel for each shape class it meets, seconds to a
        minute on a cold cache, and would otherwise do it inside the first requests of each size."""
        requests = [
            GenerationRequest(
                prompt=WARMUP_PROMPT, max_tokens=WARMUP_MAX_TOKENS, temperature=0.0, prefix_cache=False
            )
        ]
        if table != "fast":
            return requests
        word = self._frontend.prepare_text(WARMUP_PROMPT).token_ids[0]
        for size in unit_sizes:
            if size + WARMUP_MAX_TOKENS <= self.max_context:
                requests.append(
                    GenerationRequest(
                        prompt=[word] * size, max_tokens=WARMUP_MAX_TOKENS, temperature=0.0, ignore_eos=True,
                        prefix_cache=False,
                    )  # fmt: skip
                )
        return requests

    # ---- state ----
    @property
    def frontend(self) -> FrontendLike:
        """The package's Frontend (tokenizer, chat template, generation defaults), for gateways."""
        return self._frontend

    @property
    def availability(self) -> Availability:
        if self._core is None:
            return self._scoring_availability
        return self._core.availability

    @property
    def core(self) -> EngineCore:
        """The worker core (tests drive ``step()`` on it when built with ``start_worker=False``)."""
        if self._core is None:
            raise RequestRejected("wrong_purpose", "a causal_scoring Engine has no generation worker")
        return self._core

    def observe_units(self, observer: Callable[[str, int], None] | None) -> None:
        """Call ``observer(kind, rows)`` on the worker just before each execution unit runs (``kind``:
        ``prefill``, ``control`` or ``decode``; ``rows``: its requests), or stop with ``None``. It runs
        on the worker thread between units: keep it to a few appends (the bench's clock)."""
        core = self.core
        core.observer = (
            None if observer is None else (lambda _, unit: observer(unit.kind.value, len(unit.members)))
        )

    def capacity(self) -> EngineCapacity:
        """The KV pool and the context limit a generation Engine was sized with (read-only)."""
        cap = self.core.program.capacity()
        return EngineCapacity(
            max_context=self.max_context,
            max_concurrency=self.config.max_concurrency,
            kv_pool_tokens=cap.kv_pages * cap.page_size,
            kv_pool_bytes=cap.kv_pages * cap.kv_page_bytes,
            page_size=cap.page_size,
            gpu_memory_fraction=cap.gpu_memory_fraction,
            memory_plan=cap.memory_plan,
        )

    def kv_cache_usage(self) -> float | None:
        """The fraction of the KV pool's pages held (by requests or cached checkpoints), from any thread;
        None for a Program that does not count its free pages or an Engine without a generation core."""
        if self._core is None:
            return None
        free = getattr(self._core.program, "kv_pages_free", None)
        pages = self._core.program.capacity().kv_pages
        return None if free is None or not pages else 1.0 - free / pages

    # ---- the context cache ----
    def cache_stats(self) -> CacheStats:
        """The context cache's counters (checkpoints held, hits, prompt tokens not prefilled, ...)."""
        return self.core.resources.cache.stats

    def reset_cache(self, timeout: float | None = 30.0) -> int:
        """Drop every inactive checkpoint (requests in flight keep theirs until they end); returns how
        many were dropped. Waits for the worker to carry it out at its next boundary."""
        return self.core.request_cache_reset().wait(timeout)

    # ---- generation ----
    def submit(self, request: GenerationRequest) -> GenerationHandle:
        """Validate, prepare and enqueue a request. Raises ``RequestRejected`` at once for an invalid or
        too-long request or a full queue, ``EngineFailed`` after an Engine failure."""
        if self._core is None:
            raise RequestRejected(
                "wrong_purpose",
                "this Engine was started for causal_scoring; use Engine.score(), or start an Engine with "
                "purpose='generation' to generate",
            )
        problems = request.problems()
        if problems:
            raise RequestRejected("invalid_request", "; ".join(problems))
        prompt = self._prepare(request)
        plan = self._plan(request, prompt)
        session = self._output_session(request, prompt)
        channel = self._core.submit(
            prompt, session, plan, session_id=request.session_id, prefix_cache=request.prefix_cache
        )
        return GenerationHandle(channel)

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> GenerationResult:
        """Submit and wait; raises the request's error if it ends with one."""
        with self.submit(request) as handle:
            return handle.result(timeout)

    def _prepare(self, request: GenerationRequest) -> PreparedPromptLike:
        try:
            if request.messages is not None:
                return self._frontend.prepare_chat(
                    request.messages, tools=request.tools, **dict(request.chat_template_kwargs)
                )
            if isinstance(request.prompt, str):
                return self._frontend.prepare_text(request.prompt)
            assert request.prompt is not None
            return self._frontend.prepare_tokens(list(request.prompt))
        except (ValueError, TypeError, KeyError) as exc:
            raise RequestRejected("invalid_request", f"the prompt cannot be prepared: {exc}") from exc

    def _plan(self, request: GenerationRequest, prompt: PreparedPromptLike) -> RequestPlan:
        n = len(prompt.token_ids)
        ctx = self.max_context
        if n == 0:
            raise RequestRejected("invalid_request", "the prepared prompt has no tokens; give some input")
        if n >= ctx:
            raise RequestRejected(
                "context_too_long",
                f"the prompt has {n} tokens but max_context is {ctx} (prompt plus at least one generated "
                "token); shorten the prompt or start the Engine with a larger max_context",
            )
        max_new = request.max_tokens if request.max_tokens is not None else ctx - n
        if n + max_new > ctx:
            raise RequestRejected(
                "context_too_long",
                f"the prompt ({n} tokens) plus max_tokens ({max_new}) exceeds max_context ({ctx}); "
                f"lower max_tokens to at most {ctx - n} or shorten the prompt",
            )
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        return RequestPlan(
            prompt_token_ids=tuple(prompt.token_ids),
            max_new_tokens=max_new,
            sampling=self._sampling(request, seed),
            logprobs=LogprobParams(enabled=request.logprobs, top_n=request.top_logprobs),
            content_digest=prompt.digest,
            prepared_prompt=prompt,
            media=tuple(getattr(prompt, "media_spans", tuple)()),
        )

    def _sampling(self, request: GenerationRequest, seed: int) -> SamplingParams:
        """The request's sampling with the fields it left ``None`` taken from the model's generation
        config (``resolve_sampling``): the one place model defaults are applied, for every gateway."""
        given = {name: getattr(request, name) for name in NEUTRAL_SAMPLING}
        resolved = resolve_sampling(self._frontend.generation_defaults, **given)
        problems = sampling_problems(resolved)  # the request's own values passed problems(): the model's
        if problems:
            raise RequestRejected(
                "invalid_request",
                f"the model's generation config has invalid sampling defaults ({'; '.join(problems)}); "
                "give these fields in the request",
            )
        bias, held = self._bias(request)
        return SamplingParams(
            seed=seed,
            logit_bias=bias,
            min_tokens=request.min_tokens if held else 0,
            min_tokens_ids=held,
            temperature=float(resolved["temperature"]),
            top_p=float(resolved["top_p"]),
            top_k=max(0, resolved["top_k"]),
            min_p=float(resolved["min_p"]),
            presence_penalty=float(resolved["presence_penalty"]),
            frequency_penalty=float(resolved["frequency_penalty"]),
            repetition_penalty=float(resolved["repetition_penalty"]),
        )

    def _bias(self, request: GenerationRequest) -> tuple[tuple[tuple[int, float], ...], tuple[int, ...]]:
        """The request's logit bias as sorted (id, bias) pairs, checked against the vocabulary, and the
        ids ``min_tokens`` holds back: end-of-sequence (unless ``ignore_eos``) and ``stop_token_ids``."""
        if not request.logit_bias and not request.min_tokens:
            return (), ()
        vocab = int(getattr(self._frontend, "vocab_size", 0)) or None
        bias = tuple(sorted((int(t), float(v)) for t, v in (request.logit_bias or {}).items()))
        outside = [t for t, _ in bias if vocab is not None and t >= vocab]
        if outside:
            raise RequestRejected(
                "invalid_request", f"logit_bias: token id {outside[0]} is outside the vocabulary [0, {vocab})"
            )
        held: tuple[int, ...] = ()
        if request.min_tokens:
            eos = () if request.ignore_eos else tuple(getattr(self._frontend, "eos_token_ids", ()))
            held = tuple(sorted({t for t in (*eos, *request.stop_token_ids) if vocab is None or t < vocab}))
        return bias, held

    def _output_session(self, request: GenerationRequest, prompt: PreparedPromptLike) -> OutputSessionLike:
        """The request's OutputSession; a constraint is compiled here, once (a bad one is refused)."""
        try:
            session = self._frontend.new_output_session(prompt, self._output_options(request))
        except ConstraintInvalid as exc:
            raise RequestRejected("invalid_request", str(exc)) from exc
        constraint = request.constraint
        if constraint is not None and getattr(session, "constraint", None) is None:
            raise RequestRejected(
                "invalid_request",
                f"{constraint.field_name}: this model's Frontend does not do structured outputs; drop the "
                "constraint",
            )
        return session

    @staticmethod
    def _output_options(request: GenerationRequest) -> OutputOptions:
        """The request's output options; channel and tool-call parsing are the Frontend's to decide."""
        return OutputOptions(
            stop_strings=request.stop_strings(),
            stop_token_ids=tuple(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            include_stop_str=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            thinking_budget=request.thinking_budget,
            constraint=request.constraint,
        )

    # ---- scoring ----
    def score(
        self, texts: Sequence[str | Sequence[int]], *, top_n: int = 0, next_token: bool = False
    ) -> list[ScoreResult]:
        """Causal log-probabilities of each text (or token-id list), windowed as in EngineConfig.

        ``top_n`` (0..20) adds each position's most likely tokens (``ScoreResult.top_logprobs``);
        ``next_token`` adds the greedy prediction after the last token (``ScoreResult.next_token``).
        """
        if self._scorer is None:
            raise RequestRejected(
                "wrong_purpose",
                "this Engine was started for generation; start one with purpose='causal_scoring' to score",
            )
        if not 0 <= top_n <= MAX_TOP_LOGPROBS:
            raise RequestRejected("invalid_request", f"top_n must be 0..{MAX_TOP_LOGPROBS}, got {top_n}")
        with self._score_lock:
            availability = self._scoring_availability
            if availability.state == "closed":
                raise EngineFailed("the Engine is closed and scores no more texts; start a new Engine")
            if availability.state != "ready":
                raise EngineFailed(f"the Engine failed and scores no more texts: {availability.reason}")
            out: list[ScoreResult] = []
            for text in texts:
                try:
                    ids = (
                        self._frontend.prepare_text(text).token_ids
                        if isinstance(text, str)
                        else self._frontend.prepare_tokens(list(text)).token_ids
                    )
                except (ValueError, TypeError, KeyError) as exc:
                    raise RequestRejected("invalid_request", f"text cannot be tokenized: {exc}") from exc
                try:
                    out.append(self._scorer.score(ids, top_n=top_n, next_token=next_token))
                except Exception as exc:
                    reason = f"{type(exc).__name__}: {exc}"
                    self._scoring_availability = Availability("failed", reason)
                    raise EngineFailed(f"the Engine failed while scoring: {reason}") from exc
            return out

    # ---- lifecycle ----
    def close(self, timeout: float = CLOSE_JOIN_S) -> None:
        """Stop accepting requests, cancel outstanding ones and join the worker. Idempotent."""
        if self._core is None:
            self._scoring_availability = Availability("closed")
            return
        _close_core(self._core, timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# workers that were started and may still run; weak, so an Engine (and its core) can still be collected
# once its worker has exited
_RUNNING_CORES: weakref.WeakSet[EngineCore] = weakref.WeakSet()


def _close_core(core: EngineCore, timeout: float) -> None:
    """Close the core, join its worker, then settle handles dropped after the worker's last boundary."""
    core.close()
    thread = core.thread
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)
    if thread is None or not thread.is_alive():
        core.settle_dropped_handles()


def _close_running_engines() -> None:
    """atexit: close every Engine whose worker still runs, so no daemon worker is inside the Program
    when the interpreter tears down (a dropped Engine counts too: its running worker keeps the core)."""
    for core in list(_RUNNING_CORES):
        thread = core.thread
        if thread is not None and thread.is_alive():
            _close_core(core, CLOSE_JOIN_S)


atexit.register(_close_running_engines)
