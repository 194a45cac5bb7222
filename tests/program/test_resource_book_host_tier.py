"""`ResourceBook`'s host tier: a victim the device needs room from is offloaded when the host has room,
a plan from a host checkpoint restores it first and counts the restore in its need, a restore that does
not fit falls back to a shorter source or the root, the host's own eviction follows the
ResourceManager's order, and every pool of both tiers returns to its baseline."""

from __future__ import annotations

from ninfer.runtime.contract.types import (
    CheckpointEntry,
    CheckpointPlacement,
    LogprobParams,
    RequestPlan,
    ResourcePlan,
    SamplingParams,
)
from ninfer.targets.qwen3_6.impl.runtime.resources import ResourceBook

PAGE = 8


def _request(prompt: int, new: int, first: int = 0) -> RequestPlan:
    return RequestPlan(tuple(range(first, first + prompt)), new, SamplingParams(seed=1), LogprobParams(), "d")


def _book(
    *, pages: int = 8, checkpoint_slots: int = 1, host_slots: int = 2, host_pages: int = 16
) -> ResourceBook:
    return ResourceBook(
        owner=3, max_sequences=1, slots_per_sequence=2, kv_pages=pages, page_size=PAGE, max_context=64,
        checkpoint_slots=checkpoint_slots, slot_bytes=1000, page_bytes=10, host_slots=host_slots,
        host_pages=host_pages,
    )  # fmt: skip


def _retained(book: ResourceBook, prompt: int, new: int, frontier: int, digest: str) -> CheckpointEntry:
    """Run a request from the root and retain it at ``frontier``: its checkpoint."""
    plan = book.plan(_request(prompt, new))
    assert isinstance(plan, ResourcePlan)
    txn, _ = book.start(plan)
    handle = book.finish(txn).handle
    assert handle is not None
    current = book.held(handle).slots[0]
    (entry,) = book.retain(handle, frontier, current, digest).published
    return entry


def _baseline(book: ResourceBook) -> None:
    book.evict(list(book.checkpoints))
    assert book.slots.free_count == book.slots.size and book.pages.free_count == book.pages.size
    assert book.host_slots.free_count == book.host_slots.size
    assert book.host_pages.free_count == book.host_pages.size
    assert book.indices.free_count == book.indices.size


def test_a_victim_with_host_room_is_offloaded_not_dropped() -> None:
    book = _book()
    entry = _retained(book, 20, 8, 20, "a")  # 3 pages (the last partial), 1 slot
    revision = book.revision
    # a request of 64 positions needs every device page: the checkpoint must leave the device
    plan = book.plan(_request(40, 24, first=100), (), [entry])
    assert isinstance(plan, ResourcePlan) and plan.source_checkpoint is None
    txn, copies = book.start(plan)
    (transfer,) = copies.transfers
    assert transfer.to_host and len(transfer.pages) == 3
    checkpoint = book.checkpoints[entry.checkpoint_id]
    assert checkpoint.tier == "host" and checkpoint.slot == transfer.state[1]
    assert book.host_slots.used_count == 1 and book.host_pages.used_count == 3
    result = book.finish(txn)
    assert result.removed == () and result.resource_revision > revision
    assert result.placed == (CheckpointPlacement(entry.checkpoint_id, "host", 1000 + 3 * 10),)
    usage = book.usage([0], False)
    assert (usage.checkpoints, usage.host_checkpoints, usage.checkpoint_state_slots) == (1, 1, 0)
    assert usage.host_kv_pages == 3
    book.release(result.handle)  # type: ignore[arg-type]
    _baseline(book)


def test_a_plan_from_a_host_checkpoint_restores_it_and_counts_the_restore() -> None:
    book = _book(pages=10)
    entry = _retained(book, 20, 8, 20, "a")
    plan = book.plan(_request(40, 24, first=100), (), [entry])  # pushes it to the host
    assert isinstance(plan, ResourcePlan)
    txn, _ = book.start(plan)
    book.release(book.finish(txn).handle)  # type: ignore[arg-type]
    assert book.checkpoints[entry.checkpoint_id].tier == "host"
    # the prompt continues the checkpoint: restore (1 slot, 3 pages) + the sequence (2 slots, 4 - 2 pages)
    request = _request(30, 2)
    plan = book.plan(request, [entry], [entry])
    assert isinstance(plan, ResourcePlan) and plan.source_checkpoint == entry.checkpoint_id
    assert plan.reused_prefix_tokens == 20
    assert (plan.reserved.state_slots, plan.reserved.kv_pages_reserved) == (3, 4 - 2 + 3)
    txn, copies = book.start(plan)
    (restore,) = copies.transfers
    assert not restore.to_host and len(restore.pages) == 3
    checkpoint = book.checkpoints[entry.checkpoint_id]
    assert checkpoint.tier == "device" and checkpoint.pinned == 1
    assert copies.state == (checkpoint.slot, txn.sealed.slots[0])  # then continued as a device source
    assert copies.page == (checkpoint.pages[2], txn.sealed.pages[2])  # its partial page copied
    assert txn.sealed.pages[:2] == checkpoint.pages[:2]  # the full ones shared
    assert book.host_slots.used_count == 0 and book.host_pages.used_count == 0
    result = book.finish(txn)
    assert [(p.checkpoint_id, p.tier) for p in result.placed] == [(entry.checkpoint_id, "device")]
    assert result.placed[0].nbytes == 1000 + 10  # the partial page alone is its own
    book.release(result.handle)  # type: ignore[arg-type]
    _baseline(book)


def test_a_restore_that_does_not_fit_falls_back_to_the_root() -> None:
    # no checkpoint slot: the restore's slot is held by the lanes' while the request runs
    book = _book(checkpoint_slots=0)
    entry = _retained(book, 20, 8, 20, "a")  # the retained turn keeps its lane slot
    plan = book.plan(_request(40, 24, first=100), (), [entry])
    assert isinstance(plan, ResourcePlan)
    txn, _ = book.start(plan)
    book.release(book.finish(txn).handle)  # type: ignore[arg-type]
    assert book.checkpoints[entry.checkpoint_id].tier == "host"
    plan = book.plan(_request(30, 2), [entry], [entry])
    assert isinstance(plan, ResourcePlan) and plan.source_checkpoint is None  # cold, not a failure
    txn, copies = book.start(plan)
    assert copies.transfers == () and book.checkpoints[entry.checkpoint_id].tier == "host"
    book.abort(txn)
    _baseline(book)


def test_the_host_tier_drops_only_what_is_less_valuable_than_the_victim() -> None:
    # the host holds one checkpoint: a victim may take its place only if it comes after it in the order
    book = _book(pages=16, checkpoint_slots=0, host_slots=1)  # a checkpoint keeps a lane's slot
    a = _retained(book, 20, 8, 20, "a")
    plan = book.plan(_request(60, 4, first=100), (), [a])  # a must leave: offloaded
    txn, _ = book.start(plan)  # type: ignore[arg-type]
    book.release(book.finish(txn).handle)  # type: ignore[arg-type]
    b = _retained(book, 16, 4, 16, "b")
    assert book.checkpoints[a.checkpoint_id].tier == "host"
    # order [b, a]: a is more valuable than the victim b, so b is dropped and a stays
    plan = book.plan(_request(60, 4, first=200), (), [b, a])
    txn, copies = book.start(plan)  # type: ignore[arg-type]
    result = book.finish(txn)
    assert copies.transfers == () and result.removed == (b.checkpoint_id,) and result.placed == ()
    assert book.checkpoints[a.checkpoint_id].tier == "host"
    book.release(result.handle)  # type: ignore[arg-type]
    c = _retained(book, 16, 4, 16, "c")
    # order [a, c]: a is less valuable, so it is dropped from the host for c
    plan = book.plan(_request(60, 4, first=300), (), [a, c])
    txn, copies = book.start(plan)  # type: ignore[arg-type]
    result = book.finish(txn)
    assert result.removed == (a.checkpoint_id,)
    assert [(p.checkpoint_id, p.tier) for p in result.placed] == [(c.checkpoint_id, "host")]
    assert book.checkpoints[c.checkpoint_id].tier == "host" and a.checkpoint_id not in book.checkpoints
    book.release(result.handle)  # type: ignore[arg-type]
    _baseline(book)


def test_a_capture_offloads_its_victims() -> None:
    book = _book(pages=12)
    a = _retained(book, 20, 8, 20, "a")  # one lane slot + ...
    plan = book.plan(_request(30, 2, first=100), (), [a])
    txn, _ = book.start(plan)  # type: ignore[arg-type]
    handle = book.finish(txn).handle
    assert handle is not None
    # slots: 2 lane + 1 checkpoint, a holds one, the sequence two: a capture needs a's slot
    current = book.held(handle).slots[0]
    result, copies = book.capture(handle, 16, current, "c", [a])
    assert [(p.checkpoint_id, p.tier) for p in result.placed] == [(a.checkpoint_id, "host")]
    assert result.published and result.removed == ()
    (transfer,) = copies.transfers
    assert transfer.to_host and copies.state is not None
    book.release(handle)
    _baseline(book)


def test_no_host_tier_without_both_slots_and_pages() -> None:
    book = _book(host_slots=2, host_pages=0)
    assert book.host_slots.size == 0 and book.host_pages.size == 0
    entry = _retained(book, 20, 8, 20, "a")
    plan = book.plan(_request(40, 24, first=100), (), [entry])
    txn, copies = book.start(plan)  # type: ignore[arg-type]
    result = book.finish(txn)
    assert result.removed == (entry.checkpoint_id,) and result.placed == () and copies.transfers == ()
