"""Fault injection in capture, materialization (from a checkpoint source) and eviction, on the real
`ResourceBook` (`book_program.py`): each failure is classified as the specification classifies it.

The specification (engine-control-plane, 失败分类), quoted next to each case:

- request-level, before any Program mutation: "在 Program mutation 前可以只拒绝当前请求：queue timeout、
  overload 或 waiting cancellation；输入超过公开 context contract；prompt 或 generation request 无法表示；
  即使采用 root source 并释放全部 inactive cache，单请求仍不可行。"
- Engine-wide: "以下情况说明共享物理状态已无法安全解释，必须使整个 Engine 失败：GPU mutation 后既不能 commit
  也不能形成稳定 abort；PendingBatch membership 或 disposition 不一致；handle owner/generation 不匹配；
  resource、checkpoint completeness 或 noexcept adoption invariant 被破坏。" with the cleanup order
  "Cleanup 顺序必须先终止 Program 中未决的 resource/model transaction，再释放 active state，最后清空
  ResourceManager 与完成所有 request response。内部不变量错误不能降级成 cache miss、等待或重试。"
- docs/engine.md makes the Program side exact: "any exception from the Program (other than StalePlan
  from start, which is re-planned)" fails the Engine; an exception from one request's OutputSession
  fails only that request (RequestFailed), "The Engine's shared state is intact".

The host tier's moves (an offload of a victim, a restore of a plan's source) are Program mutations like
any other: a fault in one fails the Engine, and so does a result whose placements cannot be adopted
("noexcept adoption invariant 被破坏"); a restore that does not fit is no failure at all, the plan falls
back to a shorter source or the root ("即使采用 root source 并释放全部 inactive cache，单请求仍不可行" is
still the only resource rejection).

After a request-level failure the Engine keeps serving (a later request gets the cold tokens) and, after
a reset, every pool is back at its baseline. After an Engine failure every outstanding request ends with
EngineFailed, later submits raise, a cache reset asked for afterwards completes at once, cleanup aborts
the open transaction before it releases any sequence, and every active resource is released.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from cache_frontend import CacheFrontend
from cache_harness import SYSTEMS, Harness, chat_request, cold_tokens, make_harness, run_actions

from ninfer import EngineFailed, GenerationRequest, RequestFailed
from ninfer.runtime.contract.types import CheckpointPlacement

# a conversation whose second turn continues the first, a second session sharing its system prompt, a
# document pair sharing a prefix, a turn cancelled while it materializes from a source, and a reset
SCENARIO: list[tuple] = [
    ("chat", 1, 1, 8, 11),
    ("step", 40),
    ("follow", 0, 2, 8, 12),
    ("chat", 1, 3, 6, 13),
    ("document", 120, 1, 4, 14),
    ("step", 60),
    ("document", 120, 2, 4, 15),
    ("cancel", "start_src", 0),
    ("follow", 1, 4, 6, 16),
    ("reset",),
    ("step", 30),
    ("chat", 1, 5, 6, 17),
    ("follow", 0, 6, 6, 18),
    ("step", 80),
]


def harness(faults: dict[str, int] | None = None, frontend: CacheFrontend | None = None) -> Harness:
    return make_harness(
        mc=2,
        page_size=4,
        kv_pages=None,
        checkpoint_slots=2,
        polls=1,
        chunk=16,
        capture_interval=32,
        faults=faults,
        frontend=frontend,
    )


def settle(h: Harness) -> None:
    for _ in range(5000):
        if h.core.failed or h.core.idle:
            return
        h.step()
    raise AssertionError("the Engine neither failed nor drained")


# (fault switch, what it models). Every one is an exception from the Program, hence Engine-wide
# (docs/engine.md: "any exception from the Program (other than StalePlan from start)"); the ":after"
# switches raise once the book has changed, i.e. "GPU mutation 后既不能 commit 也不能形成稳定 abort".
ENGINE_FAULTS = [
    ({"capture": 1}, "capture before it changed anything"),
    ({"capture:after": 2}, "capture after it published into the book: the result is lost"),
    ({"retain": 1}, "terminal retain"),
    ({"retain:after": 1}, "retain after the book turned the sequence into a checkpoint"),
    ({"evict": 1}, "the reset's deletion transition"),
    ({"evict:after": 1}, "the deletion after the book dropped the checkpoints"),
    ({"plan_materialization": 3}, "planning with cache candidates"),
    ({"start": 3}, "start of a materialization from a source (victims not yet evicted)"),
    ({"start:after": 3}, "start after it evicted victims and pinned the source"),
    ({"poll": 2}, "a materialization in flight"),
    ({"finish": 3}, "finish of a materialization from a source"),
    ({"finish:after": 2}, "finish after the book adopted the claim"),
    ({"abort": 1}, "abort of a materialization from a source, cancelled"),
]


@pytest.mark.parametrize(("faults", "what"), ENGINE_FAULTS, ids=[next(iter(f)) for f, _ in ENGINE_FAULTS])
def test_a_program_fault_in_the_cache_paths_fails_the_engine(faults: dict[str, int], what: str) -> None:
    h = harness(faults)
    run_actions(h, SCENARIO)
    settle(h)
    assert_engine_failed(h, faults, what)


# three sessions taking turns on one lane with one checkpoint slot: each turn pushes the others'
# checkpoints to the host tier, and each session's next turn restores its own
HOST_SCENARIO: list[tuple] = [("chat", s, s, 8, 30 + s) for s in range(3)] + [("step", 200)]
for _turn in range(2):
    HOST_SCENARIO += [("follow", 3 * _turn + s, 10 * _turn + s, 8, 40 + s) for s in range(3)]
    HOST_SCENARIO.append(("step", 200))
HOST_SCENARIO += [
    ("cancel", "start_src", 0),
    ("follow", 6, 50, 6, 50),
    ("step", 100),
    ("reset",),
    ("step", 20),
]


def host_harness(faults: dict[str, int] | None = None, checkpoint_slots: int = 1) -> Harness:
    return make_harness(
        mc=1,
        page_size=4,
        kv_pages=None,
        checkpoint_slots=checkpoint_slots,
        polls=1,
        chunk=16,
        capture_interval=32,
        faults=faults,
        host_slots=12,
        host_pages=400,
    )


# the host tier's fault points: each raises inside the Program after the book moved the checkpoint
HOST_FAULTS = [
    ({"offload": 1}, "the first offload (a capture's or a plan's victim)"),
    ({"offload": 4}, "a later offload"),
    ({"restore": 1}, "the first restore of a plan's source"),
    ({"restore": 2}, "a later restore"),
    ({"start:after": 5}, "start after a plan moved checkpoints between the tiers"),
    ({"finish": 5}, "finish of a materialization that restored its source"),
    ({"abort": 1}, "abort of a materialization from a restored source, cancelled"),
]


@pytest.mark.parametrize(("faults", "what"), HOST_FAULTS, ids=[next(iter(f)) for f, _ in HOST_FAULTS])
def test_a_program_fault_in_the_host_tier_fails_the_engine(faults: dict[str, int], what: str) -> None:
    h = host_harness(faults)
    run_actions(h, HOST_SCENARIO)
    settle(h)
    assert_engine_failed(h, faults, what)


def test_the_host_scenario_moves_checkpoints_both_ways_without_faults() -> None:
    """The scenario the host faults run in offloads and restores (so each fault point is reached)."""
    h = host_harness()
    run_actions(h, HOST_SCENARIO)
    stats = h.core.resources.cache.stats
    assert stats.offloads >= 4 and stats.restores >= 2, stats
    assert h.program.calls.get("restore", 0) == stats.restores
    h.finish(cold_tokens)


@pytest.mark.parametrize("broken", ["same tier", "unknown checkpoint", "placed and removed"])
def test_a_placement_the_catalog_cannot_adopt_fails_the_engine(broken: str) -> None:
    """A result whose placements contradict the catalog is an adoption invariant break: the Engine fails
    ("内部不变量错误不能降级成 cache miss、等待或重试"), it is not turned into a miss."""
    h = host_harness()
    h.fail_ok = True
    run_actions(h, HOST_SCENARIO[:4])
    assert h.program.book.checkpoints
    book = h.program.book
    finish = book.finish

    def corrupted(txn: Any) -> Any:
        result = finish(txn)
        known = next(iter(h.core.resources.cache.entries))
        tier = h.core.resources.cache.tier(known)
        placement = {
            "same tier": CheckpointPlacement(known, tier),
            "unknown checkpoint": CheckpointPlacement(10_000, "host"),
            "placed and removed": CheckpointPlacement(known, "host" if tier == "device" else "device"),
        }[broken]
        removed = (*result.removed, known) if broken == "placed and removed" else result.removed
        return dataclasses.replace(result, placed=(*result.placed, placement), removed=removed)

    book.finish = corrupted  # type: ignore[method-assign]
    run_actions(h, [("follow", 0, 60, 6, 61)])
    settle(h)
    assert h.core.failed and "checkpoint" in h.core.availability.reason, h.core.availability.reason
    assert all(
        isinstance(e.handle.result(0, raise_on_error=False).error, EngineFailed)
        for e in h.submitted
        if e.handle.result(0, raise_on_error=False).finish_reason == "error"
    )


def test_a_restore_that_does_not_fit_runs_cold_not_a_failure() -> None:
    """No checkpoint slot: a retained turn holds a lane's slot, the next session's turn pushes it to the
    host, and its own next turn cannot restore it beside the lane's slots: it falls back to a shorter
    source or the root and gives the cold tokens; nothing fails, nothing is rejected."""
    h = host_harness(checkpoint_slots=0)
    run_actions(h, HOST_SCENARIO[:-5])
    stats = h.core.resources.cache.stats
    assert stats.offloads > 0 and stats.restores == 0, stats
    assert not h.core.failed
    h.finish(cold_tokens)


def assert_engine_failed(h: Harness, faults: dict[str, int], what: str) -> None:
    """The Engine failed as a whole on the injected fault (module docstring)."""
    name = next(iter(faults)).split(":")[0]
    assert h.program.calls.get(name, 0) >= faults[next(iter(faults))], f"the fault ({what}) never fired"
    core = h.core
    assert core.failed and "injected fault" in core.availability.reason
    assert core.availability.state == "failed"
    failed = 0
    for entry in h.submitted:
        result = entry.handle.result(0, raise_on_error=False)
        if result.finish_reason == "error":
            # only the Engine-wide error; never degraded into a per-request error, a miss or a wait
            assert isinstance(result.error, EngineFailed) and "injected fault" in result.error.message
            failed += 1
        elif result.finish_reason in ("stop", "length"):
            assert result.token_ids == cold_tokens(entry.request)
    assert failed, "the fault hit no outstanding request"
    with pytest.raises(EngineFailed):
        h.engine.submit(GenerationRequest(prompt="late", max_tokens=1, seed=1))
    assert core.request_cache_reset().wait(0) == 0  # a reset after the failure completes at once
    # cleanup: the open transaction (abort / abort_pending) ends before any sequence is released
    tail = h.program.call_log[len(h.program.call_log) - h.program.call_log[::-1].index(name) :]
    aborts = [i for i, c in enumerate(tail) if c in ("abort", "abort_pending")]
    releases = [i for i, c in enumerate(tail) if c == "release"]
    if aborts and releases:
        assert max(aborts) < min(releases)
    usage = h.program.usage()
    # a Program that raised before changing anything is cleaned up whole; one that raised after its
    # change (a tier move is one, or whose abort failed) keeps what the Engine could not know of: it is
    # no longer trusted
    if ":after" not in next(iter(faults)) and name not in ("abort", "offload", "restore"):
        assert (usage.sequences, usage.open_transactions, usage.open_pending_batches) == (0, 0, 0)
    assert core.outstanding == 0 or all(e.channel.response_done for e in h.submitted)


def test_stale_plan_at_start_is_replanned_not_a_failure() -> None:
    """StalePlan from start has no side effect: the Engine re-plans (docs/engine.md: "other than
    StalePlan from start, which is re-planned"); twice in one boundary is an invariant error
    ("内部不变量错误不能降级成 cache miss、等待或重试") and fails the Engine."""
    for bumps, fails in ((1, False), (2, True)):
        h = harness()
        h.fail_ok = fails
        left = [bumps]

        previous = h.program.hooks["start"]

        def stale(program: Any, plan: Any, left: list[int] = left, previous: Any = previous) -> None:
            previous(program, plan)
            if left[0] and plan.source_checkpoint is not None:
                left[0] -= 1
                program.book.revision += 1  # the plan is now stale: start raises StalePlan

        h.program.hooks["start"] = stale
        run_actions(h, SCENARIO[:3])
        settle(h)
        assert h.core.failed == fails
        if not fails:
            h.finish(cold_tokens)
            assert any(e.result.usage.reused_prefix_tokens for e in h.submitted)
        else:
            assert "stale twice" in h.core.availability.reason


# (OutputSession fault, finish reason of that request, whether its turn may still be retained).
# docs/engine.md: "Request-level failure while running (only that request, RequestFailed): an exception
# from that request's OutputSession.preview, commit or finish ... The Engine's shared state is intact."
# A failing reuse-boundary hint is not even a failure: "a hint: without it the turn is only not kept".
OUTPUT_FAULTS = [
    ({"preview": 1}, "error"),  # the final prefill chunk's preview: a cancelled row, released
    ({"preview": 3}, "error"),  # a decode row's preview
    ({"commit": 2}, "error"),  # a deferred OutputSession commit (the row goes on): next unit cancels it
    ({"finish": 1}, "error"),  # after the terminal retain/release
    ({"boundaries": 1}, "stop"),  # the hint fails: not retained, no failure
]


@pytest.mark.parametrize(("fail", "reason"), OUTPUT_FAULTS, ids=[next(iter(f)) for f, _ in OUTPUT_FAULTS])
def test_an_output_fault_fails_only_its_request_and_the_pools_return(
    fail: dict[str, int], reason: str
) -> None:
    frontend = CacheFrontend(fail={"BOOM": fail})
    h = harness(frontend=frontend)
    run_actions(h, SCENARIO[:2])  # a finished turn retained, its preamble captured
    messages = [{"role": "system", "content": SYSTEMS[1]}, {"role": "user", "content": "BOOM?"}]
    # this seed ends the turn with EOS after 8 tokens (a stop that the cache would retain)
    h.submit(chat_request(messages, "boom", 12, 0), messages)
    run_actions(h, [("follow", 0, 7, 8, 21), ("step", 200)])
    assert not h.core.failed
    boom = h.submitted[1]
    result = boom.handle.result(0, raise_on_error=False)
    assert result.finish_reason == reason, result
    if reason == "error":
        assert isinstance(result.error, RequestFailed)
        assert result.token_ids == cold_tokens(boom.request)[: len(result.token_ids)]
    retained_by_boom = [
        c for c, p in h.program.published.items() if p.kind == "retained" and h.publisher(c) is boom
    ]
    if "finish" in fail:
        # OutputSession.finish runs after the terminal retain: the turn's model state is complete and
        # stays cached, though the request ends with RequestFailed
        assert retained_by_boom
    else:
        assert not retained_by_boom, "a failed or unreproducible turn was retained"
    # the Engine keeps serving: a later turn of another session, then the pools at baseline
    run_actions(h, [("chat", 1, 8, 6, 22), ("step", 100)])
    boom.handle.close()
    h.submitted.remove(boom)  # its tokens are checked above; finish() checks everyone else
    h.finish(cold_tokens)


def test_a_boundary_outside_the_accepted_span_fails_the_engine() -> None:
    """A Frontend whose preview breaks its rule is a contract break ("PendingBatch membership 或
    disposition 不一致"): the Engine fails, it is not turned into a miss."""
    h = harness(frontend=CacheFrontend(fail={"BOOM": {"bad_boundaries": 1}}))
    h.fail_ok = True
    messages = [{"role": "system", "content": SYSTEMS[1]}, {"role": "user", "content": "BOOM?"}]
    h.submit(chat_request(messages, "boom", 12, 0), messages)
    settle(h)
    assert h.core.failed and "boundaries" in h.core.availability.reason
    result = h.submitted[0].handle.result(0, raise_on_error=False)
    assert isinstance(result.error, EngineFailed)
    assert all(p.kind == "captured" for p in h.program.published.values()), "a broken turn was retained"


@pytest.mark.parametrize("host_slots", [0, 3], ids=["device only", "host tier"])
def test_infeasible_is_decided_as_if_the_cache_were_empty(host_slots: int) -> None:
    """ "即使采用 root source 并释放全部 inactive cache，单请求仍不可行" is the only resource rejection: with
    the pool full of checkpoints (and the host tier full too), a request that fits an empty Program is
    admitted (offloading or evicting), one that does not is rejected alone, and the Engine goes on."""
    h = make_harness(
        mc=1,
        page_size=4,
        kv_pages=40,
        checkpoint_slots=4,
        polls=0,
        chunk=16,
        capture_interval=16,
        host_slots=host_slots,
        host_pages=30,
    )
    run_actions(h, [("document", 150, 0, 4, 1), ("step", 60), ("document", 90, 1, 4, 2), ("step", 60)])
    assert h.program.book.checkpoints
    fits = GenerationRequest(prompt=[ord("z")] * 150, max_tokens=10, seed=3)  # 160 positions = 40 pages
    too_big = GenerationRequest(prompt=[ord("y")] * 150, max_tokens=11, seed=4)  # 41 pages
    h.submit(fits)
    h.submit(too_big)
    h.drain()
    assert h.submitted[-2].result.finish_reason in ("stop", "length")
    rejected = h.submitted[-1].result
    assert rejected.finish_reason == "error" and rejected.error.kind == "infeasible"
    h.finish(cold_tokens)
