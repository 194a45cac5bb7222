"""ResourceManager: logical lanes, the checkpoint catalog, and adoption of Program ResourceResults.

It decides logical cache policy (which candidates to offer, retain or release at finish) and keeps the
logical view of every transition; it never mirrors bytes, page counts or allocator free space, which the
Program alone owns. Every physical change reaches it as one complete ``ResourceResult`` that it adopts
whole, or the adoption invariant is broken and the Engine fails.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from ninfer.runtime.contract.types import (
    Blocked,
    CheckpointEntry,
    Infeasible,
    Program,
    ResourcePlan,
    ResourceResult,
    RunningTransaction,
)
from ninfer.runtime.engine.request_record import RequestRecord

TerminalChoice = Literal["retain", "release"]


class EngineInvariantError(RuntimeError):
    """The Engine's own bookkeeping (or a component's contract) broke: fail the whole Engine."""


class LaneState(enum.Enum):
    FREE = "free"
    MATERIALIZING = "materializing"
    ACTIVE = "active"
    TERMINAL_PENDING = "terminal_pending"


@dataclass
class Lane:
    """A long-lived active-request position. Not a state slot, KV row or batch row."""

    index: int
    state: LaneState = LaneState.FREE
    request_id: int | None = None


class ResourceManager:
    """Lanes (Free -> Materializing -> Active -> TerminalPending -> Free), the catalog, the one transition."""

    def __init__(self, program: Program, lanes: int) -> None:
        self._program = program
        self.lanes = [Lane(i) for i in range(lanes)]
        self.catalog: dict[int, CheckpointEntry] = {}  # checkpoint_id -> entry (empty until the cache)
        self.transition: RequestRecord | None = None  # owner of the one open global transition
        self.adopted: list[ResourceResult] = []  # adoption log (bounded by tests; diagnostics)
        self.resource_revision = program.resource_revision

    # ---- lanes ----
    def free_lane(self) -> Lane | None:
        return next((lane for lane in self.lanes if lane.state is LaneState.FREE), None)

    def lane_of(self, record: RequestRecord) -> Lane:
        if record.lane is None:
            raise EngineInvariantError(f"request {record.request_id} holds no lane")
        lane = self.lanes[record.lane]
        if lane.request_id != record.request_id:
            raise EngineInvariantError(
                f"lane {lane.index} belongs to {lane.request_id}, not {record.request_id}"
            )
        return lane

    def _move(self, lane: Lane, expect: LaneState, to: LaneState) -> None:
        if lane.state is not expect:
            raise EngineInvariantError(f"lane {lane.index} is {lane.state.value}, expected {expect.value}")
        lane.state = to
        if to is LaneState.FREE:
            lane.request_id = None

    # ---- cache policy (empty catalog today) ----
    def candidates_for(self, record: RequestRecord) -> tuple[CheckpointEntry, ...]:
        """Checkpoint sources to offer the Program for this request, best first (none until the cache)."""
        return tuple(e for e in self.catalog.values() if e.prefix_digest == record.plan.content_digest)

    # ---- materialization ----
    def plan(self, record: RequestRecord) -> ResourcePlan | Blocked | Infeasible:
        return self._program.plan_materialization(record.plan, self.candidates_for(record))

    def begin(self, record: RequestRecord, plan: ResourcePlan) -> None:
        """Claim a lane and start the transaction (``StalePlan`` propagates with nothing claimed)."""
        if self.transition is not None:
            raise EngineInvariantError("a second global resource transition while one is open")
        lane = self.free_lane()
        if lane is None:
            raise EngineInvariantError("admission without a free lane")
        txn: RunningTransaction = self._program.start(plan)
        self._move(lane, LaneState.FREE, LaneState.MATERIALIZING)
        lane.request_id = record.request_id
        record.lane = lane.index
        record.txn = txn
        self.transition = record

    def transition_ready(self) -> bool:
        assert self.transition is not None and self.transition.txn is not None
        return self._program.poll(self.transition.txn)

    def complete(self, record: RequestRecord) -> ResourceResult:
        """Finish the open transaction and adopt it: the lane becomes Active."""
        txn = self._open_transaction(record)
        result = self._program.finish(txn)
        self._end_transition(record)
        if result.kind != "materialized" or result.handle is None:
            raise EngineInvariantError(f"finish returned {result.kind} without a sequence handle")
        prompt_len = len(record.plan.prompt_token_ids)
        if not 0 <= result.reused_prefix_tokens < prompt_len:
            raise EngineInvariantError(
                f"reused_prefix_tokens {result.reused_prefix_tokens} outside [0, {prompt_len})"
            )
        self._adopt(result)
        self._move(self.lane_of(record), LaneState.MATERIALIZING, LaneState.ACTIVE)
        record.handle = result.handle
        record.reused_prefix_tokens = result.reused_prefix_tokens
        return result

    def abort(self, record: RequestRecord) -> ResourceResult:
        """Abort the open transaction and adopt its complete result: the lane becomes Free."""
        txn = self._open_transaction(record)
        result = self._program.abort(txn)
        self._end_transition(record)
        if result.kind != "aborted":
            raise EngineInvariantError(f"abort returned {result.kind}")
        self._adopt(result)
        self._move(self.lane_of(record), LaneState.MATERIALIZING, LaneState.FREE)
        record.lane = None
        return result

    def _open_transaction(self, record: RequestRecord) -> RunningTransaction:
        if self.transition is not record or record.txn is None:
            raise EngineInvariantError(f"request {record.request_id} owns no open transition")
        return record.txn

    def _end_transition(self, record: RequestRecord) -> None:
        """The Program ended the transaction: only now does the Engine stop tracking it (if finish or
        abort raised, failure cleanup still finds it open and aborts it)."""
        self.transition = None
        record.txn = None

    # ---- terminal ----
    def enter_terminal(self, record: RequestRecord) -> None:
        self._move(self.lane_of(record), LaneState.ACTIVE, LaneState.TERMINAL_PENDING)

    def terminal_choice(self, record: RequestRecord) -> TerminalChoice:
        """The terminal policy: retain the finished sequence as a checkpoint, or release it. Release
        until the context cache exists (issue: prefix and session reuse)."""
        return "release"

    def settle_terminal(self, record: RequestRecord) -> ResourceResult:
        """The terminal resource transition of a TerminalPending request: the policy's choice, carried
        out by the Program, its complete result adopted; the lane becomes Free."""
        handle = record.handle
        if handle is None:
            raise EngineInvariantError(f"request {record.request_id} has no sequence to release")
        choice = self.terminal_choice(record)
        result = self._program.release(handle)
        if result.kind != "released" or result.handle != handle:
            raise EngineInvariantError(f"the terminal {choice} returned {result.kind} for {result.handle}")
        self._adopt(result)
        self._move(self.lane_of(record), LaneState.TERMINAL_PENDING, LaneState.FREE)
        record.lane = None
        record.handle = None
        return result

    # ---- adoption ----
    def _adopt(self, result: ResourceResult) -> None:
        for checkpoint_id in result.removed:
            if self.catalog.pop(checkpoint_id, None) is None:
                raise EngineInvariantError(f"result removes unknown checkpoint {checkpoint_id}")
        for entry in result.published:
            if entry.checkpoint_id in self.catalog:
                raise EngineInvariantError(f"checkpoint {entry.checkpoint_id} published twice")
            self.catalog[entry.checkpoint_id] = entry
        if result.resource_revision < self.resource_revision:
            raise EngineInvariantError("resource_revision went backwards")
        self.resource_revision = result.resource_revision
        self.adopted.append(result)
        if len(self.adopted) > 64:
            del self.adopted[:32]

    def clear(self) -> None:
        """Forget every logical claim (Engine failure cleanup, after the Program was cleaned)."""
        for lane in self.lanes:
            lane.state = LaneState.FREE
            lane.request_id = None
        self.catalog.clear()
        self.transition = None
