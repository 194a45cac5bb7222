"""Hypothesis property suite of the context cache through the real EngineCore, ResourceManager and
ContextCache, on a Program whose resources are the real Qwen3.6 `ResourceBook` (`book_program.py`):
page reference counts, state slots and checkpoint slots, victims, pins and plans are the Program's own.

Scenarios (`cache_harness.run_actions`): conversations growing turn by turn (the next turn resends the
history, so it continues the retained turn), system prompts shared across sessions (captured at the end
of the preamble), token documents sharing prefixes (interval captures), two turns of one session in
flight at once, cancellation inside every Program call that can see it (queued, materializing, from a
source, prefilling, capturing, decoding, forced control, retaining), pressure (few checkpoint slots, a
small KV pool, so plans and captures evict and some requests are blocked or infeasible), and cache
resets while requests run. `cache_harness.Harness.check` lists the invariants checked after every
boundary, `Harness.finish` those checked after the drain.
"""

from __future__ import annotations

from cache_harness import CANCEL_POINTS, cold_tokens, make_harness, property_settings, run_actions
from hypothesis import given, note
from hypothesis import strategies as st

from ninfer import GenerationRequest

seed = st.integers(0, 2**16)
chat = st.tuples(
    st.just("chat"),
    st.integers(0, 2),
    st.integers(0, 99),
    st.integers(1, 16),
    seed,
    st.sampled_from([True, True, True, False]),  # prefix_cache of the request
    st.one_of(st.none(), st.none(), st.integers(1, 6)),  # thinking budget
)
follow = st.tuples(st.just("follow"), st.integers(0, 30), st.integers(0, 99), st.integers(1, 16), seed)
race = st.tuples(st.just("race"), st.integers(0, 30), st.integers(0, 99), st.integers(1, 12), seed)
document = st.tuples(st.just("document"), st.integers(1, 150), st.integers(0, 11), st.integers(1, 30), seed)
step = st.tuples(st.just("step"), st.integers(1, 24))
cancel = st.tuples(st.just("cancel"), st.sampled_from(CANCEL_POINTS), st.integers(0, 40))
action = st.one_of(
    chat,
    chat,
    follow,
    follow,
    follow,
    race,
    document,
    step,
    step,
    step,
    step,
    cancel,
    cancel,
    st.just(("cancel", "start_src", 0)),  # a materialization from a checkpoint, cancelled
    st.tuples(st.just("session_race"), st.integers(0, 2), st.integers(0, 99), seed),
    st.tuples(st.just("burst"), st.integers(2, 4), seed),
    st.tuples(st.just("reset")),
)


@property_settings(200)
@given(
    mc=st.integers(1, 4),
    page_size=st.sampled_from([4, 8]),
    pool=st.integers(0, 3),
    checkpoint_slots=st.integers(0, 4),
    polls=st.integers(0, 2),
    chunk=st.integers(4, 40),
    capture_interval=st.integers(16, 64),
    actions=st.lists(action, min_size=10, max_size=70),
)
def test_cache_invariants_hold_for_random_scenarios(
    mc: int,
    page_size: int,
    pool: int,
    checkpoint_slots: int,
    polls: int,
    chunk: int,
    capture_interval: int,
    actions: list[tuple],
) -> None:
    # this hypothesis release prints empty values in its report: note the example ourselves
    note(
        repr(
            dict(
                mc=mc,
                page_size=page_size,
                pool=pool,
                checkpoint_slots=checkpoint_slots,
                polls=polls,
                chunk=chunk,
                capture_interval=capture_interval,
                actions=actions,
            )
        )
    )
    lane_pages = -(-192 // page_size)
    # 0: a pool that holds one full-context request (blocked heads, some infeasible documents);
    # 1..3: room for every lane plus 0, 1/4 or 1/2 of a lane for the cache
    kv_pages = lane_pages * 3 // 4 if pool == 0 else mc * lane_pages + (pool - 1) * lane_pages // 4
    h = make_harness(
        mc=mc,
        page_size=page_size,
        kv_pages=kv_pages,
        checkpoint_slots=checkpoint_slots,
        polls=polls,
        chunk=chunk,
        capture_interval=capture_interval,
    )
    run_actions(h, actions)
    h.finish(cold_tokens)


@property_settings(200)
@given(
    mc=st.integers(1, 3),
    page_size=st.sampled_from([4, 8]),
    pool=st.integers(0, 2),
    checkpoint_slots=st.integers(0, 2),
    host_slots=st.integers(1, 5),
    host_pages=st.sampled_from([3, 12, 48, 200]),
    polls=st.integers(0, 2),
    chunk=st.integers(4, 40),
    capture_interval=st.integers(16, 64),
    actions=st.lists(action, min_size=10, max_size=70),
)
def test_cache_invariants_hold_with_the_host_tier(
    mc: int,
    page_size: int,
    pool: int,
    checkpoint_slots: int,
    host_slots: int,
    host_pages: int,
    polls: int,
    chunk: int,
    capture_interval: int,
    actions: list[tuple],
) -> None:
    """The same scenarios with a host tier of a few slots and pages, and a device with little room for
    checkpoints: victims are offloaded (or dropped when the host is full of more valuable ones), later
    turns restore them, every invariant holds after every boundary, outputs are the cold ones and every
    pool of both tiers returns to its baseline after the reset (`Harness.check`, `Harness.finish`)."""
    note(
        repr(
            dict(
                mc=mc,
                page_size=page_size,
                pool=pool,
                checkpoint_slots=checkpoint_slots,
                host_slots=host_slots,
                host_pages=host_pages,
                polls=polls,
                chunk=chunk,
                capture_interval=capture_interval,
                actions=actions,
            )
        )
    )
    lane_pages = -(-192 // page_size)
    kv_pages = lane_pages * 3 // 4 if pool == 0 else mc * lane_pages + (pool - 1) * lane_pages // 4
    h = make_harness(
        mc=mc,
        page_size=page_size,
        kv_pages=kv_pages,
        checkpoint_slots=checkpoint_slots,
        polls=polls,
        chunk=chunk,
        capture_interval=capture_interval,
        host_slots=host_slots,
        host_pages=host_pages,
    )
    run_actions(h, actions)
    h.finish(cold_tokens)


def test_a_conversation_that_left_the_device_is_restored_and_gives_the_cold_tokens() -> None:
    """A fixed case of the above: three sessions take turns on one lane with one checkpoint slot, so each
    session's checkpoints go to the host while the others run and come back for its next turn."""
    h = make_harness(
        mc=1,
        page_size=4,
        kv_pages=None,
        checkpoint_slots=1,
        polls=1,
        chunk=16,
        capture_interval=32,
        host_slots=6,
        host_pages=200,
    )
    actions: list[tuple] = [("chat", s, s, 8, 30 + s) for s in range(3)] + [("step", 200)]
    for turn in range(2):
        actions += [("follow", s, 10 * turn + s, 8, 40 + s) for s in range(3)] + [("step", 200)]
    run_actions(h, actions)
    stats = h.core.resources.cache.stats
    assert stats.offloads > 0 and stats.restores > 0, stats
    assert any(e.channel.final.usage.reused_prefix_tokens for e in h.submitted[3:])
    h.finish(cold_tokens)


def test_a_reset_asked_for_with_a_submission_in_the_same_boundary_is_carried_out() -> None:
    # the shrunk case: one finished turn (checkpoints held), then reset + submit before the next boundary
    h = make_harness(
        mc=1, page_size=4, kv_pages=None, checkpoint_slots=2, polls=0, chunk=16, capture_interval=32
    )
    run_actions(h, [("chat", 0, 0, 4, 0), ("step", 30)])
    count = len(h.program.book.checkpoints)
    assert count > 0
    reset = h.core.request_cache_reset()
    h.submit(GenerationRequest(prompt="hello", max_tokens=1, seed=1))
    h.core.step()
    assert reset.wait(0) == count
    assert not h.core.resources.cache.entries and not h.program.book.checkpoints
