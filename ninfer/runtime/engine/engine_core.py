"""EngineCore: the one worker that owns request records, Scheduler, ResourceManager and the Program.

Other threads reach it only through ``submit`` (a bounded ingress), the per-request ``ResponseChannel``
(cancellation flag, events) and ``close``. ``step()`` runs one worker boundary; the threaded worker
just loops it, and tests call it directly for deterministic, reproducible schedules. The idle worker
sleeps on a ``queue.SimpleQueue`` of signals (wake-ups, and ids of dropped handles), the one primitive a
garbage-collector finalizer may touch on any thread without risking a deadlock.

One worker boundary, in this order (docs/engine.md, "Worker boundary"):
 1. release handles dropped since the last boundary; take new submissions; end waiting requests that
    timed out or were cancelled;
 2. advance the open resource transition (abort it if its request was cancelled);
 3. settle TerminalPending requests (release, adopt, free the lane, complete the response);
 4. freeze the cancellation snapshot of active requests (they go TerminalPending);
 5. attempt one admission when the gates allow;
 6. choose the staged prefill, one forced control, or the compact decode round;
 7. run at most one model execution unit;
 8. commit model state, terminal resources, budget, then Frontend output state;
 9. publish response events.

Steps 8-9 of an ordinary row (one that goes on generating) finish one boundary later, while the next
decode unit is on the device: the Program calls back after launching it (``decode(while_running=...)``)
and the worker commits the OutputSessions and publishes then, so that host work no longer leaves the
GPU idle between two decode steps. Every order the specification fixes still holds: the Program commit
and the budget precede the OutputSession commit, which precedes publication; a request's events keep
their order (a unit other than a decode, and a boundary without a unit, publish the deferred rows first,
so no request completes with one unpublished: `_finish` checks it). docs/engine.md, "Publication
overlaps the next decode unit".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from ninfer.runtime.contract.frontend import (
    OutputDeltaLike,
    OutputPreviewLike,
    OutputSessionLike,
    PreparedPromptLike,
)
from ninfer.runtime.contract.types import (
    BackfillProver,
    Blocked,
    Infeasible,
    PendingBatch,
    PendingRow,
    PrefillProgress,
    Program,
    RequestPlan,
    ResourcePlan,
    RowDecision,
    SequenceHandle,
    StalePlan,
    TokenLogprob,
)
from ninfer.runtime.engine.admission_policy import AdmissionPolicy
from ninfer.runtime.engine.request_record import (
    ACTIVE_STATES,
    RequestRecord,
    RequestState,
    ResponseChannel,
)
from ninfer.runtime.engine.resource_manager import EngineInvariantError, Lane, ResourceManager
from ninfer.runtime.engine.scheduler import Scheduler, Unit, UnitKind
from ninfer.types import (
    Availability,
    EngineConfig,
    EngineFailed,
    FinishReason,
    GenerationDelta,
    NInferError,
    RequestFailed,
    RequestRejected,
    ToolCallDelta,
)

log = logging.getLogger("ninfer.engine")

# while a resource transition is in flight the idle worker polls it this often (seconds)
TRANSITION_POLL_S = 0.001


@dataclass(frozen=True)
class EngineSnapshot:
    """A read-only summary of the worker's state, taken on the worker (for tests and diagnostics)."""

    states: dict[int, RequestState]  # every unfinished request
    waiting: tuple[int, ...]  # FIFO order
    staged_prefill: int | None
    transition: int | None
    lanes: tuple[Lane, ...]
    protected_head: int | None
    donors: frozenset[int]


StepObserver = Callable[["EngineCore", Unit], None]


class _Unpublished(NamedTuple):
    """A committed row of a still-generating request whose OutputSession commit and publication wait
    for the next decode unit to be launched. The row accepted all it produced (it is not terminal).
    (A NamedTuple: one is built per row per round, and a frozen dataclass costs about 1 us more.)"""

    record: RequestRecord
    preview: OutputPreviewLike
    row: PendingRow


class _Ending(NamedTuple):
    """A row of a unit whose request ends with it (stop, length, cancel, error): committed, then its
    resources released and its response completed in the same boundary."""

    row: PendingRow
    record: RequestRecord
    preview: OutputPreviewLike | None  # None: a cancelled row (cancellation or an output error)
    reason: FinishReason
    error: RequestFailed | None


class EngineCore:
    """The Engine worker (see module docstring). Construct, then ``start_thread()`` or call ``step()``."""

    def __init__(
        self,
        program: Program,
        config: EngineConfig,
        *,
        max_context: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if program.max_concurrency < config.max_concurrency:
            raise ValueError(
                f"the Program was built for {program.max_concurrency} active sequences, "
                f"config asks max_concurrency={config.max_concurrency}"
            )
        self._program = program
        self._config = config
        self.max_context = max_context
        self._clock = clock
        # ---- shared with other threads (guarded by _lock) ----
        self._lock = threading.Lock()
        # wake-ups (None) and dropped handles' request ids; lock-free, so finalizers may put into it
        self._signals: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._ingress: deque[RequestRecord] = deque()
        self._channels: dict[int, ResponseChannel] = {}
        self._outstanding = 0
        self._capacity_limit = config.max_concurrency + config.queue_capacity
        self._next_order = 1
        self._failed_reason: str | None = None
        self._closing = False
        self._availability = Availability("starting")
        self._thread: threading.Thread | None = None
        # ---- owned by the worker ----
        self._scheduler = Scheduler()
        self._rm = ResourceManager(program, config.max_concurrency)
        prover = program if isinstance(program, BackfillProver) else None
        self._admission = AdmissionPolicy(prover)
        self._live: dict[int, RequestRecord] = {}  # every accepted, unfinished request
        self._laned: dict[int, RequestRecord] = {}  # requests holding a lane
        self._open_batch: PendingBatch | None = None
        self._unpublished: list[_Unpublished] = []  # see _publish_committed
        # Boundary steps 3 and 4 look at the laned requests only when their input may have changed:
        # a cancellation or an output error may have reached an active request since the last snapshot
        # (every cancel puts a worker signal, see settle_dropped_handles; _publish_committed records
        # output errors)
        self._snapshot_due = False
        # a request entered TerminalPending since the last settle step (_enter_terminal)
        self._settle_due = False
        self.observer: StepObserver | None = None
        self.units_run = 0
        self.baseline = program.usage()

    # =================================================================================================
    # Any thread
    # =================================================================================================

    @property
    def availability(self) -> Availability:
        with self._lock:
            return self._availability

    def set_availability(self, state: str, reason: str | None = None) -> None:
        """Lifecycle transitions driven by the facade (warming, ready); a failure is never overwritten."""
        with self._lock:
            if self._availability.state not in ("failed", "closed"):
                self._availability = Availability(state, reason)  # type: ignore[arg-type]

    @property
    def outstanding(self) -> int:
        with self._lock:
            return self._outstanding

    @property
    def failed(self) -> bool:
        with self._lock:
            return self._failed_reason is not None

    def submit(
        self,
        prompt: PreparedPromptLike,
        session: OutputSessionLike,
        plan: RequestPlan,
    ) -> ResponseChannel:
        """Accept a prepared request into the bounded ingress, or reject it at once (overload/failure)."""
        with self._lock:
            if self._failed_reason is not None:
                raise EngineFailed(f"the Engine failed and accepts no requests: {self._failed_reason}")
            if self._closing:
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
            channel = ResponseChannel(order, self._release_capacity, self._signals)
            timeout = self._config.queue_timeout_s
            record = RequestRecord(
                request_id=order,
                publication_order=order,
                prompt=prompt,
                session=session,
                plan=plan,
                channel=channel,
                deadline=None if timeout is None else self._clock() + timeout,
            )
            self._ingress.append(record)
            self._channels[order] = channel
        self._signals.put(None)
        return channel

    def _release_capacity(self, request_id: int) -> None:
        with self._lock:
            self._outstanding -= 1
            self._channels.pop(request_id, None)

    def settle_dropped_handles(self) -> bool:
        """Release the consumer side of every request whose handle was garbage-collected since the last
        call (the finalizer only queued its id). Called by the worker at ingress, and by
        ``Engine.close`` once the worker is gone. Returns whether any handle was dropped."""
        dropped: list[int] = []
        # empty() first: a boundary with no signal (steady decode) takes no exception path
        while not self._signals.empty():
            try:
                signal = self._signals.get_nowait()
            except queue.Empty:  # only if another thread took it meanwhile (the worker is the consumer)
                break
            # any signal may be a cancellation's (cancel and abandon put one after setting the flag), and
            # whichever thread takes it, the next cancellation snapshot must look
            self._snapshot_due = True
            if signal is not None:
                dropped.append(signal)
        for request_id in dropped:
            with self._lock:
                channel = self._channels.get(request_id)
            if channel is not None:  # None: its capacity was already released
                channel.abandon(wake_worker=False)
        return bool(dropped)

    def close(self) -> None:
        """Stop accepting requests and cancel every outstanding one; the worker exits once all ended."""
        with self._lock:
            self._closing = True
            channels = list(self._channels.values())
        self._signals.put(None)
        for channel in channels:
            channel.cancel()

    # ---- threaded worker ----
    def start_thread(self) -> threading.Thread:
        self._thread = threading.Thread(target=self.run_forever, name="ninfer-engine-worker", daemon=True)
        self._thread.start()
        return self._thread

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def run_forever(self) -> None:
        """The worker loop: step until failed, or closed with nothing left; sleep when idle."""
        while True:
            did_work = self.step()
            if self._failed_reason is not None:  # set only by step(), on this thread
                return
            if self._closing:  # close() sets it under the lock, after which submit accepts nothing
                with self._lock:
                    if not self._live and not self._ingress:
                        self._availability = Availability("closed")
                        return
            if not did_work:
                self._sleep(self._idle_timeout())

    def _sleep(self, timeout: float | None) -> None:
        """Wait for a signal (submit, cancel, close, a dropped handle) or the timeout. A signal that
        arrived after the last ingress is already queued, so no wake-up is lost; the one taken here is
        put back for the next boundary's ingress to handle."""
        try:
            signal = self._signals.get(timeout=timeout)
        except queue.Empty:
            return
        self._signals.put(signal)

    def _idle_timeout(self) -> float | None:
        """How long the idle worker may sleep: until a queue deadline, or briefly to poll a transition."""
        if self._rm.transition is not None:
            return TRANSITION_POLL_S
        deadlines = [r.deadline for r in self._scheduler.waiting if r.deadline is not None]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - self._clock())

    # =================================================================================================
    # Worker thread only
    # =================================================================================================

    def step(self) -> bool:
        """Run one worker boundary. Returns whether anything happened. Never raises: any Program error
        or broken invariant fails the Engine as a whole (see ``_fail``)."""
        if self._failed_reason is not None:  # only _fail sets it, on the stepping thread: no lock needed
            return False
        try:
            return self._boundary()
        except Exception as exc:  # noqa: BLE001 - every unexpected error is an Engine-wide failure
            log.exception("Engine failure")
            self._fail(f"{type(exc).__name__}: {exc}")
            return True

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            states={rid: r.state for rid, r in self._live.items()},
            waiting=tuple(r.request_id for r in self._scheduler.waiting),
            staged_prefill=self._scheduler.staged.request_id if self._scheduler.staged else None,
            transition=self._rm.transition.request_id if self._rm.transition else None,
            lanes=tuple(Lane(lane.index, lane.state, lane.request_id) for lane in self._rm.lanes),
            protected_head=self._scheduler.protected_head,
            donors=self._scheduler.donors,
        )

    @property
    def idle(self) -> bool:
        """No request anywhere in the worker or its ingress, and no signal (e.g. a dropped handle)
        waiting for the next boundary."""
        with self._lock:
            return not self._live and not self._ingress and self._signals.empty()

    def _boundary(self) -> bool:
        did = self._ingest(self._clock())
        did |= self._advance_transition()
        did |= self._settle_terminal()
        did |= self._freeze_cancellations()
        did |= self._try_admit()
        unit = self._scheduler.next_unit(self._laned.values())
        # a decode unit publishes the deferred rows once it is on the device; anything else first. A failed
        # OutputSession commit there ends its request, which must then not get the chosen unit
        if (unit is None or unit.kind is not UnitKind.DECODE) and self._publish_committed():
            self._freeze_cancellations()
            unit = self._scheduler.next_unit(self._laned.values())
        if unit is not None:
            self._scheduler.started(unit)
            if self.observer is not None:
                self.observer(self, unit)
            self._run(unit)
            self.units_run += 1
            did = True
        return did

    # ---- 1. ingress, waiting timeouts and cancellations ----
    def _ingest(self, now: float) -> bool:
        # signals first: a submission racing with this boundary then leaves its signal queued, and the
        # worker cannot sleep past it
        did = self.settle_dropped_handles()
        # an unlocked peek: submit appends under the lock and signals after it, so a request this peek
        # misses still has its signal queued, and the worker cannot sleep past it
        if self._ingress:
            with self._lock:
                arrived = list(self._ingress)
                self._ingress.clear()
            for record in arrived:
                self._live[record.request_id] = record
                self._scheduler.enqueue(record)
                self._admission.invalidate()
            did = True
        if not self._scheduler.has_waiting:
            return did
        for record in self._scheduler.waiting:
            if record.channel.cancel_requested:
                self._scheduler.take(record)
                self._finish(record, "cancelled")
            elif record.deadline is not None and now >= record.deadline:
                self._scheduler.take(record)
                self._finish(
                    record,
                    "error",
                    RequestRejected(
                        "queue_timeout",
                        f"request waited more than queue_timeout_s={self._config.queue_timeout_s} s for "
                        "admission; retry when the Engine is less busy, lower max_tokens, or start it "
                        "with a larger queue_timeout_s",
                    ),
                )
            else:
                continue
            self._admission.invalidate()
            did = True
        return did

    # ---- 2. the open resource transition ----
    def _advance_transition(self) -> bool:
        record = self._rm.transition
        if record is None:
            return False
        if record.channel.cancel_requested:
            self._rm.abort(record)
            self._laned.pop(record.request_id)
            self._scheduler.unstage(record)
            self._admission.invalidate()
            self._finish(record, "cancelled")
            return True
        if self._rm.transition_ready():
            self._activate(record)
            return True
        return False

    def _activate(self, record: RequestRecord) -> None:
        """Adopt the finished materialization: the request is Active and its start is published."""
        self._rm.complete(record)
        record.prompt_remaining = len(record.plan.prompt_token_ids) - record.reused_prefix_tokens
        record.state = RequestState.PREFILL
        self._admission.invalidate()
        record.channel.publish(record.start_event())

    # ---- 3. TerminalPending ----
    def _settle_terminal(self) -> bool:
        # nothing entered TerminalPending since the last look (in steady decode nothing does; a unit's
        # terminal rows are released in the unit's own commit, the cancellation snapshot's are settled here)
        if not self._settle_due:
            return False
        self._settle_due = False
        settled = [r for r in self._laned.values() if r.state is RequestState.TERMINAL_PENDING]
        for record in settled:
            self._release(record)
            # a deferred OutputSession commit that failed after the request went TerminalPending (e.g. it
            # was cancelled meanwhile) still ends it with that error
            reason = "error" if record.output_error is not None else record.finish_reason or "cancelled"
            self._finish(record, reason, record.output_error)
        return bool(settled)

    def _release(self, record: RequestRecord) -> None:
        self._rm.release(record)
        self._laned.pop(record.request_id)
        self._admission.invalidate()

    def _enter_terminal(self, record: RequestRecord, reason: FinishReason) -> None:
        self._rm.enter_terminal(record)
        record.state = RequestState.TERMINAL_PENDING
        self._settle_due = True  # whoever leaves it TerminalPending, the next settle step looks
        record.finish_reason = reason
        record.pending_force = ()
        if self._scheduler.staged is record:
            self._scheduler.unstage(record)
            self._admission.invalidate()

    # ---- 4. cancellation snapshot ----
    def _freeze_cancellations(self) -> bool:
        if not self._snapshot_due:
            return False
        self._snapshot_due = False
        ended = [
            r
            for r in self._laned.values()
            if r.state in ACTIVE_STATES and (r.channel.cancel_requested or r.output_error is not None)
        ]
        for record in ended:
            self._enter_terminal(record, "cancelled" if record.output_error is None else "error")
        return bool(ended)

    # ---- 5. admission ----
    def _try_admit(self) -> bool:
        head = self._scheduler.head()
        if head is None or not self._admission.should_attempt(
            lane_free=self._rm.free_lane() is not None,
            transition_in_flight=self._rm.transition is not None,
            staged_prefill_busy=self._scheduler.staged is not None,
            resource_revision=self._program.resource_revision,
        ):
            return False
        for _attempt in range(2):  # a plan found stale at start is re-planned once
            outcome = self._rm.plan(head)
            if isinstance(outcome, Infeasible):
                self._scheduler.take(head)
                self._admission.attempted(blocked=False, resource_revision=self._program.resource_revision)
                self._finish(head, "error", RequestRejected("infeasible", outcome.reason))
                return True
            if isinstance(outcome, Blocked):
                if not self._laned:
                    raise EngineInvariantError(
                        f"the Program reports Blocked ({outcome.reason}) with no active incumbent; "
                        "it must answer Infeasible"
                    )
                self._scheduler.protect(head, self._laned.keys())
                self._admission.attempted(blocked=True, resource_revision=self._program.resource_revision)
                return self._try_backfill(head)
            if self._begin_materialization(head, outcome):
                return True
        # nothing ran between planning and start, so a second stale plan means the Program's revision
        # moves on its own: no admission could ever succeed, which must not become a silent wait
        raise EngineInvariantError("a freshly sealed plan was stale twice in one boundary")

    def _begin_materialization(self, record: RequestRecord, plan: ResourcePlan) -> bool:
        try:
            self._rm.begin(record, plan)
        except StalePlan:
            return False
        self._scheduler.take(record)
        self._scheduler.stage(record)
        record.state = RequestState.MATERIALIZING
        self._laned[record.request_id] = record
        self._admission.attempted(blocked=False, resource_revision=self._program.resource_revision)
        if self._rm.transition_ready():  # a transition that needs no copy completes in this boundary
            self._activate(record)
        return True

    def _try_backfill(self, head: RequestRecord) -> bool:
        """Admit the request behind a blocked head only with the Program's proof (never otherwise)."""
        borrower = self._scheduler.behind_head()
        if borrower is None or not self._admission.can_backfill:
            return False
        # the donor set recorded when the head was blocked, less those that already ended: a borrower
        # admitted since then is no donor, its reservation stays held while the head waits
        donors: list[SequenceHandle] = []
        for request_id in sorted(self._scheduler.donors):
            donor = self._laned.get(request_id)
            if donor is not None and donor.state in ACTIVE_STATES and donor.handle is not None:
                donors.append(donor.handle)
        proof = self._admission.prove_backfill(head.plan, donors, borrower.plan)
        if proof is None:
            return False
        return self._begin_materialization(borrower, proof)

    # ---- 6-9. one execution unit ----
    def _run(self, unit: Unit) -> None:
        if unit.kind is UnitKind.DECODE:
            handles: list[SequenceHandle] = []
            budgets: list[int] = []
            for record in unit.members:
                handles.append(self._handle(record))
                budgets.append(record.remaining_budget)
            batch = self._program.decode(
                handles,
                budgets,
                while_running=self._publish_committed,
                repeat_expected=self._round_repeats(budgets),
            )
            self._open_batch = batch
            if self._unpublished:  # the Program did not call back: the preview below needs it
                self._publish_committed()
            if batch.kind != "decode" or [row.handle for row in batch.rows] != handles:
                raise EngineInvariantError(f"decode returned a batch whose membership differs: {batch!r}")
            for row, budget in zip(batch.rows, budgets):
                if not 1 <= len(row.tokens) <= budget:
                    raise EngineInvariantError(f"decode produced {len(row.tokens)} tokens, budget {budget}")
            self._commit_unit(batch, unit.members)
        elif unit.kind is UnitKind.PREFILL:
            self._run_prefill(unit.members[0])
        else:
            record = unit.members[0]
            handle = self._handle(record)
            batch = self._program.force(handle, record.pending_force)
            self._open_batch = batch
            if batch.kind != "force" or len(batch.rows) != 1 or batch.rows[0].handle != handle:
                raise EngineInvariantError(f"force returned a mismatched batch {batch!r}")
            if batch.rows[0].tokens != record.pending_force:
                raise EngineInvariantError("force produced tokens other than the forced ones")
            self._commit_unit(batch, unit.members)

    def _round_repeats(self, budgets: list[int]) -> bool:
        """Whether the unit after this decode round is, unless a row ends early or asks for forced
        control, the same round less the rows it ends by length (contract rule 13): the Scheduler has no
        prefill staged, and no row ends by length while a request waits (the lane it frees would admit
        that request, whose prefill goes next). A waiting request this boundary did not admit stays
        blocked until a row ends; a request or a cancellation arriving while the round runs is a miss the
        hint cannot see."""
        scheduler = self._scheduler
        if scheduler.staged is not None:
            return False
        return not (scheduler.has_waiting and min(budgets) <= 1)

    def _run_prefill(self, record: RequestRecord) -> None:
        handle = self._handle(record)
        budget = self._config.prefill_chunk_tokens
        out = self._program.prefill(handle, budget)
        if isinstance(out, PrefillProgress):
            expected_left = record.prompt_remaining - budget
            if out.consumed != budget or out.remaining != expected_left or out.remaining < 1:
                raise EngineInvariantError(
                    f"prefill chunk consumed {out.consumed} leaving {out.remaining}; expected {budget} of "
                    f"{record.prompt_remaining} with some left"
                )
            record.prompt_remaining = out.remaining
            return
        self._open_batch = out
        if out.kind != "prefill" or len(out.rows) != 1 or out.rows[0].handle != handle:
            raise EngineInvariantError(f"prefill returned a mismatched batch {out!r}")
        if out.rows[0].produced != 1 or record.prompt_remaining > budget:
            raise EngineInvariantError("the final prefill chunk yields exactly the first sampled token")
        self._commit_unit(out, (record,))

    def _handle(self, record: RequestRecord) -> SequenceHandle:
        if record.handle is None:
            raise EngineInvariantError(f"active request {record.request_id} has no sequence handle")
        return record.handle

    def _commit_unit(self, batch: PendingBatch, members: tuple[RequestRecord, ...]) -> None:
        """Preview -> Program commit -> terminal resources -> budget -> OutputSession commit -> publish.

        An exception from one row's OutputSession ends only that request (``RequestFailed``): in
        preview it becomes a cancelled row, so the batch is still consumed whole by one commit.
        The caller checked the rows' membership: one row per member, in order, with its handle."""
        sampled = batch.kind != "force"
        decisions: list[RowDecision] = []
        # rows that go on generating (they accept all they produced) and rows whose request ends here,
        # both in row order
        continuing: list[_Unpublished] = []
        ending: list[_Ending] = []
        for row, record in zip(batch.rows, members):
            preview: OutputPreviewLike | None = None
            error = record.output_error  # a deferred OutputSession commit failed while the unit ran
            # else a cancellation observed while the unit ran: both make a cancelled row
            if error is None and not record.channel.cancel_requested:
                try:
                    preview = record.session.preview(row.tokens)
                except Exception as exc:  # noqa: BLE001 - a per-request output error, not the Engine's
                    error = self._output_error(record, "preview", exc)
            if preview is None:
                decisions.append(RowDecision(row.handle, 0, terminal=True, cancelled=True))
                cancelled_as: FinishReason = "error" if error is not None else "cancelled"
                ending.append(_Ending(row, record, None, cancelled_as, error))
                continue
            accepted = preview.accepted
            produced = len(row.tokens)
            if not 1 <= accepted <= produced or (accepted < produced and not preview.stop):
                raise EngineInvariantError(
                    f"Frontend preview accepted {accepted} of {produced} tokens (stop={preview.stop})"
                )
            if (
                sampled
                and record.plan.logprobs.enabled
                and (row.logprobs is None or len(row.logprobs) != produced)
            ):
                raise EngineInvariantError("a row of a logprob request lacks one logprob per token")
            reason: FinishReason | None = None
            if preview.stop:
                reason = "stop"
            elif record.generated + accepted >= record.plan.max_new_tokens:
                reason = "length"
            if reason is None:
                decisions.append(RowDecision(row.handle, accepted))
                continuing.append(_Unpublished(record, preview, row))
            else:
                decisions.append(RowDecision(row.handle, accepted, terminal=True))
                ending.append(_Ending(row, record, preview, reason, None))
        # No validate_decisions here: the Program runs it in commit (contract rules 5-6: a mismatched
        # disposition is its ProgramInvariantError, which fails the Engine), and these decisions are
        # legal by construction: one per row, in row order, with the row's handle; a cancelled row
        # accepts 0 and is terminal; every other row passed the accepted/produced/stop check above, and
        # one that accepts fewer than it produced stops, so it is terminal.

        # Program commits the accepted model state first; nothing is visible before this succeeds.
        self._program.commit(batch, decisions)
        self._open_batch = None

        # terminal resource results, adopted before any lane or output change becomes visible
        for end in ending:
            self._enter_terminal(end.record, end.reason)
            self._release(end.record)

        # generation budget and scheduler accounting
        for end in ending:
            if end.preview is not None:  # a cancelled row accepts nothing
                end.record.generated += end.preview.accepted
        for record, preview, row in continuing:
            record.generated += len(row.tokens)
            if record.state is RequestState.PREFILL:
                record.prompt_remaining = 0
                self._scheduler.unstage(record)
                self._admission.invalidate()
            force = tuple(preview.force_tokens)[: record.remaining_budget] if preview.force_tokens else ()
            record.pending_force = force
            record.state = RequestState.CONTROL_READY if force else RequestState.DECODE_READY

        # OutputSession commits, then publication: for rows that go on generating, once the next decode
        # unit is on the device (_publish_committed)
        self._unpublished.extend(continuing)
        for row, record, preview, reason, error in ending:
            if preview is not None:
                try:
                    out = record.session.commit(preview)
                except Exception as exc:  # noqa: BLE001 - a per-request output error, not the Engine's
                    error = self._output_error(record, "commit", exc)
                    reason = "error"  # a terminal row: its resources are already released above
                else:
                    record.output_touched = True
                    accepted = preview.accepted  # the row was not cancelled: its decision's count
                    logprobs = self._row_logprobs(record, row, accepted)
                    self._publish_delta(record, out, tuple(row.tokens[:accepted]), logprobs)
            self._finish(record, reason, error)

    @staticmethod
    def _row_logprobs(
        record: RequestRecord, row: PendingRow, accepted: int
    ) -> tuple[TokenLogprob, ...] | None:
        if not record.plan.logprobs.enabled:
            return None
        if row.logprobs is None:  # forced tokens: not sampled
            return tuple(TokenLogprob(t, 0.0) for t in row.tokens[:accepted])
        return tuple(row.logprobs[:accepted])

    def _publish_committed(self) -> bool:
        """OutputSession commit and publication of the last unit's rows that go on generating; returns
        whether one of those commits failed.

        Runs while the next decode unit is on the device (the Program's ``while_running`` call), else
        before any other unit and when no unit follows. A failing OutputSession commit ends only its
        request: its row in the unit now running cannot be released yet, so the error is kept and the
        request ends as a cancelled row at its next unit or boundary.
        """
        if not self._unpublished:
            return False
        rows, self._unpublished = self._unpublished, []
        failed = False
        for record, preview, row in rows:
            try:
                out = record.session.commit(preview)
            except Exception as exc:  # noqa: BLE001 - a per-request output error, not the Engine's
                record.output_error = self._output_error(record, "commit", exc)
                self._snapshot_due = True
                failed = True
                continue
            record.output_touched = True
            produced = len(row.tokens)  # all of them accepted
            self._publish_delta(record, out, tuple(row.tokens), self._row_logprobs(record, row, produced))
        return failed

    def _output_error(self, record: RequestRecord, call: str, exc: Exception) -> RequestFailed:
        """The error result of a request whose OutputSession raised (logged with its traceback)."""
        log.exception("request %d: OutputSession.%s failed; only this request ends", record.request_id, call)
        return RequestFailed(
            f"request {record.request_id} failed while forming its output: OutputSession.{call} raised "
            f"{type(exc).__name__}: {exc}. This is a bug in the package's output handling (e.g. its "
            "tool-call or reasoning parser), not in the request; other requests are unaffected. Retry, or "
            "send the request without tools, and report the bug with this message"
        )

    def _publish_delta(
        self,
        record: RequestRecord,
        out: OutputDeltaLike,
        token_ids: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] | None = None,
    ) -> None:
        """Turn an OutputSession delta into a public ``GenerationDelta``, fold it into the aggregate
        result and publish it."""
        delta = GenerationDelta(
            request_id=record.request_id,
            text=out.text,
            reasoning_text=out.reasoning_text,
            tool_calls=tuple(ToolCallDelta(tc.index, tc.id, tc.name, tc.arguments) for tc in out.tool_calls),
            token_ids=token_ids,
            logprobs=logprobs,
        )
        record.record_delta(delta)
        record.channel.publish(delta)

    # ---- completion ----
    def _finish(self, record: RequestRecord, reason: FinishReason, error: NInferError | None = None) -> None:
        """Complete the response: flush held-back output (not on error), publish the one result."""
        # every path to here runs after the request's deferred row was published (its next unit's decode
        # call, the publication before any other unit, or a boundary without a unit)
        if any(row.record is record for row in self._unpublished):
            raise EngineInvariantError(
                f"request {record.request_id} ends before its committed output is published"
            )
        if reason != "error" and record.output_touched:
            try:
                tail = record.session.finish()
            except Exception as exc:  # noqa: BLE001 - a per-request output error, not the Engine's
                reason, error = "error", self._output_error(record, "finish", exc)
            else:
                if tail.text or tail.reasoning_text or tail.tool_calls:
                    self._publish_delta(record, tail)
        record.finish_reason = reason
        record.error = error
        record.state = RequestState.FINISHED
        self._live.pop(record.request_id, None)
        record.channel.publish(record.result())

    # ---- Engine-wide failure ----
    def _fail(self, reason: str) -> None:
        """Fail the Engine: abort Program transactions, release active state, clear the ResourceManager,
        then complete every outstanding response with ``EngineFailed``. The Program is not trusted any
        more, so every cleanup call is best-effort and its errors are only logged."""
        with self._lock:
            if self._failed_reason is not None:
                return
            self._failed_reason = reason
            self._availability = Availability("failed", reason)
            arrived = list(self._ingress)
            self._ingress.clear()
        for record in arrived:
            self._live[record.request_id] = record

        def best_effort(what: str, fn: Callable[[], object]) -> None:
            try:
                fn()
            except Exception:  # noqa: BLE001
                log.warning("cleanup after Engine failure: %s failed", what, exc_info=True)

        # rows the Program committed are still published (best effort), then their requests fail
        best_effort("publish committed rows", self._publish_committed)
        self._unpublished.clear()
        batch = self._open_batch
        self._open_batch = None
        if batch is not None and not batch.consumed:
            best_effort("abort_pending", lambda: self._program.abort_pending(batch))
        txn_owner = self._rm.transition
        if txn_owner is not None and txn_owner.txn is not None:
            txn = txn_owner.txn
            best_effort("abort transaction", lambda: self._program.abort(txn))
        for record in list(self._laned.values()):
            handle = record.handle
            if handle is not None:
                best_effort("release", lambda h=handle: self._program.release(h))
        self._rm.clear()
        self._scheduler.clear()
        self._laned.clear()
        error = EngineFailed(f"the Engine failed and serves no more requests: {reason}")
        for record in sorted(self._live.values(), key=lambda r: r.publication_order):
            record.finish_reason = "error"
            record.error = error
            record.state = RequestState.FINISHED
            if not record.channel.response_done:
                best_effort("publish", lambda r=record: r.channel.publish(r.result()))
        self._live.clear()
