"""`ResourceBook`: the Program's one physical authority over its resources.

It owns the pools (StateImage slots, KV pages with reference counts, sequence indices and their handle
generations), the reservations every active sequence holds, the sealed materialization plans and the
one open resource transaction, and ``resource_revision``. It knows nothing of tensors: the Program
applies what the book decides to the `StateStore` and the block tables.

Sizing (ProgramConfig, docs/paged-kv.md): ``max_sequences x slots_per_sequence`` state slots (the
current slot of each sequence plus the spares its decode backend writes), and the KV pages the Program
is given (by default ``max_context / page_size`` per lane, so ``max_sequences`` requests at full context
always fit). A reservation is complete: every page of ``prompt + max_new_tokens + extra_tokens``
positions, where ``extra_tokens`` are the positions a speculative verify may write past the last
accepted token, and all the sequence's slots. Pages are reference counted so that published
checkpoints can share them with the sequences materialized from them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from ninfer.core.pools import IndexPool, RefPool
from ninfer.runtime.contract.types import (
    Blocked,
    CheckpointEntry,
    Infeasible,
    ProgramInvariantError,
    RequestPlan,
    ResourceCapacity,
    ResourcePlan,
    ResourceResult,
    ResourceUsage,
    RunningTransaction,
    SequenceHandle,
    StalePlan,
)


@dataclass(frozen=True)
class Need:
    """What one materialization takes: KV pages and state slots (and one sequence index)."""

    pages: int
    slots: int


@dataclass
class Reservation:
    """Everything one sequence (or a started, unfinished materialization) holds."""

    handle: SequenceHandle
    slots: tuple[int, ...]
    pages: list[int] = field(default_factory=list)  # in position order


class ResourceBook:
    """Pools, reservations, plans, the open transaction and the revision of one Program."""

    def __init__(
        self,
        *,
        owner: int,
        max_sequences: int,
        slots_per_sequence: int,
        kv_pages: int,
        page_size: int,
        max_context: int,
        extra_tokens: int = 0,
    ) -> None:
        self.owner = owner
        self.max_sequences = max_sequences
        self.slots_per_sequence = slots_per_sequence
        self.page_size = page_size
        self.max_context = max_context
        self.extra_tokens = extra_tokens
        self.slots = IndexPool(max_sequences * slots_per_sequence, "state slot")
        self.pages = RefPool(kv_pages, "KV page")
        self.indices = IndexPool(max_sequences, "sequence index")
        self._generations = [0] * max_sequences
        self._held: dict[int, Reservation] = {}  # sequence index -> its reservation (active sequences)
        self.revision = 0
        self._txn_ids = itertools.count(1)
        self.open_txn: RunningTransaction | None = None

    # ---- static facts and usage -----------------------------------------------------------------
    @property
    def max_pages_per_sequence(self) -> int:
        """The block-table width: pages of the longest reservation."""
        return -(-(self.max_context + self.extra_tokens) // self.page_size)

    def capacity(self) -> ResourceCapacity:
        return ResourceCapacity(
            max_sequences=self.max_sequences,
            state_slots=self.slots.size,
            kv_pages=self.pages.size,
            page_size=self.page_size,
            max_context=self.max_context,
        )

    def usage(self, frontiers: Iterable[int], open_pending: bool) -> ResourceUsage:
        """What is held now; ``frontiers`` are the active sequences' committed frontiers (mapped pages)."""
        frontiers = list(frontiers)
        return ResourceUsage(
            sequences=len(frontiers),
            state_slots=self.slots.used_count,
            kv_pages_mapped=sum(-(-f // self.page_size) for f in frontiers),
            kv_pages_reserved=self.pages.used_count,
            open_transactions=int(self.open_txn is not None),
            open_pending_batches=int(open_pending),
        )

    # ---- planning -----------------------------------------------------------------------------
    def need(self, request: RequestPlan) -> Need:
        positions = request.max_total_tokens + self.extra_tokens
        return Need(pages=-(-positions // self.page_size), slots=self.slots_per_sequence)

    def plan(
        self, request: RequestPlan, candidates: Iterable[CheckpointEntry] = ()
    ) -> ResourcePlan | Blocked | Infeasible:
        """Seal a plan for ``request`` at the current revision, or say why not (no side effect)."""
        total = request.max_total_tokens
        if total > self.max_context:
            return Infeasible(
                f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens ({request.max_new_tokens}) = "
                f"{total} exceeds the context limit of {self.max_context} tokens; shorten the prompt or "
                "lower max_tokens"
            )
        need = self.need(request)
        if need.pages > self.pages.size:
            return Infeasible(
                f"needs {need.pages * self.page_size} KV positions, the KV pool holds "
                f"{self.pages.size * self.page_size}; lower max_tokens"
            )
        if self.indices.free_count == 0 or need.slots > self.slots.free_count:
            return Blocked("no free sequence slot")
        if need.pages > self.pages.free_count:
            return Blocked(f"{need.pages} KV pages needed, {self.pages.free_count} free")
        return ResourcePlan(
            owner=self.owner,
            resource_revision=self.revision,
            reserved=ResourceUsage(sequences=1, state_slots=need.slots, kv_pages_reserved=need.pages),
            sealed=(request, need),
        )

    # ---- the transaction ----------------------------------------------------------------------
    def start(self, plan: ResourcePlan) -> RunningTransaction:
        """Take the plan's claim: a sequence index, its slots and its pages."""
        if plan.owner != self.owner:
            raise ProgramInvariantError("plan from another Program")
        if plan.resource_revision != self.revision:
            raise StalePlan(f"plan sealed at revision {plan.resource_revision}, now {self.revision}")
        if self.open_txn is not None:
            raise ProgramInvariantError("a resource transaction is already open")
        need: Need = plan.sealed[1]
        if (
            self.indices.free_count == 0
            or need.slots > self.slots.free_count
            or need.pages > self.pages.free_count
        ):
            raise ProgramInvariantError("plan at the current revision is no longer feasible")
        index = self.indices.allocate(1)[0]
        self._generations[index] += 1
        handle = SequenceHandle(owner=self.owner, index=index, generation=self._generations[index])
        claim = Reservation(handle, tuple(self.slots.allocate(need.slots)), self.pages.allocate(need.pages))
        self.revision += 1
        txn = RunningTransaction(
            owner=self.owner, transaction_id=next(self._txn_ids), plan=plan, sealed=claim
        )
        self.open_txn = txn
        return txn

    @staticmethod
    def request(txn: RunningTransaction) -> RequestPlan:
        """The request a transaction materializes."""
        return txn.plan.sealed[0]

    def claim(self, txn: RunningTransaction) -> Reservation:
        """The open transaction's claim (checked)."""
        if txn is not self.open_txn:
            raise ProgramInvariantError(f"transaction {txn.transaction_id} is not the open one")
        return txn.sealed

    def finish(self, txn: RunningTransaction) -> ResourceResult:
        """The claim becomes an active sequence's reservation."""
        claim = self.claim(txn)
        self._held[claim.handle.index] = claim
        self.open_txn = None
        self.revision += 1
        return ResourceResult(kind="materialized", resource_revision=self.revision, handle=claim.handle)

    def abort(self, txn: RunningTransaction) -> ResourceResult:
        """Undo the claim whole."""
        claim = self.claim(txn)
        self._free(claim)
        self.open_txn = None
        self.revision += 1
        return ResourceResult(kind="aborted", resource_revision=self.revision)

    def release(self, handle: SequenceHandle) -> ResourceResult:
        """Return an active sequence's whole reservation."""
        claim = self._held.pop(handle.index)
        self._free(claim)
        self.revision += 1
        return ResourceResult(kind="released", resource_revision=self.revision, handle=handle)

    def held(self, handle: SequenceHandle) -> Reservation:
        reservation = self._held.get(handle.index) if handle.owner == self.owner else None
        if reservation is None or reservation.handle.generation != handle.generation:
            raise ProgramInvariantError(f"stale or foreign sequence handle {handle}")
        return reservation

    def _free(self, claim: Reservation) -> None:
        self.slots.free(claim.slots)
        self.pages.release(claim.pages)
        self.indices.free([claim.handle.index])
