"""EngineCore: the one worker that owns request records, Scheduler, ResourceManager and the Program.

Other threads reach it only through its `Ingress` (submission, capacity, availability, the signal
queue), the per-request ``ResponseChannel`` (cancellation flag, events) and ``close``. ``step()`` runs one
worker boundary; the threaded worker just loops it, and tests call it directly for deterministic,
reproducible schedules. The pieces, one concern each:

- `ingress.Ingress`: the any-thread side;
- this class: the worker loop, boundary steps 1-7 and the request lifecycle (admission, activation,
  TerminalPending, Finished);
- `committer.Committer`: steps 8-9, the commit and publication pipeline of a unit (and the deferred
  publication that overlaps the next decode unit);
- `failure.fail_engine`: Engine-wide failure cleanup.

One worker boundary, in this order (docs/engine.md, "Worker boundary"):
 1. release handles dropped since the last boundary; take new submissions; end waiting requests that
    timed out or were cancelled;
 2. advance the open resource transition (abort it if its request was cancelled);
 3. settle TerminalPending requests (the terminal transition, adopt, free the lane, complete);
 4. freeze the cancellation snapshot of active requests (they go TerminalPending);
 5. attempt one admission when the gates allow;
 6. choose the staged prefill, one forced control, or the compact decode round;
 7. run at most one model execution unit;
 8. commit model state, terminal resources, budget, then Frontend output state;
 9. publish response events.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ninfer.runtime.contract.frontend import OutputSessionLike, PreparedPromptLike
from ninfer.runtime.contract.types import (
    BackfillProver,
    Blocked,
    Infeasible,
    PendingBatch,
    PrefillProgress,
    Program,
    RequestPlan,
    ResourcePlan,
    SequenceHandle,
    StalePlan,
)
from ninfer.runtime.engine.admission_policy import AdmissionPolicy
from ninfer.runtime.engine.committer import Committer
from ninfer.runtime.engine.failure import fail_engine
from ninfer.runtime.engine.ingress import CacheReset, Ingress
from ninfer.runtime.engine.prefill_pacer import PrefillPacer
from ninfer.runtime.engine.request_record import (
    ACTIVE_STATES,
    RequestRecord,
    RequestState,
    ResponseChannel,
)
from ninfer.runtime.engine.resource_manager import EngineInvariantError, Lane, ResourceManager
from ninfer.runtime.engine.scheduler import Scheduler, Unit, UnitKind
from ninfer.types import Availability, EngineConfig, FinishReason, NInferError, RequestRejected

log = logging.getLogger("ninfer.engine")

# requests whose next unit produces output tokens (the prefill pacer keeps their inter-token gap short)
DECODING = (RequestState.DECODE_READY, RequestState.CONTROL_READY)
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
        self.program = program
        self._config = config
        self.max_context = max_context
        self._clock = clock
        self.ingress = Ingress(config, clock)  # shared with other threads
        self._thread: threading.Thread | None = None
        # ---- owned by the worker ----
        self.scheduler = Scheduler()
        assert config.prefill_chunk_tokens is not None  # the facade resolves it
        gap_ms = config.max_decode_gap_ms
        self.pacer = PrefillPacer(gap_ms / 1000 if gap_ms else None, config.prefill_chunk_tokens)
        self.resources = ResourceManager(
            program,
            config.max_concurrency,
            prefix_cache=config.prefix_cache,
            capture_interval=config.capture_interval,
        )
        self.cache_resets: list[CacheReset] = []  # asked for, not yet carried out
        prover = program if isinstance(program, BackfillProver) else None
        self.admission = AdmissionPolicy(prover)
        self.committer = Committer(self)
        self.live: dict[int, RequestRecord] = {}  # every accepted, unfinished request
        self.laned: dict[int, RequestRecord] = {}  # requests holding a lane
        self.open_batch: PendingBatch | None = None
        # Boundary steps 3 and 4 look at the laned requests only when their input may have changed:
        # a cancellation or an output error may have reached an active request since the last snapshot
        # (every cancel puts a worker signal, see Ingress.settle_dropped_handles; the Committer records
        # output errors)
        self.snapshot_due = False
        # a request entered TerminalPending since the last settle step (enter_terminal)
        self.settle_due = False
        self.observer: StepObserver | None = None
        self.units_run = 0
        self.baseline = program.usage()

    # =================================================================================================
    # Any thread (through the Ingress)
    # =================================================================================================

    @property
    def availability(self) -> Availability:
        return self.ingress.availability

    def set_availability(self, state: str, reason: str | None = None) -> None:
        self.ingress.set_availability(state, reason)

    @property
    def outstanding(self) -> int:
        return self.ingress.outstanding

    @property
    def failed(self) -> bool:
        return self.ingress.failed

    def submit(
        self,
        prompt: PreparedPromptLike,
        session: OutputSessionLike,
        plan: RequestPlan,
        *,
        session_id: str | None = None,
        prefix_cache: bool = True,
    ) -> ResponseChannel:
        return self.ingress.submit(prompt, session, plan, session_id=session_id, prefix_cache=prefix_cache)

    def request_cache_reset(self) -> CacheReset:
        """Drop every inactive checkpoint at the worker's next boundary (`CacheReset.wait`)."""
        return self.ingress.request_cache_reset()

    def settle_dropped_handles(self) -> bool:
        """Release the consumer side of every dropped handle (`Ingress.settle_dropped_handles`); called
        by the worker at ingress, and by ``Engine.close`` once the worker is gone. Returns whether any
        handle was dropped."""
        signalled, dropped = self.ingress.settle_dropped_handles()
        if signalled:  # whichever thread takes a signal, the next cancellation snapshot must look
            self.snapshot_due = True
        return dropped

    def close(self) -> None:
        """Stop accepting requests and cancel every outstanding one; the worker exits once all ended."""
        self.ingress.close()

    @property
    def idle(self) -> bool:
        """No request anywhere in the worker or its ingress, and no signal (e.g. a dropped handle)
        waiting for the next boundary."""
        return self.ingress.idle(bool(self.live))

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
            if self.ingress.failed_reason is not None:  # set only by step(), on this thread
                return
            if self.ingress.closing and self.ingress.finished_closing(bool(self.live)):
                return
            if not did_work:
                self.ingress.sleep(self._idle_timeout())

    def _idle_timeout(self) -> float | None:
        """How long the idle worker may sleep: until a queue deadline, or briefly to poll a transition."""
        if self.resources.transition is not None:
            return TRANSITION_POLL_S
        deadlines = [r.deadline for r in self.scheduler.waiting if r.deadline is not None]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - self._clock())

    # =================================================================================================
    # Worker thread only
    # =================================================================================================

    def step(self) -> bool:
        """Run one worker boundary. Returns whether anything happened. Never raises: any Program error
        or broken invariant fails the Engine as a whole (`failure.fail_engine`)."""
        if self.ingress.failed_reason is not None:  # set only by fail_engine, on the stepping thread
            return False
        try:
            return self.boundary()
        except Exception as exc:  # noqa: BLE001 - every unexpected error is an Engine-wide failure
            log.exception("Engine failure")
            fail_engine(self, f"{type(exc).__name__}: {exc}")
            return True

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            states={rid: r.state for rid, r in self.live.items()},
            waiting=tuple(r.request_id for r in self.scheduler.waiting),
            staged_prefill=self.scheduler.staged.request_id if self.scheduler.staged else None,
            transition=self.resources.transition.request_id if self.resources.transition else None,
            lanes=tuple(Lane(lane.index, lane.state, lane.request_id) for lane in self.resources.lanes),
            protected_head=self.scheduler.protected_head,
            donors=self.scheduler.donors,
        )

    def boundary(self) -> bool:
        did = self._ingest(self._clock())
        did |= self._advance_transition()
        did |= self._settle_terminal()
        did |= self._freeze_cancellations()
        did |= self._try_admit()
        unit = self.scheduler.next_unit(self.laned.values())
        # a decode unit publishes the deferred rows once it is on the device; anything else first. A failed
        # OutputSession commit there ends its request, which must then not get the chosen unit
        if (unit is None or unit.kind is not UnitKind.DECODE) and self.committer.publish_committed():
            self._freeze_cancellations()
            unit = self.scheduler.next_unit(self.laned.values())
        if unit is None:
            self.pacer.idle()
        else:
            self.scheduler.started(unit)
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
        arrived = self.ingress.take()
        for record in arrived:
            self.live[record.request_id] = record
            self.scheduler.enqueue(record)
            self.admission.invalidate()
        did |= bool(arrived)
        did |= self._reset_cache()
        if not self.scheduler.has_waiting:
            return did
        for record in self.scheduler.waiting:
            if record.channel.cancel_requested:
                self.scheduler.take(record)
                self.finish(record, "cancelled")
            elif record.deadline is not None and now >= record.deadline:
                self.scheduler.take(record)
                self.finish(
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
            self.admission.invalidate()
            did = True
        return did

    def _reset_cache(self) -> bool:
        """Carry out the cache resets asked for: one deletion transition of every inactive checkpoint,
        once no other transition is open (a materialization's source is pinned until it ends)."""
        self.cache_resets.extend(self.ingress.take_cache_resets())
        if not self.cache_resets or self.resources.transition is not None:
            return False
        dropped = self.resources.evict_all()
        resets, self.cache_resets = self.cache_resets, []
        for reset in resets:
            reset.done(dropped)
        self.admission.invalidate()
        return True

    # ---- 2. the open resource transition ----
    def _advance_transition(self) -> bool:
        record = self.resources.transition
        if record is None:
            return False
        if record.channel.cancel_requested:
            self.resources.abort(record)
            self.laned.pop(record.request_id)
            self.scheduler.unstage(record)
            self.admission.invalidate()
            self.finish(record, "cancelled")
            return True
        if self.resources.transition_ready():
            self._activate(record)
            return True
        return False

    def _activate(self, record: RequestRecord) -> None:
        """Adopt the finished materialization: the request is Active and its start is published."""
        self.resources.complete(record)
        record.prompt_remaining = len(record.plan.prompt_token_ids) - record.reused_prefix_tokens
        record.state = RequestState.PREFILL
        self.admission.invalidate()
        record.channel.publish(record.start_event())

    # ---- 3. TerminalPending ----
    def _settle_terminal(self) -> bool:
        # nothing entered TerminalPending since the last look (in steady decode nothing does; a unit's
        # terminal rows are settled in the unit's own commit, the cancellation snapshot's here)
        if not self.settle_due:
            return False
        self.settle_due = False
        settled = [r for r in self.laned.values() if r.state is RequestState.TERMINAL_PENDING]
        for record in settled:
            self.settle_resources(record)
            # a deferred OutputSession commit that failed after the request went TerminalPending (e.g. it
            # was cancelled meanwhile) still ends it with that error
            reason = "error" if record.output_error is not None else record.finish_reason or "cancelled"
            self.finish(record, reason, record.output_error)
        return bool(settled)

    def settle_resources(self, record: RequestRecord) -> None:
        """The terminal resource transition of a TerminalPending request (the ResourceManager chooses
        retain or release, the Program carries it out), adopted; the lane becomes Free."""
        self.resources.settle_terminal(record)
        self.laned.pop(record.request_id)
        self.admission.invalidate()

    def enter_terminal(self, record: RequestRecord, reason: FinishReason) -> None:
        self.resources.enter_terminal(record)
        record.state = RequestState.TERMINAL_PENDING
        self.settle_due = True  # whoever leaves it TerminalPending, the next settle step looks
        record.finish_reason = reason
        record.pending_force = ()
        if self.scheduler.staged is record:
            self.scheduler.unstage(record)
            self.admission.invalidate()

    def prefill_done(self, record: RequestRecord) -> None:
        """The request's prompt is consumed: the staged-prefill gate opens."""
        self.scheduler.unstage(record)
        self.admission.invalidate()

    def cancellation_may_have_changed(self) -> None:
        """An active request may now have to end (an output error was recorded): the next cancellation
        snapshot looks."""
        self.snapshot_due = True

    # ---- 4. cancellation snapshot ----
    def _freeze_cancellations(self) -> bool:
        if not self.snapshot_due:
            return False
        self.snapshot_due = False
        ended = [
            r
            for r in self.laned.values()
            if r.state in ACTIVE_STATES and (r.channel.cancel_requested or r.output_error is not None)
        ]
        for record in ended:
            self.enter_terminal(record, "cancelled" if record.output_error is None else "error")
        return bool(ended)

    # ---- 5. admission ----
    def _try_admit(self) -> bool:
        head = self.scheduler.head()
        if head is None or not self.admission.should_attempt(
            lane_free=self.resources.free_lane() is not None,
            transition_in_flight=self.resources.transition is not None,
            staged_prefill_busy=self.scheduler.staged is not None,
            resource_revision=self.program.resource_revision,
        ):
            return False
        for _attempt in range(2):  # a plan found stale at start is re-planned once
            outcome = self.resources.plan(head)
            if isinstance(outcome, Infeasible):
                self.scheduler.take(head)
                self.admission.attempted(blocked=False, resource_revision=self.program.resource_revision)
                self.finish(head, "error", RequestRejected("infeasible", outcome.reason))
                return True
            if isinstance(outcome, Blocked):
                if not self.laned:
                    raise EngineInvariantError(
                        f"the Program reports Blocked ({outcome.reason}) with no active incumbent; "
                        "it must answer Infeasible"
                    )
                self.scheduler.protect(head, self.laned.keys())
                self.admission.attempted(blocked=True, resource_revision=self.program.resource_revision)
                return self._try_backfill(head)
            if self._begin_materialization(head, outcome):
                return True
        # nothing ran between planning and start, so a second stale plan means the Program's revision
        # moves on its own: no admission could ever succeed, which must not become a silent wait
        raise EngineInvariantError("a freshly sealed plan was stale twice in one boundary")

    def _begin_materialization(self, record: RequestRecord, plan: ResourcePlan) -> bool:
        try:
            self.resources.begin(record, plan)
        except StalePlan:
            return False
        self.scheduler.take(record)
        self.scheduler.stage(record)
        record.state = RequestState.MATERIALIZING
        self.laned[record.request_id] = record
        self.admission.attempted(blocked=False, resource_revision=self.program.resource_revision)
        if self.resources.transition_ready():  # a transition that needs no copy completes in this boundary
            self._activate(record)
        return True

    def _try_backfill(self, head: RequestRecord) -> bool:
        """Admit the request behind a blocked head only with the Program's proof (never otherwise)."""
        borrower = self.scheduler.behind_head()
        if borrower is None or not self.admission.can_backfill:
            return False
        # the donor set recorded when the head was blocked, less those that already ended: a borrower
        # admitted since then is no donor, its reservation stays held while the head waits
        donors: list[SequenceHandle] = []
        for request_id in sorted(self.scheduler.donors):
            donor = self.laned.get(request_id)
            if donor is not None and donor.state in ACTIVE_STATES and donor.handle is not None:
                donors.append(donor.handle)
        proof = self.admission.prove_backfill(head.plan, donors, borrower.plan)
        if proof is None:
            return False
        return self._begin_materialization(borrower, proof)

    # ---- 6-9. one execution unit ----
    def _run(self, unit: Unit) -> None:
        if unit.kind is UnitKind.DECODE:
            handles: list[SequenceHandle] = []
            budgets: list[int] = []
            constrained = False
            for record in unit.members:
                handles.append(self._handle(record))
                budget, horizon = record.remaining_budget, record.control_horizon
                budgets.append(budget if horizon is None or horizon >= budget else horizon)
                constrained = constrained or record.constraint is not None
            if constrained:
                batch = self._decode_constrained(unit, handles, budgets)
            else:
                batch = self.program.decode(
                    handles,
                    budgets,
                    while_running=self.committer.publish_committed,
                    repeat_expected=self._round_repeats(budgets),
                )
            self.open_batch = batch
            if self.committer.unpublished:  # the Program did not call back: the preview below needs it
                self.committer.publish_committed()
            if batch.kind != "decode" or [row.handle for row in batch.rows] != handles:
                raise EngineInvariantError(f"decode returned a batch whose membership differs: {batch!r}")
            for row, budget in zip(batch.rows, budgets):
                if not 1 <= len(row.tokens) <= budget:
                    raise EngineInvariantError(f"decode produced {len(row.tokens)} tokens, budget {budget}")
            self.committer.commit_unit(batch, unit.members)
            self.pacer.decode_committed(self._clock())
        elif unit.kind is UnitKind.PREFILL:
            self._run_prefill(unit.members[0])
        else:
            self.pacer.other_unit_ran()
            record = unit.members[0]
            handle = self._handle(record)
            batch = self.program.force(handle, record.pending_force)
            self.open_batch = batch
            if batch.kind != "force" or len(batch.rows) != 1 or batch.rows[0].handle != handle:
                raise EngineInvariantError(f"force returned a mismatched batch {batch!r}")
            if batch.rows[0].tokens != record.pending_force:
                raise EngineInvariantError("force produced tokens other than the forced ones")
            self.committer.commit_unit(batch, unit.members)

    def _decode_constrained(
        self, unit: Unit, handles: list[SequenceHandle], budgets: list[int]
    ) -> PendingBatch:
        """A decode round with constrained rows: each one's grammar goes with it (the Program masks its
        logits), and no repeat hint: a constrained row's next mask depends on this round's token, so the
        round after cannot be queued before this one is committed (docs/structured-outputs.md)."""
        return self.program.decode(
            handles,
            budgets,
            while_running=self.committer.publish_committed,
            repeat_expected=False,
            constraints=[record.constraint for record in unit.members],
        )

    def _round_repeats(self, budgets: list[int]) -> bool:
        """Whether the unit after this decode round is, unless a row ends early or asks for forced
        control, the same round less the rows it ends by length (contract rule 13): the Scheduler has no
        prefill staged, and no row ends by length while a request waits (the lane it frees would admit
        that request, whose prefill goes next). A waiting request this boundary did not admit stays
        blocked until a row ends; a request or a cancellation arriving while the round runs is a miss the
        hint cannot see."""
        scheduler = self.scheduler
        if scheduler.staged is not None:
            return False
        return not (scheduler.has_waiting and min(budgets) <= 1)

    def _run_prefill(self, record: RequestRecord) -> None:
        handle = self._handle(record)
        decoding = any(r.state in DECODING for r in self.laned.values())
        budget = self.pacer.chunk(decoding)
        frontier = len(record.plan.prompt_token_ids) - record.prompt_remaining
        points = record.capture_points
        while points and points[0] <= frontier:
            points.pop(0)
        if points:  # a chunk ends at the next capture point, where the checkpoint is taken
            budget = min(budget, points[0] - frontier)
        if record.constraint is None:
            out = self.program.prefill(handle, budget)
        else:  # the final chunk samples the first token under the constraint
            out = self.program.prefill(handle, budget, constraint=record.constraint)
        self.pacer.prefill_ran(min(budget, record.prompt_remaining))
        if isinstance(out, PrefillProgress):
            expected_left = record.prompt_remaining - budget
            if out.consumed != budget or out.remaining != expected_left or out.remaining < 1:
                raise EngineInvariantError(
                    f"prefill chunk consumed {out.consumed} leaving {out.remaining}; expected {budget} of "
                    f"{record.prompt_remaining} with some left"
                )
            record.prompt_remaining = out.remaining
            if points and frontier + out.consumed == points[0]:
                points.pop(0)
                self.resources.capture(record)
            return
        self.open_batch = out
        if out.kind != "prefill" or len(out.rows) != 1 or out.rows[0].handle != handle:
            raise EngineInvariantError(f"prefill returned a mismatched batch {out!r}")
        if out.rows[0].produced != 1 or record.prompt_remaining > budget:
            raise EngineInvariantError("the final prefill chunk yields exactly the first sampled token")
        self.committer.commit_unit(out, (record,))

    def _handle(self, record: RequestRecord) -> SequenceHandle:
        if record.handle is None:
            raise EngineInvariantError(f"active request {record.request_id} has no sequence handle")
        return record.handle

    # ---- completion ----
    def finish(self, record: RequestRecord, reason: FinishReason, error: NInferError | None = None) -> None:
        """Complete the response: flush held-back output (not on error), publish the one result."""
        # every path to here runs after the request's deferred row was published (its next unit's decode
        # call, the publication before any other unit, or a boundary without a unit)
        committer = self.committer
        if committer.holds(record):
            raise EngineInvariantError(
                f"request {record.request_id} ends before its committed output is published"
            )
        if reason != "error" and record.output_touched:
            try:
                tail = record.session.finish()
            except Exception as exc:  # noqa: BLE001 - a per-request output error, not the Engine's
                reason, error = "error", committer.output_error(record, "finish", exc)
            else:
                if tail.text or tail.reasoning_text or tail.tool_calls:
                    committer.publish_delta(record, tail)
        record.finish_reason = reason
        record.error = error
        record.state = RequestState.FINISHED
        self.live.pop(record.request_id, None)
        record.channel.publish(record.result())
