"""MTP (``mtp:K``, K random 1..4) on the real tiny Program, random schedules stepped by hand, against
plain decoding: the smaller, real-model half of tests/engine/test_engine_mtp_properties.py (whose 200
scripted scenarios drive multi-token accepted prefixes through the commit path; the tiny model's random
MTP head rejects nearly every draft, so here rows mostly accept one token a round, which is what the real
verify and commit must get right too).

Each scenario: up to five greedy requests of random prompts and budgets, some arriving while others
decode, some cancelled at a random boundary, the context cache on or off. Every request that ends
normally gives the tokens of the same request alone on a plain cold Engine; a cancelled one a prefix of
them. After the drain every lane is free, the Program holds no active resource, and a cache reset returns
every state slot and KV page to the pools.
"""

from __future__ import annotations

import functools

import torch
from cache_helpers import build_engine, tiny_view
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from integration_helpers import random_prompts

from ninfer import Engine, GenerationRequest
from ninfer.runtime.engine.resource_manager import LaneState
from ninfer.targets.qwen3_6.impl.runtime.backends.mtp import MtpDraft
from ninfer.targets.qwen3_6.impl.runtime.program import Qwen36Program

torch.set_num_threads(1)

NAME = "qwen3_6_tiny"


def engine(k: int | None, mc: int, cache: bool) -> Engine:
    base = build_engine(NAME, view=tiny_view(NAME), max_concurrency=mc, prefix_cache=cache, chunk=16,
                        capture_interval=32, checkpoint_slots=3, start_worker=False)
    old = base.core.program
    assert isinstance(old, Qwen36Program)
    base.close()
    backend = MtpDraft(draft_tokens=k, layers=1) if k else None
    program = Qwen36Program(old.variant, old.view, old.config, backend=backend)
    built = Engine.from_parts(program, base.frontend, base.config, package_name=NAME, start_worker=False)
    built.core.resources.cache.min_capture_gap = 8
    return built


@functools.cache
def _plain() -> Engine:
    return engine(None, 1, False)


def plain_tokens(request: GenerationRequest) -> tuple[int, ...]:
    return _plain_tokens(tuple(request.prompt), request.max_tokens)  # type: ignore[arg-type]


@functools.cache
def _plain_tokens(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    e = _plain()
    handle = e.submit(GenerationRequest(prompt=list(prompt), max_tokens=max_tokens, temperature=0.0,
                                        ignore_eos=True))
    while not e.core.idle:
        e.core.step()
    return handle.result(0).token_ids


(SHARED,) = random_prompts([40], seed=5)


def prompt(length: int, seed: int, shared: bool) -> list[int]:
    (tail,) = random_prompts([length], seed=seed)
    return (SHARED[:length] if shared else []) + tail


request = st.tuples(st.integers(1, 24), st.integers(0, 50), st.booleans(), st.integers(1, 10),
                    st.integers(0, 6), st.one_of(st.none(), st.integers(1, 12)))


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 4), mc=st.integers(1, 4), cache=st.booleans(),
       requests=st.lists(request, min_size=1, max_size=5))
def test_mtp_schedules_give_plain_tokens(k: int, mc: int, cache: bool, requests: list[tuple]) -> None:
    note(repr(dict(k=k, mc=mc, cache=cache, requests=requests)))
    e = engine(k, mc, cache)
    core = e.core
    submitted = []
    # (arrival boundary, cancel boundary or None): request i arrives `delay` boundaries after the last
    schedule = []
    at = 0
    for length, seed, shared, max_tokens, delay, cancel_after in requests:
        at += delay
        r = GenerationRequest(prompt=prompt(length, seed, shared), max_tokens=max_tokens, temperature=0.0,
                              ignore_eos=True)
        schedule.append((at, None if cancel_after is None else at + cancel_after, r))
    boundary = 0
    while boundary <= max(a for a, _, _ in schedule) or not core.idle:
        for arrive, cancel, r in schedule:
            if arrive == boundary:
                submitted.append((r, e.submit(r)))
            if cancel == boundary and len(submitted) > 0:
                for s, handle in submitted:
                    if s is r:
                        handle.cancel()
        core.step()
        boundary += 1
        assert boundary < 2000, "the Engine did not drain"
    assert not core.failed, core.availability.reason
    for r, handle in submitted:
        result = handle.result(0, raise_on_error=False)
        want = plain_tokens(r)
        if result.finish_reason == "cancelled":
            assert result.token_ids == want[: len(result.token_ids)]
        else:
            assert result.finish_reason == "length" and result.token_ids == want, (r, result.usage)
    program = core.program
    assert all(lane.state is LaneState.FREE for lane in core.resources.lanes)
    assert program.usage() == core.baseline
    reset = core.request_cache_reset()
    core.step()
    reset.wait(0)
    book = program.book
    assert book.pages.free_count == book.pages.size and book.slots.free_count == book.slots.size
    assert book.indices.free_count == book.indices.size
    e.close()
