"""`ResourceBook`: the Program's one physical authority over its resources.

It owns the pools (StateImage slots, KV pages with reference counts, sequence indices and their handle
generations), the reservations every active sequence holds, the checkpoints published from them, the
sealed materialization plans and the one open resource transaction, and ``resource_revision``. It
knows nothing of tensors: the Program applies what the book decides (the copies a plan or a capture
needs: `Copies`) to the `StateStore` and the block tables.

Sizing (ProgramConfig, docs/resources-and-context-cache.md): ``max_sequences x slots_per_sequence`` state
slots for active sequences (the current slot of each and the spares its decode backend writes) plus
``checkpoint_slots``, and the KV pages the Program is given (its memory plan, `memory.plan_memory`: on
CUDA what the device memory leaves, on CPU per lane ``max_context / page_size`` plus the context cache's
share). The pools are shared: a checkpoint may hold slots and pages an active
request could use, and a materialization that needs them evicts it (inactive checkpoints never cause a
rejection: `Infeasible` is decided as if none existed). A reservation is complete: every page of
``prompt + max_new_tokens + extra_tokens`` positions, where ``extra_tokens`` are the positions a
speculative verify may write past the last accepted token, and all the sequence's slots.

A checkpoint holds one state slot and the pages of its positions: the full ones by reference (shared
with the sequence it came from and every sequence continued from it: a unit writes only at or past its
frontier, so none of them writes a page wholly below it) and its last, partial page as its own copy.

The host tier (``host_slots`` state slots and ``host_pages`` KV pages of host memory, none by default)
keeps inactive checkpoints the device needs room from: a victim of a plan or a capture is offloaded (its
slot and every page of its positions copied to host ids of its own, its device ids returned) when the
host has room for it, or gets room by dropping host checkpoints that come before it in the
ResourceManager's order; else it is dropped as without the tier. A plan whose source is in the host tier
restores it first (a device slot and pages for it, copied back, its host ids returned) and then continues
it as any device checkpoint; the restore's slot and pages count in the plan's need. Each move is a
`Transfer` the Program runs on its stream (offloads, then the restore, then the device copies) and a
`CheckpointPlacement` in the transition's result.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ninfer.core.pools import IndexPool, RefPool
from ninfer.runtime.contract.types import (
    Blocked,
    CheckpointEntry,
    CheckpointPlacement,
    CheckpointTier,
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
    """What one materialization takes: new KV pages and state slots (and one sequence index)."""

    pages: int
    slots: int


@dataclass
class Reservation:
    """Everything one sequence (or a started, unfinished materialization) holds."""

    handle: SequenceHandle
    slots: tuple[int, ...]
    pages: list[int] = field(default_factory=list)  # in position order (a source's full pages first)
    source: int | None = None  # the checkpoint a materialization continues (pinned until it ends)
    victims: tuple[int, ...] = ()  # checkpoints the plan dropped at start
    placed: tuple[CheckpointPlacement, ...] = ()  # checkpoints the plan moved between tiers at start


@dataclass
class Checkpoint:
    """A published checkpoint's resources: its state slot and the pages of its positions, ids in the
    pools of its tier (the device's, or the host tier's, where every page is its own)."""

    entry: CheckpointEntry
    slot: int
    pages: list[int]  # pages of positions 0..frontier-1 in order; the last one its own when partial
    pinned: int = 0  # open materializations continuing from it
    tier: CheckpointTier = "device"

    @property
    def frontier(self) -> int:
        return self.entry.frontier_tokens


@dataclass(frozen=True)
class Transfer:
    """One checkpoint's move between the device and the host tier: its state slot and its pages as
    ``(src, dst)`` ids; ``to_host``: device -> host (an offload), else host -> device (a restore)."""

    to_host: bool
    state: tuple[int, int]
    pages: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Copies:
    """Copies a transition needs, in this order: ``transfers`` (offloads, then a restore: a restore may
    write device ids an offload of the same transition reads, never the reverse), then the device
    copies: state slot ``src -> dst`` and one KV page ``src -> dst`` (the partial last page), each None
    when there is nothing to copy."""

    state: tuple[int, int] | None = None
    page: tuple[int, int] | None = None
    transfers: tuple[Transfer, ...] = ()


@dataclass(frozen=True)
class Room:
    """How a transition makes device room: device checkpoints it offloads to the host tier, and those
    it drops (device victims the host has no room for, host checkpoints dropped for others' room)."""

    offload: tuple[int, ...] = ()
    drop: tuple[int, ...] = ()


class ResourceBook:
    """Pools, reservations, checkpoints, plans, the open transaction and the revision of one Program."""

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
        checkpoint_slots: int = 0,
        slot_bytes: int = 0,
        page_bytes: int = 0,
        host_slots: int = 0,
        host_pages: int = 0,
    ) -> None:
        self.owner = owner
        self.max_sequences = max_sequences
        self.slots_per_sequence = slots_per_sequence
        self.page_size = page_size
        self.max_context = max_context
        self.extra_tokens = extra_tokens
        self.slot_bytes = slot_bytes
        self.page_bytes = page_bytes
        self.active_slots = max_sequences * slots_per_sequence
        self.slots = IndexPool(self.active_slots + checkpoint_slots, "state slot")
        self.pages = RefPool(kv_pages, "KV page")
        self.indices = IndexPool(max_sequences, "sequence index")
        # the host tier: no sharing there, every host checkpoint holds a slot and all its pages
        self.host_slots = IndexPool(host_slots if host_pages else 0, "host state slot")
        self.host_pages = IndexPool(host_pages if host_slots else 0, "host KV page")
        self._generations = [0] * max_sequences
        self._held: dict[int, Reservation] = {}  # sequence index -> its reservation (active sequences)
        self.checkpoints: dict[int, Checkpoint] = {}
        self._checkpoint_ids = itertools.count(1)
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
            kv_page_bytes=self.page_bytes,
            host_state_slots=self.host_slots.size,
            host_kv_pages=self.host_pages.size,
        )

    def usage(self, frontiers: Iterable[int], open_pending: bool) -> ResourceUsage:
        """What is held now; ``frontiers`` are the active sequences' committed frontiers (mapped pages)."""
        frontiers = list(frontiers)
        active = list(self._held.values())
        if self.open_txn is not None:
            active.append(self.open_txn.sealed)
        active_pages = {p for r in active for p in r.pages}
        device = [c for c in self.checkpoints.values() if c.tier == "device"]
        checkpoint_pages = {p for c in device for p in c.pages} - active_pages
        return ResourceUsage(
            sequences=len(frontiers),
            state_slots=sum(len(r.slots) for r in active),
            kv_pages_mapped=sum(-(-f // self.page_size) for f in frontiers),
            kv_pages_reserved=len(active_pages),
            open_transactions=int(self.open_txn is not None),
            open_pending_batches=int(open_pending),
            checkpoints=len(self.checkpoints),
            checkpoint_state_slots=len(device),
            checkpoint_kv_pages=len(checkpoint_pages),
            host_checkpoints=len(self.checkpoints) - len(device),
            host_kv_pages=self.host_pages.used_count,
        )

    # ---- planning -----------------------------------------------------------------------------
    def positions_pages(self, request: RequestPlan) -> int:
        return -(-(request.max_total_tokens + self.extra_tokens) // self.page_size)

    def need(self, request: RequestPlan, source: Checkpoint | None = None) -> Need:
        """New device pages and slots: the reservation less the source's full pages, which are shared;
        a source in the host tier adds its own restore (a slot and every page of its positions)."""
        shared = source.frontier // self.page_size if source is not None else 0
        need = Need(pages=self.positions_pages(request) - shared, slots=self.slots_per_sequence)
        if source is not None and source.tier == "host":
            need = Need(pages=need.pages + len(source.pages), slots=need.slots + 1)
        return need

    def infeasible(self, request: RequestPlan) -> Infeasible | None:
        """Why not even an empty Program (root source, every checkpoint released) could run it."""
        total = request.max_total_tokens
        if total > self.max_context:
            return Infeasible(
                f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens ({request.max_new_tokens}) = "
                f"{total} exceeds the context limit of {self.max_context} tokens; shorten the prompt or "
                "lower max_tokens"
            )
        pages = self.positions_pages(request)
        if pages > self.pages.size:
            extra = f" + {self.extra_tokens} speculative" if self.extra_tokens else ""
            size = f" ({pages * self.page_bytes / 2**30:.2f} GiB)" if self.page_bytes else ""
            pool = f" ({self.pages.size * self.page_bytes / 2**30:.2f} GiB)" if self.page_bytes else ""
            return Infeasible(
                f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens ({request.max_new_tokens})"
                f"{extra} needs {pages} KV pages of {self.page_size} positions{size}, the whole KV pool "
                f"holds {self.pages.size} pages ({self.pages.size * self.page_size} positions){pool}; lower "
                "max_tokens or shorten the prompt (the pool is sized at start: --gpu-memory-fraction)"
            )
        return None

    def plan(
        self,
        request: RequestPlan,
        candidates: Sequence[CheckpointEntry] = (),
        evictable: Sequence[CheckpointEntry] = (),
    ) -> ResourcePlan | Blocked | Infeasible:
        """Seal a plan for ``request`` at the current revision, or say why not (no side effect): the
        first candidate source it can continue from (else the root; a host-tier source restored first),
        with the fewest device checkpoints of ``evictable`` (in their order) offloaded or dropped to make
        room."""
        refusal = self.infeasible(request)
        if refusal is not None:
            return refusal
        if self.indices.free_count == 0:
            return Blocked("no free sequence slot")
        prompt_len = len(request.prompt_token_ids)
        sources: list[Checkpoint | None] = [
            self.checkpoints[c.checkpoint_id]
            for c in candidates
            if c.checkpoint_id in self.checkpoints and 0 < c.frontier_tokens < prompt_len
        ]
        sources.append(None)
        reason = ""
        for source in sources:
            need = self.need(request, source)
            keep = {source.entry.checkpoint_id} if source is not None else set()
            room = self._room(need.slots, need.pages, evictable, keep)
            if room is None:
                reason = f"{need.pages} KV pages and {need.slots} state slots needed, held by active requests"
                continue
            return ResourcePlan(
                owner=self.owner,
                resource_revision=self.revision,
                reserved=ResourceUsage(sequences=1, state_slots=need.slots, kv_pages_reserved=need.pages),
                reused_prefix_tokens=source.frontier if source is not None else 0,
                source_checkpoint=source.entry.checkpoint_id if source is not None else None,
                sealed=(request, need, room),
            )
        return Blocked(reason)

    def _room(
        self, slots: int, pages: int, evictable: Sequence[CheckpointEntry], keep: set[int]
    ) -> Room | None:
        """The shortest prefix of the device checkpoints of ``evictable`` whose leaving the device frees
        ``slots`` slots and ``pages`` pages (pages shared with what stays free nothing), each offloaded
        or dropped (`_place`); None when all of them are not enough."""
        free_slots, free_pages = self.slots.free_count, self.pages.free_count
        if free_slots >= slots and free_pages >= pages:
            return Room()
        refs: dict[int, int] = {}
        victims: list[int] = []
        for entry in evictable:
            checkpoint = self.checkpoints.get(entry.checkpoint_id)
            if checkpoint is None or checkpoint.tier != "device":
                continue
            if checkpoint.pinned or entry.checkpoint_id in keep:
                continue
            victims.append(entry.checkpoint_id)
            free_slots += 1
            for page in checkpoint.pages:
                refs[page] = refs.get(page, self.pages.refcount(page)) - 1
                if refs[page] == 0:
                    free_pages += 1
            if free_slots >= slots and free_pages >= pages:
                return self._place(victims, evictable, keep)
        return None

    def _place(self, victims: Sequence[int], evictable: Sequence[CheckpointEntry], keep: set[int]) -> Room:
        """Which device ``victims`` go to the host tier: each, in order, that fits the host's free room
        or fits it once host checkpoints that come before it in ``evictable`` (less valuable, in the
        ResourceManager's order) are dropped; the rest are dropped. A host checkpoint is dropped only
        when that makes room for a victim; those of ``keep`` (a source about to be restored) never."""
        if self.host_slots.size == 0:
            return Room(drop=tuple(victims))
        rank = {entry.checkpoint_id: i for i, entry in enumerate(evictable)}
        hosted = [
            self.checkpoints[e.checkpoint_id]
            for e in evictable
            if e.checkpoint_id in self.checkpoints
            and self.checkpoints[e.checkpoint_id].tier == "host"
            and e.checkpoint_id not in keep
        ]
        free_slots, free_pages = self.host_slots.free_count, self.host_pages.free_count
        taken = 0  # hosted[:taken] are dropped
        offload: list[int] = []
        drop: list[int] = []
        for victim in victims:
            pages = len(self.checkpoints[victim].pages)
            slots_after, pages_after, upto = free_slots, free_pages, taken
            while (slots_after < 1 or pages_after < pages) and upto < len(hosted):
                other = hosted[upto]
                if rank[other.entry.checkpoint_id] > rank[victim]:
                    break  # more valuable than the victim: it stays
                slots_after, pages_after, upto = slots_after + 1, pages_after + len(other.pages), upto + 1
            if slots_after >= 1 and pages_after >= pages:
                free_slots, free_pages, taken = slots_after - 1, pages_after - pages, upto
                offload.append(victim)
            else:
                drop.append(victim)
        dropped_host = tuple(c.entry.checkpoint_id for c in hosted[:taken])
        return Room(offload=tuple(offload), drop=dropped_host + tuple(drop))

    def _make_room(self, room: Room) -> tuple[list[Transfer], list[CheckpointPlacement]]:
        """Carry out ``room``: the drops (host ones free the host room the offloads take), then the
        offloads; returns their transfers and placements."""
        for checkpoint_id in room.drop:
            self._drop(checkpoint_id)
        transfers, placed = [], []
        for checkpoint_id in room.offload:
            transfer, placement = self._offload(checkpoint_id)
            transfers.append(transfer)
            placed.append(placement)
        return transfers, placed

    def _offload(self, checkpoint_id: int) -> tuple[Transfer, CheckpointPlacement]:
        """Move a device checkpoint to host ids of its own; its device slot and page references return."""
        checkpoint = self.checkpoints[checkpoint_id]
        if checkpoint.tier != "device" or checkpoint.pinned:
            raise ProgramInvariantError(f"offload of checkpoint {checkpoint_id} ({checkpoint.tier}, pinned)")
        slot = self.host_slots.allocate(1)[0]
        pages = self.host_pages.allocate(len(checkpoint.pages))
        transfer = Transfer(True, (checkpoint.slot, slot), tuple(zip(checkpoint.pages, pages)))
        self.slots.free([checkpoint.slot])
        self.pages.release(checkpoint.pages)
        checkpoint.slot, checkpoint.pages, checkpoint.tier = slot, pages, "host"
        nbytes = self.checkpoint_bytes(len(pages))
        return transfer, CheckpointPlacement(checkpoint_id, "host", nbytes)

    def _restore(self, checkpoint: Checkpoint) -> Transfer:
        """Move a host checkpoint back to device ids of its own; its host slot and pages return."""
        slot = self.slots.allocate(1)[0]
        pages = self.pages.allocate(len(checkpoint.pages))
        transfer = Transfer(False, (checkpoint.slot, slot), tuple(zip(checkpoint.pages, pages)))
        self.host_slots.free([checkpoint.slot])
        self.host_pages.free(checkpoint.pages)
        checkpoint.slot, checkpoint.pages, checkpoint.tier = slot, pages, "device"
        return transfer

    # ---- the transaction ----------------------------------------------------------------------
    def start(self, plan: ResourcePlan) -> tuple[RunningTransaction, Copies]:
        """Offload and drop the plan's victims, restore a host-tier source, and take the claim: a
        sequence index, its slots, its new pages and the source's full pages (shared); the copies the
        Program must make for the moves and the source."""
        if plan.owner != self.owner:
            raise ProgramInvariantError("plan from another Program")
        if plan.resource_revision != self.revision:
            raise StalePlan(f"plan sealed at revision {plan.resource_revision}, now {self.revision}")
        if self.open_txn is not None:
            raise ProgramInvariantError("a resource transaction is already open")
        request, need, room = plan.sealed
        source = self.checkpoints.get(plan.source_checkpoint) if plan.source_checkpoint is not None else None
        if plan.source_checkpoint is not None and (source is None or plan.source_checkpoint in room.drop):
            raise ProgramInvariantError(f"the plan's source checkpoint {plan.source_checkpoint} is gone")
        transfers, placed = self._make_room(room)
        if (
            self.indices.free_count == 0
            or need.slots > self.slots.free_count
            or need.pages > self.pages.free_count
        ):
            raise ProgramInvariantError("plan at the current revision is no longer feasible")
        restored = source is not None and source.tier == "host"
        if restored:
            assert source is not None
            transfers.append(self._restore(source))
        index = self.indices.allocate(1)[0]
        self._generations[index] += 1
        handle = SequenceHandle(owner=self.owner, index=index, generation=self._generations[index])
        slots = tuple(self.slots.allocate(self.slots_per_sequence))
        full = source.frontier // self.page_size if source is not None else 0
        pages = self.pages.allocate(self.positions_pages(request) - full)
        copies = Copies(transfers=tuple(transfers))
        if source is not None:
            self.pages.retain(source.pages[:full])
            pages = source.pages[:full] + pages
            partial = (source.pages[full], pages[full]) if source.frontier % self.page_size else None
            copies = Copies(state=(source.slot, slots[0]), page=partial, transfers=tuple(transfers))
            source.pinned += 1
        if restored:
            assert source is not None
            own = sum(1 for p in source.pages if self.pages.refcount(p) == 1)
            nbytes = self.checkpoint_bytes(own)
            placed.append(CheckpointPlacement(source.entry.checkpoint_id, "device", nbytes))
        claim = Reservation(handle, slots, pages, plan.source_checkpoint, room.drop, tuple(placed))
        self.revision += 1
        txn = RunningTransaction(
            owner=self.owner, transaction_id=next(self._txn_ids), plan=plan, sealed=claim
        )
        self.open_txn = txn
        return txn, copies

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
        """The claim becomes an active sequence's reservation; the source is unpinned."""
        claim = self.claim(txn)
        self._unpin(claim)
        self._held[claim.handle.index] = claim
        self.open_txn = None
        self.revision += 1
        return ResourceResult(
            kind="materialized", resource_revision=self.revision, handle=claim.handle,
            reused_prefix_tokens=txn.plan.reused_prefix_tokens, removed=claim.victims, placed=claim.placed,
        )  # fmt: skip

    def abort(self, txn: RunningTransaction) -> ResourceResult:
        """Undo the claim whole (its victims stay evicted or offloaded, a restored source stays on the
        device: the result says so)."""
        claim = self.claim(txn)
        self._unpin(claim)
        self._free(claim)
        self.open_txn = None
        self.revision += 1
        return ResourceResult(
            kind="aborted", resource_revision=self.revision, removed=claim.victims, placed=claim.placed
        )

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

    # ---- checkpoints --------------------------------------------------------------------------
    def checkpoint_bytes(self, pages: int) -> int:
        return self.slot_bytes + pages * self.page_bytes

    def capture(
        self,
        handle: SequenceHandle,
        frontier: int,
        current_slot: int,
        digest: str,
        evictable: Sequence[CheckpointEntry],
    ) -> tuple[ResourceResult, Copies]:
        """Publish an active sequence's state at ``frontier``: a new slot (the state copied into it), its
        full pages by reference and a copy of its partial last page; nothing when that does not fit even
        after offloading or evicting from ``evictable`` (in order)."""
        reservation = self.held(handle)
        full, partial = divmod(frontier, self.page_size)
        room = self._room(1, 1 if partial else 0, evictable, set())
        if room is None:
            self.revision += 1
            return ResourceResult(kind="captured", resource_revision=self.revision), Copies()
        transfers, placed = self._make_room(room)
        slot = self.slots.allocate(1)[0]
        self.pages.retain(reservation.pages[:full])
        pages = list(reservation.pages[:full])
        page_copy = None
        if partial:
            own = self.pages.allocate(1)[0]
            pages.append(own)
            page_copy = (reservation.pages[full], own)
        entry = self._publish(digest, frontier, slot, pages, shared=True)
        self.revision += 1
        result = ResourceResult(
            kind="captured", resource_revision=self.revision, published=(entry,), removed=room.drop,
            placed=tuple(placed),
        )  # fmt: skip
        return result, Copies(state=(current_slot, slot), page=page_copy, transfers=tuple(transfers))

    def retain(self, handle: SequenceHandle, frontier: int, current_slot: int, digest: str) -> ResourceResult:
        """Turn a terminal sequence into a checkpoint with no copy: its current slot and the pages of its
        positions pass to the checkpoint, the rest of its reservation returns to the pools."""
        claim = self._held.pop(handle.index)
        kept = -(-frontier // self.page_size)
        self.slots.free([s for s in claim.slots if s != current_slot])
        self.pages.release(claim.pages[kept:])
        self.indices.free([handle.index])
        entry = self._publish(digest, frontier, current_slot, claim.pages[:kept], shared=True)
        self.revision += 1
        return ResourceResult(
            kind="retained", resource_revision=self.revision, handle=handle, published=(entry,)
        )

    def evict(self, checkpoint_ids: Sequence[int]) -> ResourceResult:
        for checkpoint_id in checkpoint_ids:
            checkpoint = self.checkpoints.get(checkpoint_id)
            if checkpoint is None:
                raise ProgramInvariantError(f"evict of unknown checkpoint {checkpoint_id}")
            if checkpoint.pinned:
                raise ProgramInvariantError(
                    f"evict of checkpoint {checkpoint_id} while a materialization uses it"
                )
        for checkpoint_id in checkpoint_ids:
            self._drop(checkpoint_id)
        self.revision += 1
        return ResourceResult(kind="evicted", resource_revision=self.revision, removed=tuple(checkpoint_ids))

    def _publish(
        self, digest: str, frontier: int, slot: int, pages: list[int], *, shared: bool
    ) -> CheckpointEntry:
        own = sum(1 for p in pages if self.pages.refcount(p) == 1)
        entry = CheckpointEntry(
            checkpoint_id=next(self._checkpoint_ids), prefix_digest=digest, frontier_tokens=frontier,
            shared=shared, nbytes=self.checkpoint_bytes(own),
        )  # fmt: skip
        self.checkpoints[entry.checkpoint_id] = Checkpoint(entry, slot, pages)
        return entry

    def _drop(self, checkpoint_id: int) -> None:
        checkpoint = self.checkpoints.pop(checkpoint_id)
        if checkpoint.tier == "host":
            self.host_slots.free([checkpoint.slot])
            self.host_pages.free(checkpoint.pages)
        else:
            self.slots.free([checkpoint.slot])
            self.pages.release(checkpoint.pages)

    def _unpin(self, claim: Reservation) -> None:
        if claim.source is not None and claim.source in self.checkpoints:
            self.checkpoints[claim.source].pinned -= 1

    def _free(self, claim: Reservation) -> None:
        self.slots.free(claim.slots)
        self.pages.release(claim.pages)
        self.indices.free([claim.handle.index])

    # ---- backfill ------------------------------------------------------------------------------
    def proves_backfill(
        self, head: RequestPlan, donors: Sequence[SequenceHandle], borrower: RequestPlan
    ) -> bool:
        """While ``borrower`` holds its complete reservation, the end of ``donors`` alone, with every
        checkpoint released, leaves room for ``head`` from the root source (no timing assumption)."""
        if self.infeasible(head) is not None or self.infeasible(borrower) is not None:
            return False
        donor_indices = {d.index for d in donors}
        staying = [r for i, r in self._held.items() if i not in donor_indices]
        if self.open_txn is not None:
            staying.append(self.open_txn.sealed)
        pages_held = len({p for r in staying for p in r.pages}) + self.positions_pages(borrower)
        slots_held = sum(len(r.slots) for r in staying) + self.slots_per_sequence
        sequences_held = len(staying) + 1
        return (
            sequences_held + 1 <= self.max_sequences
            and slots_held + self.slots_per_sequence <= self.slots.size
            and pages_held + self.positions_pages(head) <= self.pages.size
        )
