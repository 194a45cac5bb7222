"""Request states, the worker-owned request record and the thread-shared response channel.

The record is touched only by the Engine worker. The channel is the one object consumer threads share
with the worker: an event queue, the cancellation flag and the two facts that release outstanding
capacity (``response_done`` and ``consumer_released``), each guarded by the channel's lock.

A handle collected by the garbage collector may be finalized on any thread at any allocation, also
inside a ``with`` block of one of these locks, and none of them is reentrant. So the finalizer only
puts the request id on the Engine's ``SimpleQueue`` of worker signals (``signal_dropped``); the worker
performs the consumer release at its next boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ninfer.runtime.contract.frontend import OutputSessionLike, PreparedPromptLike
from ninfer.runtime.contract.types import RequestPlan, RunningTransaction, SequenceHandle, TokenLogprob
from ninfer.runtime.engine.constraints import RowGuard
from ninfer.types import (
    FinishReason,
    GenerationDelta,
    GenerationEvent,
    GenerationResult,
    GenerationStart,
    NInferError,
    ToolCallDelta,
    Usage,
)


class RequestState(enum.Enum):
    """Stable request states (spec: Waiting -> Materializing -> Prefill -> DecodeReady | ControlReady
    -> TerminalPending -> Finished)."""

    WAITING = "waiting"  # owning prompt and output session only; no Program state
    MATERIALIZING = "materializing"  # a resource transaction holds the claim
    PREFILL = "prefill"  # Active, consuming the prompt suffix (the one staged prefill)
    DECODE_READY = "decode_ready"  # Active, joins the next compact decode round
    CONTROL_READY = "control_ready"  # Active, the Frontend asked for forced-control tokens
    TERMINAL_PENDING = "terminal_pending"  # model execution ended; active resources not yet released
    FINISHED = "finished"  # resources and output committed; the response is complete


ACTIVE_STATES = frozenset({RequestState.PREFILL, RequestState.DECODE_READY, RequestState.CONTROL_READY})


class ResponseChannel:
    """Thread-shared side of one request: events out, cancellation in, capacity release exactly once.

    ``release_capacity`` fires once, on whichever thread sets the second of ``response_done`` and
    ``consumer_released`` (never inside a finalizer: see ``signal_dropped``). Consumers never reach the
    Program through this object: ``cancel`` and ``abandon`` only set flags and wake the worker.

    ``signals`` is the worker's wake-up queue: ``None`` wakes it, a request id says that request's
    handle was dropped.
    """

    def __init__(
        self,
        request_id: int,
        release_capacity: Callable[[int], None],
        signals: queue.SimpleQueue[int | None],
    ) -> None:
        self.request_id = request_id
        self._release_capacity = release_capacity
        self._signals = signals
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._events: deque[GenerationEvent] = deque()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        # set under the lock by consumer threads; the worker reads it at its boundaries and for every row
        # of every unit, so it is a plain attribute rather than a property (a bool read needs no lock).
        # Only cancel() and abandon() may set it: they also put the worker signal without which the
        # worker's cancellation snapshot does not look (EngineCore.snapshot_due)
        self.cancel_requested = False
        self._response_done = False
        self._consumer_released = False
        self._final_taken = False
        self.final: GenerationResult | None = None
        self.capacity_release_count = 0  # observable for tests: must end at exactly 1

    # ---- flags (read by the worker at its boundaries) ----
    @property
    def response_done(self) -> bool:
        return self._response_done

    @property
    def consumer_released(self) -> bool:
        return self._consumer_released

    # ---- worker side ----
    def publish(self, event: GenerationEvent) -> None:
        """Queue an event for the consumer; a ``GenerationResult`` is the last one and sets response_done."""
        with self._lock:
            if self._response_done:
                raise RuntimeError(f"request {self.request_id}: event after the terminal result")
            self._events.append(event)
            if isinstance(event, GenerationResult):
                self.final = event
                self._response_done = True
            self._ready.notify_all()
            waiters, self._async_waiters = self._async_waiters, []
            release = self._take_capacity_locked()
        for loop, fut in waiters:
            # a closed consumer loop raises RuntimeError: nobody waits there any more
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_wake_future, fut)
        if release:
            self._release_capacity(self.request_id)

    # ---- consumer side ----
    def cancel(self) -> None:
        with self._lock:
            if self._response_done:
                return
            self.cancel_requested = True
        self._signals.put(None)

    def abandon(self, *, wake_worker: bool = True) -> None:
        """The consumer let go (handle closed, or dropped and signalled): cancel if still running, and
        release. Takes locks: call it from ordinary code only, never from a finalizer."""
        with self._lock:
            if not self._response_done:
                self.cancel_requested = True
            self._consumer_released = True
            release = self._take_capacity_locked()
        if wake_worker:
            self._signals.put(None)
        if release:
            self._release_capacity(self.request_id)

    def signal_dropped(self) -> None:
        """The handle was garbage-collected. Runs as a weakref callback, possibly on a thread that holds
        the Engine's or this channel's lock, so it takes no lock: ``SimpleQueue.put`` is safe there. The
        worker calls ``abandon`` for this request at its next boundary."""
        self._signals.put(self.request_id)

    def get(self, timeout: float | None = None) -> GenerationEvent | None:
        """Next event, blocking; ``None`` once the terminal result was taken. Raises TimeoutError."""
        with self._lock:
            if (
                not self._events
                and not self._final_taken
                and not self._ready.wait_for(lambda: bool(self._events), timeout)
            ):
                raise TimeoutError(f"request {self.request_id}: no event within {timeout} s")
            event, release = self._pop_locked()
        if release:
            self._release_capacity(self.request_id)
        return event

    async def aget(self) -> GenerationEvent | None:
        """Async twin of ``get`` (same queue): waits without blocking the event loop."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._events or self._final_taken:
                    event, release = self._pop_locked()
                    break
                fut: asyncio.Future[None] = loop.create_future()
                self._async_waiters.append((loop, fut))
            await fut
        if release:
            self._release_capacity(self.request_id)
        return event

    def _pop_locked(self) -> tuple[GenerationEvent | None, bool]:
        """Pop the next event; taking the terminal result ends the consumer's wait (consumer_released).
        Returns whether this pop is the one that releases capacity (done outside the lock)."""
        if not self._events:
            return None, False
        event = self._events.popleft()
        release = False
        if isinstance(event, GenerationResult):
            self._final_taken = True
            self._consumer_released = True
            release = self._take_capacity_locked()
        return event, release

    def _take_capacity_locked(self) -> bool:
        if self._response_done and self._consumer_released and self.capacity_release_count == 0:
            self.capacity_release_count = 1
            return True
        return False


def _wake_future(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclass(eq=False)
class RequestRecord:
    """Everything the worker knows about one request. Owned and mutated by the worker thread only."""

    request_id: int
    publication_order: int  # monotonic at submit; later completions win SessionIndex bindings
    prompt: PreparedPromptLike
    session: OutputSessionLike
    plan: RequestPlan
    channel: ResponseChannel
    deadline: float | None  # admission deadline (monotonic clock); None = no queue timeout
    state: RequestState = RequestState.WAITING
    lane: int | None = None
    txn: RunningTransaction | None = None
    handle: SequenceHandle | None = None
    reused_prefix_tokens: int = 0
    prompt_remaining: int = 0  # prompt positions still to prefill once Active
    generated: int = 0  # committed output tokens (sampled and forced)
    pending_force: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    error: NInferError | None = None
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    output_touched: bool = False  # the OutputSession has committed something (finish() may flush)
    # a deferred OutputSession commit failed (Committer.publish_committed): the request ends with this
    # error at its next boundary or unit, as a cancelled row
    output_error: NInferError | None = None
    # context cache: the session key (a lookup hint), whether the request takes part at all, the prompt
    # positions still to capture at, and whether its committed output so far ends at a point the history
    # renderer reproduces (the Frontend's boundary at the end of its last committed span)
    # the Frontend's cap on the next decode unit's tokens (a thinking budget; None: none), from the
    # preview of the row's last committed span
    control_horizon: int | None = None
    # speculative decoding: drafts proposed for the request, those of them it kept, the units that
    # drafted, and per draft position how many of those units kept the draft there
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_rounds: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    session_id: str | None = None
    prefix_cache: bool = True
    capture_points: list[int] = field(default_factory=list)
    output_reproducible: bool = False
    # structured outputs: the guard over the session's grammar matcher (constraints.RowGuard), or None
    constraint: RowGuard | None = None

    def count_drafts(self, drafted: int, kept: int) -> None:
        """A committed unit proposed ``drafted`` drafts for the request and it kept the first ``kept``
        (a verify accepts a prefix of its drafts)."""
        if not drafted:
            return
        self.drafted_tokens += drafted
        self.accepted_draft_tokens += kept
        self.draft_rounds += 1
        if len(self.accepted_by_position) < kept:
            self.accepted_by_position.extend([0] * (kept - len(self.accepted_by_position)))
        for position in range(kept):
            self.accepted_by_position[position] += 1

    @property
    def remaining_budget(self) -> int:
        return self.plan.max_new_tokens - self.generated

    def start_event(self) -> GenerationStart:
        return GenerationStart(
            request_id=self.request_id,
            prompt_tokens=len(self.plan.prompt_token_ids),
            reused_prefix_tokens=self.reused_prefix_tokens,
        )

    def record_delta(self, delta: GenerationDelta) -> None:
        """Fold a published delta into the aggregate result."""
        if delta.text:
            self.text.append(delta.text)
        if delta.reasoning_text:
            self.reasoning.append(delta.reasoning_text)
        self.tool_calls.extend(delta.tool_calls)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None
        logprobs = (
            tuple(self.logprobs)
            if self.logprobs is not None
            else (() if self.plan.logprobs.enabled else None)
        )
        return GenerationResult(
            request_id=self.request_id,
            text="".join(self.text),
            reasoning_text="".join(self.reasoning),
            tool_calls=merge_tool_calls(self.tool_calls),
            token_ids=tuple(self.token_ids),
            finish_reason=self.finish_reason,
            usage=Usage(
                prompt_tokens=len(self.plan.prompt_token_ids),
                completion_tokens=self.generated,
                reused_prefix_tokens=self.reused_prefix_tokens,
                drafted_tokens=self.drafted_tokens,
                accepted_draft_tokens=self.accepted_draft_tokens,
                draft_rounds=self.draft_rounds,
                accepted_by_position=tuple(self.accepted_by_position),
            ),
            logprobs=logprobs,
            error=self.error,
        )


def merge_tool_calls(deltas: list[ToolCallDelta]) -> tuple[ToolCallDelta, ...]:
    """Aggregate streamed tool-call deltas per ``index``: first id/name win, arguments concatenate."""
    merged: dict[int, ToolCallDelta] = {}
    for d in deltas:
        prev = merged.get(d.index)
        if prev is None:
            merged[d.index] = ToolCallDelta(d.index, d.id, d.name, d.arguments)
        else:
            merged[d.index] = ToolCallDelta(
                d.index, prev.id or d.id, prev.name or d.name, prev.arguments + d.arguments
            )
    return tuple(merged[i] for i in sorted(merged))
