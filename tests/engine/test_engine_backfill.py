"""Backfill past a blocked FIFO head, through the Engine, with the real `ResourceBook` proving it
(`BookProgram.prove_backfill` is `Qwen36Program.prove_backfill`: `ResourceBook.proves_backfill`, then a
root plan for the borrower).

The rule (docs/resources-and-context-cache.md, the specification's backfill clause): the request right
behind a blocked head may enter first only if "with the borrower holding its complete active
reservation for its whole life, the end of the donor set alone leaves enough for the head to enter from
the root source with all inactive cache released". Checked:

- every admission is the FIFO head, or the request right behind a protected head started with the very
  plan a proof just returned;
- the proof is true: on a copy of the book taken right after the borrower's start, ending the donors,
  dropping every checkpoint and finishing the borrower's claim leaves a root plan for the head;
- the head enters as soon as its donors end: at the first boundary that starts with all of them
  finished, no transition open and no staged prefill, the head leaves Waiting;
- and everything `cache_harness.Harness` checks (tokens, pools, catalog).
"""

from __future__ import annotations

import copy
from typing import Any

from cache_harness import CANCEL_POINTS, Harness, cold_tokens, event, make_harness, property_settings
from hypothesis import given, note
from hypothesis import strategies as st

from ninfer import GenerationRequest
from ninfer.runtime.contract.types import RequestPlan, ResourcePlan, SequenceHandle
from ninfer.runtime.engine.request_record import RequestState

Proof = tuple[RequestPlan, tuple[SequenceHandle, ...], RequestPlan, ResourcePlan | None]


class BackfillWatch:
    """The backfill checks of the module docstring, installed on a harness."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.proofs: list[Proof] = []
        self.borrowers: list[int] = []  # serials admitted past a blocked head
        self.heads_entered: list[int] = []  # serials of protected heads admitted once their donors ended
        program = h.program
        prove = program.prove_backfill

        def recorded(head: RequestPlan, donors: Any, borrower: RequestPlan) -> ResourcePlan | None:
            plan = prove(head, donors, borrower)
            self.proofs.append((head, tuple(donors), borrower, plan))
            event("backfill proved" if plan is not None else "backfill refused")
            return plan

        program.prove_backfill = recorded  # type: ignore[method-assign]
        h.on_start = self.on_start
        program.hooks["start:after"] = self.after_start

    def on_start(self, h: Harness, request: RequestPlan, plan: ResourcePlan) -> None:
        scheduler = h.core.scheduler
        head = scheduler.head()
        assert head is not None
        if head.plan is request:
            return
        behind = scheduler.behind_head()
        assert behind is not None and behind.plan is request, "admitted a request other than head or borrower"
        assert scheduler.protected_head == head.request_id, "a backfill past a head that is not blocked"
        assert self.proofs and self.proofs[-1][3] is plan, "a borrower started without the proof's plan"
        assert self.proofs[-1][0] is head.plan and self.proofs[-1][2] is request
        self.borrowers.append(h.serial_of(request))

    def after_start(self, program: Any, txn: Any) -> None:
        if not self.borrowers or self.h.serial_of(txn.plan.sealed[0]) != self.borrowers[-1]:
            return
        head, donors, _, _ = self.proofs[-1]
        book = program.book
        wrapper = book.__dict__.pop("_drop")  # the test's wrapper holds the Program: not copied
        try:
            future = copy.deepcopy(book)
        finally:
            book._drop = wrapper
        # the donors end (alone), every checkpoint goes, the borrower holds its whole reservation
        for donor in donors:
            future.release(donor)
        if future.checkpoints:
            future.evict(list(future.checkpoints))
        future.finish(future.open_txn)
        assert isinstance(future.plan(head), ResourcePlan), "a backfill proof that does not hold"

    def step(self) -> None:
        """One boundary, with the head-enters-when-its-donors-end check around it."""
        h = self.h
        core = h.core
        scheduler = core.scheduler
        head = scheduler.head()
        due = (
            head is not None
            and scheduler.protected_head == head.request_id
            and all(rid not in core.live for rid in scheduler.donors)
            and scheduler.staged is None
            and core.resources.transition is None
            and not head.channel.cancel_requested
        )
        h.step()
        if due and not core.failed:
            assert head.state is not RequestState.WAITING, "the head did not enter when its donors ended"
            self.heads_entered.append(head.prompt.serial)  # type: ignore[attr-defined]
            event("a blocked head entered when its donors ended")


def request(size: int, max_tokens: int, seed: int) -> GenerationRequest:
    prompt = [ord("a") + (seed + i) % 26 for i in range(size)]
    return GenerationRequest(prompt=prompt, max_tokens=max_tokens, seed=seed, ignore_eos=True)


def test_a_borrower_enters_only_with_a_proof_and_the_head_when_its_donors_end() -> None:
    """mc=4, a pool of 24 pages (4 positions each): two donors of 8 pages run; the head needs 16 and is
    blocked; a 4-page borrower is proved (donors' 16 pages cover the head while it holds its 4) and
    enters; a second 8-page borrower is refused (it would leave 4 + 8 of 24 held, 12 free < 16), though
    a lane is free; the head enters (as soon as a donor's end makes room), before the second borrower."""
    h = make_harness(mc=4, page_size=4, kv_pages=24, checkpoint_slots=0, polls=0, chunk=64,
                     capture_interval=64, prefix_cache=False)
    watch = BackfillWatch(h)
    h.submit(request(16, 16, 1))  # donor: 32 positions = 8 pages
    h.submit(request(16, 16, 2))  # donor
    for _ in range(6):
        watch.step()
    h.submit(request(48, 16, 3))  # head: 64 positions = 16 pages
    h.submit(request(4, 12, 4))  # borrower: 4 pages, outliving the donors
    h.submit(request(16, 16, 5))  # a second borrower: 8 pages
    serials = [e.serial for e in h.submitted]
    watch.step()
    head = h.core.live[h.submitted[2].channel.request_id]
    while head.state is RequestState.WAITING:
        watch.step()
    assert watch.borrowers == [serials[3]], "only the proved borrower entered past the head"
    verdicts = [(p[2].max_total_tokens, p[3] is not None) for p in watch.proofs]
    assert verdicts[0] == (16, True) and (32, False) in verdicts and (32, True) not in verdicts, verdicts
    assert h.started[:4] == [serials[0], serials[1], serials[3], serials[2]]
    while not h.core.idle:
        watch.step()
    h.finish(cold_tokens)


size = st.integers(1, 60)
action = st.one_of(
    st.tuples(st.just("req"), size, st.integers(1, 40), st.integers(0, 2**16)),
    st.tuples(st.just("burst"), st.integers(2, 4), st.integers(0, 2**16)),  # big, then small ones
    st.tuples(st.just("req"), st.integers(1, 8), st.integers(1, 8), st.integers(0, 2**16)),  # small
    st.tuples(st.just("doc"), st.integers(1, 120), st.integers(0, 5), st.integers(1, 24), st.integers(0, 99)),
    st.tuples(st.just("step"), st.integers(1, 16)),
    st.tuples(st.just("step"), st.integers(1, 16)),
    st.tuples(st.just("cancel"), st.sampled_from(CANCEL_POINTS), st.integers(0, 30)),
)


@property_settings(200)
@given(
    mc=st.integers(2, 4),
    pages=st.integers(24, 48),
    checkpoint_slots=st.integers(0, 3),
    cache=st.booleans(),
    polls=st.integers(0, 1),
    chunk=st.integers(8, 64),
    actions=st.lists(action, min_size=6, max_size=40),
)
def test_backfill_invariants_hold_for_random_scenarios(
    mc: int, pages: int, checkpoint_slots: int, cache: bool, polls: int, chunk: int, actions: list[tuple]
) -> None:
    note(repr(dict(mc=mc, pages=pages, checkpoint_slots=checkpoint_slots, cache=cache, polls=polls,
                   chunk=chunk, actions=actions)))
    h = make_harness(mc=mc, page_size=4, kv_pages=pages, checkpoint_slots=checkpoint_slots, polls=polls,
                     chunk=chunk, capture_interval=32, prefix_cache=cache)
    watch = BackfillWatch(h)
    for act in actions:
        if act[0] == "req":
            h.submit(request(*act[1:]))
        elif act[0] == "burst":
            h.submit(request(40 + act[2] % 20, 20 + act[2] % 20, act[2]))
            for j in range(1, act[1]):
                h.submit(request(1 + (act[2] >> j) % 8, 1 + (act[2] >> (2 * j)) % 24, act[2] + j))
        elif act[0] == "doc":
            h.document(*act[1:])
        elif act[0] == "step":
            for _ in range(act[1]):
                watch.step()
        else:
            h.cancel(act[1], act[2])
    for _ in range(20_000):
        if h.core.idle:
            break
        watch.step()
    if watch.borrowers:
        event("a borrower entered past a blocked head")
    h.finish(cold_tokens)
