"""ResourceManager: logical lanes, the context cache's catalog and policy, and adoption of Program results.

It decides logical cache policy (which candidates to offer, where to capture, retain or release at the
end, which checkpoints to give up first) and keeps the logical view of every transition; it never
mirrors bytes, page counts or allocator free space, which the Program alone owns. Every physical change
reaches it as one complete ``ResourceResult`` that it adopts whole, or the adoption invariant is broken
and the Engine fails. The catalog itself is `context_cache.ContextCache`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from ninfer.runtime.contract.types import (
    Blocked,
    CheckpointProgram,
    Infeasible,
    Program,
    ResourcePlan,
    ResourceResult,
    RunningTransaction,
)
from ninfer.runtime.engine.context_cache import ContextCache
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
    """Lanes (Free -> Materializing -> Active -> TerminalPending -> Free), the catalog, the one transition.

    ``prefix_cache`` turns the context cache on (a Program without the checkpoint capability has none);
    ``capture_interval``: prompt tokens between two captures of a long prompt."""

    def __init__(
        self, program: Program, lanes: int, *, prefix_cache: bool = False, capture_interval: int = 8192
    ) -> None:
        self._program = program
        self.lanes = [Lane(i) for i in range(lanes)]
        checkpoints = program if isinstance(program, CheckpointProgram) else None
        self._checkpoints = checkpoints if prefix_cache else None
        self.cache = ContextCache(
            enabled=self._checkpoints is not None,
            salt=checkpoints.prefix_salt if checkpoints is not None else "",
            capture_interval=capture_interval,
        )
        self.transition: RequestRecord | None = None  # owner of the one open global transition
        self.adopted: list[ResourceResult] = []  # adoption log (bounded by tests; diagnostics)
        self.resource_revision = program.resource_revision

    @property
    def catalog(self) -> dict[int, object]:
        return {checkpoint_id: cached.entry for checkpoint_id, cached in self.cache.entries.items()}

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

    # ---- materialization ----
    def plan(self, record: RequestRecord) -> ResourcePlan | Blocked | Infeasible:
        """The Program's plan for the head: the sources its prompt can continue, and the checkpoints it
        may evict, least valuable first."""
        cache = self.cache
        if not cache.enabled:
            return self._program.plan_materialization(record.plan)
        candidates = cache.candidates(record)
        return self._program.plan_materialization(record.plan, candidates, cache.evictable())

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
        if result.reused_prefix_tokens and txn.plan.source_checkpoint not in self.cache.entries:
            raise EngineInvariantError(f"materialized from unknown checkpoint {txn.plan.source_checkpoint}")
        self._adopt(result, record)
        source = txn.plan.source_checkpoint
        if result.reused_prefix_tokens and source is not None and self.cache.tier(source) != "device":
            raise EngineInvariantError(f"materialized from checkpoint {source} left in the host tier")
        self._move(self.lane_of(record), LaneState.MATERIALIZING, LaneState.ACTIVE)
        record.handle = result.handle
        record.reused_prefix_tokens = result.reused_prefix_tokens
        self.cache.admitted(record, txn.plan.source_checkpoint, result.reused_prefix_tokens)
        record.capture_points = self.cache.capture_points(record, result.reused_prefix_tokens)
        return result

    def abort(self, record: RequestRecord) -> ResourceResult:
        """Abort the open transaction and adopt its complete result: the lane becomes Free."""
        txn = self._open_transaction(record)
        result = self._program.abort(txn)
        self._end_transition(record)
        if result.kind != "aborted":
            raise EngineInvariantError(f"abort returned {result.kind}")
        self._adopt(result, record)
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

    # ---- capture ----
    def capture(self, record: RequestRecord) -> bool:
        """An active-checkpoint transition at the request's frontier (a capture point of its prompt);
        skipped while another transition is open. Returns whether a checkpoint was published."""
        if self._checkpoints is None or self.transition is not None or record.handle is None:
            return False
        result = self._checkpoints.capture(record.handle, self.cache.evictable())
        if result.kind != "captured":
            raise EngineInvariantError(f"capture returned {result.kind}")
        self._adopt(result, record)
        return bool(result.published)

    # ---- terminal ----
    def enter_terminal(self, record: RequestRecord) -> None:
        self._move(self.lane_of(record), LaneState.ACTIVE, LaneState.TERMINAL_PENDING)

    def terminal_choice(self, record: RequestRecord) -> TerminalChoice:
        """Retain a turn that ended normally and whose output the history renderer reproduces (the
        Frontend's boundary at its end), while no other transition is open; release everything else
        (cancelled, failed, unreproducible turns): never a checkpoint from a cancelled or incomplete state."""
        if (
            self._checkpoints is not None
            and self.cache.uses_cache(record)
            and self.transition is None
            and record.finish_reason in ("stop", "length")
            and record.output_error is None
            and record.output_reproducible
        ):
            return "retain"
        return "release"

    def settle_terminal(self, record: RequestRecord) -> ResourceResult:
        """The terminal resource transition of a TerminalPending request: the policy's choice, carried
        out by the Program (a retain it cannot complete ends as a release), its complete result adopted;
        the lane becomes Free."""
        handle = record.handle
        if handle is None:
            raise EngineInvariantError(f"request {record.request_id} has no sequence to release")
        choice = self.terminal_choice(record)
        if choice == "retain":
            assert self._checkpoints is not None
            result = self._checkpoints.retain(handle, self.cache.evictable())
        else:
            result = self._program.release(handle)
        if result.kind not in ("retained", "released") or result.handle != handle:
            raise EngineInvariantError(f"the terminal {choice} returned {result.kind} for {result.handle}")
        if result.kind == "retained" and (choice != "retain" or len(result.published) != 1):
            raise EngineInvariantError("a retain publishes exactly one checkpoint")
        self._adopt(result, record, private=record.session_id is not None)
        self._move(self.lane_of(record), LaneState.TERMINAL_PENDING, LaneState.FREE)
        record.lane = None
        record.handle = None
        return result

    # ---- eviction ----
    def evict_all(self) -> int:
        """A placement transition that removes every inactive checkpoint (a cache reset); returns how
        many. Skipped (0) while another transition is open."""
        if self._checkpoints is None or self.transition is not None or not self.cache.entries:
            return 0
        result = self._checkpoints.evict(self.cache.all_ids())
        if result.kind != "evicted":
            raise EngineInvariantError(f"evict returned {result.kind}")
        self._adopt(result)
        return len(result.removed)

    # ---- adoption ----
    def _adopt(
        self, result: ResourceResult, record: RequestRecord | None = None, *, private: bool = False
    ) -> None:
        for checkpoint_id in result.removed:
            if checkpoint_id not in self.cache.entries:
                raise EngineInvariantError(f"result removes unknown checkpoint {checkpoint_id}")
        for entry in result.published:
            if entry.checkpoint_id in self.cache.entries:
                raise EngineInvariantError(f"checkpoint {entry.checkpoint_id} published twice")
        moved = [p.checkpoint_id for p in result.placed]
        if len(set(moved)) != len(moved) or set(moved) & set(result.removed):
            raise EngineInvariantError(f"result places checkpoints twice or places removed ones: {moved}")
        for placement in result.placed:
            cached = self.cache.entries.get(placement.checkpoint_id)
            if cached is None:
                raise EngineInvariantError(f"result places unknown checkpoint {placement.checkpoint_id}")
            if placement.tier not in ("device", "host") or placement.tier == cached.tier:
                raise EngineInvariantError(
                    f"checkpoint {placement.checkpoint_id} placed in {placement.tier!r} from {cached.tier!r}"
                )
        if (result.published or result.removed or result.placed) and not self.cache.enabled:
            raise EngineInvariantError("a checkpoint change without the context cache")
        if result.resource_revision < self.resource_revision:
            raise EngineInvariantError("resource_revision went backwards")
        self.cache.adopt(result, record, private=private)
        self.resource_revision = result.resource_revision
        self.adopted.append(result)
        if len(self.adopted) > 64:
            del self.adopted[:32]

    def clear(self) -> None:
        """Forget every logical claim (Engine failure cleanup, after the Program was cleaned)."""
        for lane in self.lanes:
            lane.state = LaneState.FREE
            lane.request_id = None
        self.cache.clear()
        self.transition = None
