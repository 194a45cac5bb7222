"""The Engine's any-thread side: submission, outstanding capacity, availability and worker signals.

Gateways and consumers reach the worker only through this object (a bounded ingress queue guarded by one
lock), the per-request `ResponseChannel` and the worker's signal queue: a ``queue.SimpleQueue`` of
wake-ups (``None``) and the request ids of dropped handles, the one primitive a garbage-collector
finalizer may touch on any thread without risking a deadlock. Nothing here reaches the Program.

Outstanding capacity is taken at submit and released exactly once per request, by whichever thread
sets the second of its channel's ``response_done`` and ``consumer_released`` (`ResponseChannel`).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable

from ninfer.runtime.contract.frontend import OutputSessionLike, PreparedPromptLike
from ninfer.runtime.contract.types import RequestPlan
from ninfer.runtime.engine.constraints import row_guard
from ninfer.runtime.engine.request_record import RequestRecord, ResponseChannel
from ninfer.types import Availability, EngineConfig, EngineFailed, RequestRejected


class CacheReset:
    """A cache reset asked for on any thread and carried out by the worker: ``wait`` returns how many
    checkpoints it dropped."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.dropped = 0

    def done(self, dropped: int) -> None:
        self.dropped = dropped
        self._event.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._event.wait(timeout):
            raise TimeoutError("the Engine worker did not reach a boundary to reset the cache in time")
        return self.dropped


class Ingress:
    """Submission, capacity and availability, shared by every thread (guarded by ``lock``)."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float]) -> None:
        self._config = config
        self._clock = clock
        self.lock = threading.Lock()
        # wake-ups (None) and dropped handles' request ids; lock-free, so finalizers may put into it
        self.signals: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._arrivals: deque[RequestRecord] = deque()
        self._channels: dict[int, ResponseChannel] = {}
        self._outstanding = 0
        self._capacity_limit = config.max_concurrency + config.queue_capacity
        self._next_order = 1
        self.failed_reason: str | None = None  # set once, by the worker (`fail`)
        self.closing = False
        self._availability = Availability("starting")
        self._cache_resets: list[CacheReset] = []

    # ---- facts any thread reads ----
    @property
    def availability(self) -> Availability:
        with self.lock:
            return self._availability

    def set_availability(self, state: str, reason: str | None = None) -> None:
        """Lifecycle transitions driven by the facade (warming, ready); a failure is never overwritten."""
        with self.lock:
            if self._availability.state not in ("failed", "closed"):
                self._availability = Availability(state, reason)  # type: ignore[arg-type]

    @property
    def outstanding(self) -> int:
        with self.lock:
            return self._outstanding

    @property
    def failed(self) -> bool:
        with self.lock:
            return self.failed_reason is not None

    @property
    def pending(self) -> bool:
        """Submissions the worker has not taken yet (an unlocked peek: see `take`)."""
        return bool(self._arrivals)

    # ---- any thread ----
    def submit(
        self,
        prompt: PreparedPromptLike,
        session: OutputSessionLike,
        plan: RequestPlan,
        *,
        session_id: str | None = None,
        prefix_cache: bool = True,
    ) -> ResponseChannel:
        """Accept a prepared request into the bounded ingress, or reject it at once (overload/failure)."""
        with self.lock:
            if self.failed_reason is not None:
                raise EngineFailed(f"the Engine failed and accepts no requests: {self.failed_reason}")
            if self.closing:
                raise EngineFailed("the Engine is closed and accepts no requests")
            if self._outstanding >= self._capacity_limit:
                raise RequestRejected(
                    "overload",
                    f"the Engine is full: {self._outstanding} requests outstanding (max_concurrency "
                    f"{self._config.max_concurrency} + queue_capacity {self._config.queue_capacity}); "
                    "retry later, or start the Engine with a larger queue_capacity",
                )
            order = self._next_order
            self._next_order += 1
            self._outstanding += 1
            channel = ResponseChannel(order, self._release_capacity, self.signals)
            timeout = self._config.queue_timeout_s
            record = RequestRecord(
                request_id=order,
                publication_order=order,
                prompt=prompt,
                session=session,
                plan=plan,
                channel=channel,
                deadline=None if timeout is None else self._clock() + timeout,
                session_id=session_id,
                prefix_cache=prefix_cache,
                constraint=row_guard(session),
            )
            self._arrivals.append(record)
            self._channels[order] = channel
        self.signals.put(None)
        return channel

    def request_cache_reset(self) -> CacheReset:
        """Ask the worker to drop every inactive checkpoint at its next boundary."""
        reset = CacheReset()
        with self.lock:
            if self.failed_reason is not None or self.closing:
                reset.done(0)
                return reset
            self._cache_resets.append(reset)
        self.signals.put(None)
        return reset

    def take_cache_resets(self) -> list[CacheReset]:
        if not self._cache_resets:  # the unlocked peek, as in `take`
            return []
        with self.lock:
            resets, self._cache_resets = self._cache_resets, []
        return resets

    def _release_capacity(self, request_id: int) -> None:
        with self.lock:
            self._outstanding -= 1
            self._channels.pop(request_id, None)

    def close(self) -> None:
        """Stop accepting requests and cancel every outstanding one."""
        with self.lock:
            self.closing = True
            channels = list(self._channels.values())
        self.signals.put(None)
        for channel in channels:
            channel.cancel()

    # ---- the worker (or Engine.close once the worker is gone) ----
    def take(self) -> list[RequestRecord]:
        """The submissions since the last call, in order. The unlocked peek first: submit appends under
        the lock and signals after it, so a request the peek misses still has its signal queued."""
        if not self._arrivals:
            return []
        with self.lock:
            arrived = list(self._arrivals)
            self._arrivals.clear()
        return arrived

    def settle_dropped_handles(self) -> tuple[bool, bool]:
        """Release the consumer side of every request whose handle was garbage-collected since the last
        call (the finalizer only queued its id). Returns (any signal was taken, any handle was dropped):
        any signal may be a cancellation's (cancel and abandon put one after setting the flag)."""
        dropped: list[int] = []
        signalled = False
        # empty() first: a boundary with no signal (steady decode) takes no exception path
        while not self.signals.empty():
            try:
                signal = self.signals.get_nowait()
            except queue.Empty:  # only if another thread took it meanwhile (the worker is the consumer)
                break
            signalled = True
            if signal is not None:
                dropped.append(signal)
        for request_id in dropped:
            with self.lock:
                channel = self._channels.get(request_id)
            if channel is not None:  # None: its capacity was already released
                channel.abandon(wake_worker=False)
        return signalled, bool(dropped)

    def sleep(self, timeout: float | None) -> None:
        """Wait for a signal (submit, cancel, close, a dropped handle) or the timeout. A signal that
        arrived after the last `settle_dropped_handles` is already queued, so no wake-up is lost; the one
        taken here is put back for the next boundary to handle."""
        try:
            signal = self.signals.get(timeout=timeout)
        except queue.Empty:
            return
        self.signals.put(signal)

    def idle(self, worker_holds_requests: bool) -> bool:
        with self.lock:
            return not worker_holds_requests and not self._arrivals and self.signals.empty()

    def finished_closing(self, worker_holds_requests: bool) -> bool:
        """Closed with nothing left: availability becomes ``closed`` (the worker then exits)."""
        with self.lock:
            if not self.closing or worker_holds_requests or self._arrivals:
                return False
            self._availability = Availability("closed")
            resets, self._cache_resets = self._cache_resets, []
        for reset in resets:
            reset.done(0)
        return True

    def fail(self, reason: str) -> list[RequestRecord] | None:
        """Mark the Engine failed (once): later submits raise, availability says why. Returns the
        submissions the worker never took (they end with the failure too), or None if already failed."""
        with self.lock:
            if self.failed_reason is not None:
                return None
            self.failed_reason = reason
            self._availability = Availability("failed", reason)
            arrived = list(self._arrivals)
            self._arrivals.clear()
        return arrived
