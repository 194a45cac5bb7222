"""Random schedules of cached requests on the real Program (tiny model, driven step by step; plain or MTP
decoding, K = 2 or 3): prompts
that share prefixes of one document, chat sessions whose next turn follows a finished one, up to four at
once, few checkpoint slots (so eviction runs), cancellations between and during units, cache resets.

Every request that ends normally gives the tokens of the same request run alone on a cold Engine; a
cancelled one published a prefix of them. After the drain, the ResourceManager's catalog and the
Program's checkpoints are the same set, every lane is free, the Program holds no active resource, and a
reset returns every slot and page to the pools.
"""

from __future__ import annotations

import functools

import torch
from cache_helpers import SYSTEM, assistant_message, build_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from integration_helpers import random_prompts

from ninfer import Engine, GenerationRequest
from ninfer.runtime.engine.resource_manager import LaneState
from ninfer.types import GenerationResult

torch.set_num_threads(1)

NAME = "qwen3_6_tiny"
(DOCUMENT,) = random_prompts([400], seed=21)
KWARGS = {"enable_thinking": False, "preserve_thinking": True}


@functools.cache
def _cold_engine() -> Engine:
    return build_engine(NAME, prefix_cache=False)


_COLD: dict[str, tuple[int, ...]] = {}


def cold_tokens(request: GenerationRequest) -> tuple[int, ...]:
    """The request's tokens run alone on a cold Engine (memoized by content)."""
    key = repr((request.prompt, request.messages, request.max_tokens))
    if key not in _COLD:
        _COLD[key] = _cold_engine().generate(request).token_ids
    return _COLD[key]


def document_request(cut: int, tail_seed: int, max_tokens: int) -> GenerationRequest:
    (tail,) = random_prompts([3], seed=tail_seed)
    return GenerationRequest(
        prompt=DOCUMENT[:cut] + tail, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
    )


def chat_request(messages: list[dict], session: str) -> GenerationRequest:
    return GenerationRequest(
        messages=messages, chat_template_kwargs=KWARGS, max_tokens=6, temperature=0.0, session_id=session
    )


document = st.tuples(st.just("document"), st.integers(1, 399), st.integers(0, 3), st.integers(1, 6))
follow = st.tuples(st.just("follow"), st.integers(0, 30))
action = st.one_of(
    document,
    document,
    document,
    st.tuples(st.just("chat"), st.integers(0, 2)),
    follow,
    follow,
    st.tuples(st.just("step"), st.integers(1, 8)),
    st.tuples(st.just("step"), st.integers(4, 30)),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
    st.tuples(st.just("reset")),
)


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mc=st.integers(1, 4),
    slots=st.integers(1, 6),
    chunk=st.integers(8, 48),
    draft_tokens=st.sampled_from([0, 0, 2, 3]),
    actions=st.lists(action, min_size=10, max_size=30),
)
def test_cached_schedules_give_cold_tokens_and_keep_the_books_equal(
    mc: int, slots: int, chunk: int, draft_tokens: int, actions: list[tuple]
) -> None:
    engine = build_engine(
        NAME, max_concurrency=mc, checkpoint_slots=slots, chunk=chunk, capture_interval=48,
        start_worker=False, draft_tokens=draft_tokens,
    )  # fmt: skip
    core = engine.core
    core.resources.cache.min_capture_gap = 16
    # each entry: (request, handle, messages or None); results[i] once the request ended
    submitted: list[tuple[GenerationRequest, object, list[dict] | None]] = []
    results: dict[int, GenerationResult] = {}
    resets = []

    def collect() -> None:
        for i, (_, handle, _) in enumerate(submitted):
            if i not in results and handle.done:  # type: ignore[attr-defined]
                results[i] = handle.result(0, raise_on_error=False)  # type: ignore[attr-defined]

    def submit(request: GenerationRequest, messages: list[dict] | None) -> None:
        submitted.append((request, engine.submit(request), messages))

    for act in actions:
        kind = act[0]
        if kind == "document":
            submit(document_request(*act[1:]), None)
        elif kind == "chat":
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Topic {act[1]}? " * 4},
            ]
            submit(chat_request(messages, f"s{len(submitted)}"), messages)
        elif kind == "follow" and results:
            i = sorted(results)[act[1] % len(results)]
            request, _, messages = submitted[i]
            if messages is not None and results[i].finish_reason in ("stop", "length"):
                follow = [
                    *messages,
                    assistant_message(results[i]),
                    {"role": "user", "content": "And then? " * 3},
                ]
                submit(chat_request(follow, request.session_id or ""), follow)
        elif kind == "step":
            for _ in range(act[1]):
                core.step()
        elif kind == "cancel" and submitted:
            submitted[act[1] % len(submitted)][1].cancel()  # type: ignore[attr-defined]
        elif kind == "reset":
            resets.append(core.request_cache_reset())
        collect()
    for _ in range(5000):
        if core.idle:
            break
        core.step()
    assert core.idle, "the Engine did not drain"
    collect()
    assert not core.failed and len(results) == len(submitted)
    assert all(reset.wait(0) >= 0 for reset in resets)

    for i, (request, _, _) in enumerate(submitted):
        result = results[i]
        expected = cold_tokens(request)
        if result.finish_reason == "cancelled":
            assert result.token_ids == expected[: len(result.token_ids)]
        else:
            assert result.finish_reason in ("stop", "length"), result
            assert result.token_ids == expected, (i, result.usage)

    program = core.program
    assert all(lane.state is LaneState.FREE for lane in core.resources.lanes)
    assert set(core.resources.cache.entries) == set(program.book.checkpoints)
    usage = program.usage()
    assert usage.sequences == usage.open_transactions == usage.state_slots == usage.kv_pages_reserved == 0
    assert usage.checkpoint_state_slots == len(program.book.checkpoints)
    held = {p for c in program.book.checkpoints.values() for p in c.pages}
    assert program.book.pages.size - program.book.pages.free_count == len(held)
    count = len(program.book.checkpoints)
    reset = core.request_cache_reset()
    core.step()  # no worker thread: the next boundary carries it out
    assert reset.wait(0) == count
    assert not program.book.checkpoints and not core.resources.cache.entries
    assert program.book.pages.free_count == program.book.pages.size
    assert program.book.slots.free_count == program.book.slots.size
    engine.close()
