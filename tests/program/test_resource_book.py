"""`RefPool` and `ResourceBook`: reference counts, complete reservations, sealed plans and the one
transaction, the revision, and every pool back at its baseline."""

from __future__ import annotations

import pytest

from ninfer.core.pools import PoolError, RefPool
from ninfer.runtime.contract.types import (
    Blocked,
    Infeasible,
    LogprobParams,
    ProgramInvariantError,
    RequestPlan,
    ResourcePlan,
    SamplingParams,
    StalePlan,
)
from ninfer.targets.qwen3_6.impl.runtime.resources import ResourceBook


def test_refpool_shares_ids_until_the_last_holder_lets_go() -> None:
    pool = RefPool(4, "page")
    a = pool.allocate(2)
    assert a == [0, 1] and pool.used_count == 2
    pool.retain(a)  # a checkpoint and a sequence share both pages
    pool.retain([a[0]])
    assert [pool.refcount(i) for i in a] == [3, 2]
    assert pool.release(a) == []  # still held
    assert pool.release([a[0], a[1]]) == [1]  # page 1's last holder
    assert pool.free_count == 3 and pool.refcount(0) == 1
    with pytest.raises(PoolError, match="freed while shared"):
        pool.retain([0])
        pool.free([0])
    assert pool.release([0, 0]) == [0]
    assert pool.used_count == 0 and pool.allocate(4) == [0, 1, 2, 3]


def test_refpool_refuses_what_it_does_not_hold() -> None:
    pool = RefPool(3, "page")
    with pytest.raises(PoolError, match="retained but not held"):
        pool.retain([1])
    ids = pool.allocate(1)
    with pytest.raises(PoolError, match="released more often than held"):
        pool.release(ids + ids)
    assert pool.refcount(ids[0]) == 1  # a refused release changes nothing


def _request(prompt: int, new: int) -> RequestPlan:
    return RequestPlan(tuple(range(prompt)), new, SamplingParams(seed=1), LogprobParams(), "d")


def _book(pages: int = 10, extra: int = 0) -> ResourceBook:
    return ResourceBook(
        owner=7, max_sequences=2, slots_per_sequence=3, kv_pages=pages, page_size=8, max_context=64,
        extra_tokens=extra,
    )  # fmt: skip


def test_plans_reserve_the_complete_growth_and_a_verify_slack() -> None:
    book = _book(extra=3)
    plan = book.plan(_request(10, 20))
    assert isinstance(plan, ResourcePlan)
    assert plan.reserved.kv_pages_reserved == 5  # ceil((30 + 3) / 8)
    assert plan.reserved.state_slots == 3
    assert isinstance(book.plan(_request(10, 60)), Infeasible)  # past max_context
    assert isinstance(_book(pages=3).plan(_request(10, 20)), Infeasible)  # past the whole pool
    assert book.max_pages_per_sequence == 9  # ceil((64 + 3) / 8): the block-table width


def test_transaction_lifecycle_and_revision() -> None:
    book = _book()
    baseline = book.usage([], False)
    plan = book.plan(_request(10, 20))
    assert isinstance(plan, ResourcePlan)
    txn, _ = book.start(plan)
    assert book.revision == 1 and book.usage([], False).open_transactions == 1
    with pytest.raises(StalePlan):  # the start moved the revision
        book.start(plan)
    other = book.plan(_request(4, 4))
    assert isinstance(other, ResourcePlan)
    with pytest.raises(ProgramInvariantError, match="already open"):
        book.start(other)
    assert isinstance(other, ResourcePlan)
    result = book.finish(txn)
    assert result.kind == "materialized" and result.resource_revision == 2
    with pytest.raises(StalePlan):  # sealed before the revision moved
        book.start(other)
    handle = result.handle
    assert handle is not None and book.held(handle).slots == (0, 1, 2)
    second = book.plan(_request(10, 20))
    assert isinstance(second, ResourcePlan)
    aborted = book.abort(book.start(second)[0])
    assert aborted.kind == "aborted" and book.usage([], False).kv_pages_reserved == 4
    full = book.plan(_request(10, 30))  # 5 pages, 6 free
    assert isinstance(full, ResourcePlan)
    book.finish(book.start(full)[0])
    assert isinstance(book.plan(_request(2, 2)), Blocked)  # no sequence index left
    book.release(handle)
    with pytest.raises(ProgramInvariantError, match="stale or foreign"):
        book.held(handle)
    assert book.usage([], False).sequences == 0
    for index in list(book._held):
        book.release(book._held[index].handle)
    assert book.usage([], False) == baseline
