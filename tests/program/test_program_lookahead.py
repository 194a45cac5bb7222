"""The Program's decode lookahead (``ProgramConfig.decode_lookahead``) on CPU: a decode queues the
decode after it, fed by its own draw, and the next decode takes it only when it is exactly that unit.

Every scenario runs one script of contract calls on a Program with the lookahead and on one without,
and compares everything the Engine could see: tokens, log-probs and base frontiers of every row. The
scripts make the next unit differ from the one queued ahead in each way the Engine can (an aborted
batch, a cancelled row, forced tokens, a prefill between two decodes, a row leaving the round, a row at
its last token) and check that the lookahead was taken where the unit repeats.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_program_direct import commit_all, make_program, prompts

from ninfer.runtime.contract.types import (
    LogprobParams,
    PendingBatch,
    RequestPlan,
    ResourcePlan,
    RowDecision,
    SamplingParams,
    SequenceHandle,
)
from ninfer.targets.qwen3_6.impl.runtime.program import Qwen36Program

Seen = list[tuple[str, tuple[object, ...]]]  # what the Engine saw of every unit, in order


def lookahead_program(name: str, on: bool, max_concurrency: int = 4) -> Qwen36Program:
    return make_program(name, max_concurrency, decode_lookahead=on)


class Driver:
    """Runs a script's calls and records what every unit returned."""

    def __init__(self, program: Qwen36Program) -> None:
        self.program = program
        self.seen: Seen = []

    def materialize(self, prompt: list[int], max_new: int, **sampling: object) -> SequenceHandle:
        temperature = float(sampling.pop("temperature", 0.0))  # type: ignore[arg-type]
        logprobs = sampling.pop("logprobs", LogprobParams())
        params = SamplingParams(seed=int(sampling.pop("seed", 1)), temperature=temperature, **sampling)  # type: ignore[arg-type]
        plan = self.program.plan_materialization(RequestPlan(tuple(prompt), max_new, params, logprobs, "d"))
        assert isinstance(plan, ResourcePlan), plan
        return self.program.finish(self.program.start(plan)).handle

    def record(self, kind: str, pending: PendingBatch) -> PendingBatch:
        self.seen.append((kind, tuple((r.tokens, r.base_frontier, r.logprobs) for r in pending.rows)))
        return pending

    def prefill(self, handle: SequenceHandle) -> None:
        while not isinstance(pending := self.program.prefill(handle, 16), PendingBatch):
            pass
        commit_all(self.program, self.record("prefill", pending))

    def decode(self, handles: list[SequenceHandle], budgets: list[int] | None = None) -> PendingBatch:
        budgets = budgets or [8] * len(handles)
        return self.record("decode", self.program.decode(handles, budgets, repeat_expected=True))

    def decode_commit(self, handles: list[SequenceHandle], budgets: list[int] | None = None) -> None:
        commit_all(self.program, self.decode(handles, budgets))


Script = Callable[[Driver], None]


def steady_mixed_rows(d: Driver) -> None:
    """Greedy, seeded sampled and log-prob rows decoding together, the budgets ending them one by one;
    then a penalised row alone (never run ahead: `test_no_lookahead_past_the_budget_or_with_penalties`)."""
    ps = prompts(4)
    budgets = (9, 7, 8)
    hs = [
        d.materialize(ps[0], budgets[0]),
        d.materialize(ps[1], budgets[1], temperature=0.8, seed=11, top_k=50),
        d.materialize(ps[2], budgets[2], logprobs=LogprobParams(True, 2)),
    ]
    for h in hs:
        d.prefill(h)
    left = {h: n - 1 for h, n in zip(hs, budgets)}
    while left:
        rows = list(left)
        pending = d.decode(rows, [left[h] for h in rows])
        decisions = [RowDecision(r.handle, 1, terminal=left[r.handle] == 1) for r in pending.rows]
        d.program.commit(pending, decisions)
        for h in rows:
            left[h] -= 1
            if left[h] == 0:
                del left[h]
                d.program.release(h)
    penalised = d.materialize(ps[3], 12, repetition_penalty=1.3, frequency_penalty=0.5)
    d.prefill(penalised)
    for _ in range(10):
        d.decode_commit([penalised])


def abort_then_decode(d: Driver) -> None:
    """The unit before the lookahead is aborted: the lookahead assumed it committed."""
    hs = [d.materialize(p, 12) for p in prompts(2)]
    for h in hs:
        d.prefill(h)
    d.decode_commit(hs)
    d.program.abort_pending(d.decode(hs))
    for _ in range(3):
        d.decode_commit(hs)


def cancelled_row(d: Driver) -> None:
    """A row is cancelled (0 tokens accepted) and released; the other row goes on alone."""
    hs = [d.materialize(p, 12) for p in prompts(2)]
    for h in hs:
        d.prefill(h)
    d.decode_commit(hs)
    pending = d.decode(hs)
    d.program.commit(pending, [RowDecision(hs[0], 1), RowDecision(hs[1], 0, terminal=True, cancelled=True)])
    d.program.release(hs[1])
    for _ in range(3):
        d.decode_commit(hs[:1])


def first_row_stops(d: Driver) -> None:
    """The first of three rows ends on a stop token (terminal, its token accepted) and is released; the
    other two (one sampled, one with log-probs) go on. The lookahead ran all three: its results for the
    two are not plain decoding's, whose batch holds two rows (the last bits of a row's logits depend on
    its batch), so it is dropped."""
    ps = prompts(3)
    hs = [
        d.materialize(ps[0], 12),
        d.materialize(ps[1], 12, temperature=0.8, seed=5),
        d.materialize(ps[2], 12, logprobs=LogprobParams(True, 3)),
    ]
    for h in hs:
        d.prefill(h)
    d.decode_commit(hs)
    pending = d.decode(hs)
    d.program.commit(
        pending, [RowDecision(hs[0], 1, terminal=True), RowDecision(hs[1], 1), RowDecision(hs[2], 1)]
    )
    d.program.release(hs[0])
    for _ in range(3):
        d.decode_commit(hs[1:])


def forced_tokens_between(d: Driver) -> None:
    """Forced control runs between two decodes of the same row."""
    (h,) = [d.materialize(p, 16) for p in prompts(1)]
    d.prefill(h)
    d.decode_commit([h])
    pending = d.program.force(h, [11, 22])
    d.program.commit(pending, [RowDecision(h, 2)])
    for _ in range(3):
        d.decode_commit([h])


def abort_then_one_forced_token(d: Driver) -> None:
    """A decode is aborted and one token is forced in its place: the row is back at the frontier the
    lookahead assumed, fed by another token."""
    (h,) = [d.materialize(p, 16) for p in prompts(1)]
    d.prefill(h)
    d.decode_commit([h])
    d.program.abort_pending(d.decode([h]))
    pending = d.program.force(h, [33])
    d.program.commit(pending, [RowDecision(h, 1)])
    for _ in range(3):
        d.decode_commit([h])


def forced_repeat_of_the_last_token(d: Driver) -> None:
    """The last sampled token is forced once more: the row is fed the token the lookahead was fed, one
    position later than it assumed."""
    (h,) = [d.materialize(p, 16) for p in prompts(1)]
    d.prefill(h)
    pending = d.decode([h])
    last = commit_all(d.program, pending)
    d.program.commit(d.program.force(h, last), [RowDecision(h, 1)])
    for _ in range(3):
        d.decode_commit([h])


def prefill_between(d: Driver) -> None:
    """A new request is prefilled between two decode rounds, then joins them."""
    ps = prompts(3)
    hs = [d.materialize(p, 12) for p in ps[:2]]
    for h in hs:
        d.prefill(h)
    d.decode_commit(hs)
    d.decode_commit(hs)
    late = d.materialize(ps[2], 12)
    d.prefill(late)
    for _ in range(3):
        d.decode_commit([*hs, late])


def rows_reordered(d: Driver) -> None:
    """The same rows in another order: another batch (row order changes a row's last bits), so the
    lookahead is dropped."""
    ps = prompts(2)
    hs = [d.materialize(ps[0], 12, logprobs=LogprobParams(True, 2)), d.materialize(ps[1], 12)]
    for h in hs:
        d.prefill(h)
    d.decode_commit(hs)
    d.decode_commit(hs[::-1])
    d.decode_commit(hs[::-1])


SCRIPTS = [
    steady_mixed_rows,
    abort_then_decode,
    cancelled_row,
    first_row_stops,
    forced_tokens_between,
    abort_then_one_forced_token,
    forced_repeat_of_the_last_token,
    prefill_between,
    rows_reordered,
]


def run(script: Script, program: Qwen36Program) -> tuple[Seen, dict[str, int]]:
    driver = Driver(program)
    baseline, before = program.usage(), dict(program.backend.lookahead)
    script(driver)
    for handle in [s.handle for s in program._sequences.values()]:
        program.release(handle)
    assert program.usage() == baseline
    return driver.seen, {k: n - before[k] for k, n in program.backend.lookahead.items()}


# scripts whose next round is the lookahead's (all their rounds repeat or lose rows by length only)
WHOLE = {steady_mixed_rows}


@pytest.mark.parametrize("name", ["qwen3_6_tiny", "qwen3_6_tiny_moe"])
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_lookahead_gives_exactly_what_plain_decoding_gives(script: Script, name: str) -> None:
    with_lookahead, counts = run(script, lookahead_program(name, True))
    plain, plain_counts = run(script, lookahead_program(name, False))
    assert with_lookahead == plain  # tokens, log-probs and base frontiers, bit for bit
    assert not any(plain_counts.values()), plain_counts
    assert counts["taken"] >= 1, counts  # every script repeats a round at least once
    assert (counts["dropped"] == 0) == (script in WHOLE), counts  # ... and the others change one


def test_no_lookahead_past_the_budget_or_with_penalties() -> None:
    """A row at its last token, or one whose sampler reads output counts (which only commit updates),
    queues nothing ahead."""
    program = lookahead_program("qwen3_6_tiny", True, max_concurrency=2)
    d = Driver(program)
    ps = prompts(2)
    last = d.materialize(ps[0], 2)
    d.prefill(last)
    d.decode_commit([last], [1])
    assert program.backend.ahead is None
    penalised = d.materialize(ps[1], 8, repetition_penalty=1.3)
    d.prefill(penalised)
    d.decode_commit([penalised])
    assert program.backend.ahead is None
    assert not any(program.backend.lookahead.values()), program.backend.lookahead
    plain = Driver(lookahead_program("qwen3_6_tiny", False, max_concurrency=2))
    for p, n in zip(ps, (2, 8)):
        h = plain.materialize(p, n, **({} if n == 2 else {"repetition_penalty": 1.3}))
        plain.prefill(h)
        plain.decode_commit([h], [1] if n == 2 else None)
    assert d.seen == plain.seen


def test_lookahead_holds_a_third_state_slot_per_sequence() -> None:
    on, off = lookahead_program("qwen3_6_tiny", True, 2), lookahead_program("qwen3_6_tiny", False, 2)
    assert on.capacity().state_slots == 6 and off.capacity().state_slots == 4
    d = Driver(on)
    h = d.materialize(prompts(1)[0], 4)
    assert on.usage().state_slots == 3
    d.prefill(h)
    d.decode_commit([h])
    on.release(h)
    assert on.usage().state_slots == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["qwen3_6_tiny", "qwen3_6_tiny_moe"])
def test_lookahead_in_cuda_graphs_gives_what_plain_decoding_gives(name: str) -> None:
    """On the GPU the lookahead is really queued behind the unit before it (a graph replay fed on the
    device, its staging buffer not yet copied when the next one is written): every script, including
    those that drop it unread, gives exactly the plain Program's units."""
    on = make_program(name, decode_lookahead=True, device="cuda")
    off = make_program(name, decode_lookahead=False, device="cuda")
    assert on.executor.graphs is not None and off.executor.graphs is not None
    for script in SCRIPTS:
        with_lookahead, counts = run(script, on)
        plain, _ = run(script, off)
        assert with_lookahead == plain, script.__name__
        assert counts["taken"] >= 1, (script.__name__, counts)
    # greedy rows fed the graph's own argmax in place (no device copy), the rest by a copy
    assert on.executor.graphs.fed_in_place >= 1 and off.executor.graphs.fed_in_place == 0


torch.set_num_threads(1)
