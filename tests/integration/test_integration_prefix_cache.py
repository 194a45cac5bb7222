"""The context cache through the public Engine, against cold runs (``prefix_cache=False``) of the same
requests: multi-turn chats (thinking on and off, preserve_thinking, tools and tool loops, sampled), a
system prompt shared by many sessions, a long document continued at many points, concurrent sessions,
eviction under pressure, cache reset, requests that opt out. Each must give the cold run's tokens, and
reuse exactly what the policy promises (docs/resources-and-context-cache.md)."""

from __future__ import annotations

import pytest
import torch
from cache_helpers import PACKAGE_NAMES, SYSTEM, TOOLS, Turn, build_engine, conversation
from integration_helpers import random_prompts
from vision_oracle import SMALL_CONFIG, frontend

from ninfer import GenerationRequest

torch.set_num_threads(1)

CHAT_CASES = {
    "plain": {"enable_thinking": False},
    "plain-preserved": {"enable_thinking": False, "preserve_thinking": True},
    "thinking": {"enable_thinking": True},
    "thinking-preserved": {"enable_thinking": True, "preserve_thinking": True},
}


def _prompt(turn: Turn, tools: list | None, kwargs: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    prompt = frontend(SMALL_CONFIG).prepare_chat(turn.messages, tools=tools, **kwargs)
    return tuple(prompt.token_ids), tuple(prompt.boundaries)


def _check_reuse(turns: list[Turn], tools: list | None, kwargs: dict) -> int:
    """Each turn reuses at least the longest of what the policy kept from the turns before that its
    prompt starts with: every prompt's first and last boundaries (the system preamble, the reply start)
    and each finished turn the Frontend foresaw as reproduced (a user query or tool results follow it),
    whose prompt + output up to its last token the next prompt holds. Returns how many turns the next
    prompt held as generated (each must have been retained)."""
    kept: list[tuple[int, ...]] = []  # token prefixes the catalog holds a checkpoint of
    reproduced = 0
    for before, after in zip(turns, turns[1:]):
        ids, boundaries = _prompt(before, tools, kwargs)
        next_ids, _ = _prompt(after, tools, kwargs)
        kept += [ids[: boundaries[0]], ids[: boundaries[-1]]]
        produced = ids + before.result.token_ids
        foreseen = after.messages[len(before.messages) + 1]["role"] in ("user", "tool")
        if before.result.finish_reason == "stop" and next_ids[: len(produced)] == produced and foreseen:
            kept.append(produced[:-1])
            reproduced += 1
        best = max((len(k) for k in kept if next_ids[: len(k)] == k and len(k) < len(next_ids)), default=0)
        reused = after.result.usage.reused_prefix_tokens
        assert reused >= best, (reused, best)
        assert any(next_ids[:reused] == k[:reused] for k in kept)
    return reproduced


@pytest.mark.parametrize("name", PACKAGE_NAMES)
@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_multi_turn_chat_reuses_every_turn_and_gives_the_cold_tokens(name: str, case: str) -> None:
    kwargs = CHAT_CASES[case]
    thinking = kwargs["enable_thinking"]
    with build_engine(name, thinking=thinking, prefix_cache=False) as engine:
        cold = conversation(engine, 6, kwargs=kwargs, session_id="a")
    with build_engine(name, thinking=thinking) as engine:
        warm = conversation(engine, 6, kwargs=kwargs, session_id="a")
        stats = engine.cache_stats()
    assert [t.result.token_ids for t in warm] == [t.result.token_ids for t in cold]
    assert [t.messages for t in warm] == [t.messages for t in cold]
    assert warm[0].result.usage.reused_prefix_tokens == 0
    assert all(t.result.usage.reused_prefix_tokens > 0 for t in warm[1:])
    assert all(t.result.usage.reused_prefix_tokens == 0 for t in cold)
    reproduced = _check_reuse(warm, None, kwargs)
    assert stats.hits == 5 and stats.hit_tokens == sum(t.result.usage.reused_prefix_tokens for t in warm)
    assert stats.queries == 6  # one per admission, the first (empty catalog) included
    assert stats.retains >= reproduced
    if case == "plain-preserved" and name == "qwen3_6_tiny":  # this one's replies round-trip
        assert reproduced > 0


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_tool_loop_with_and_without_a_system_message(name: str) -> None:
    for system in (SYSTEM, None):
        with build_engine(name, prefix_cache=False) as engine:
            cold = conversation(engine, 4, tools=TOOLS, system=system, kwargs={"enable_thinking": False})
        with build_engine(name) as engine:
            warm = conversation(engine, 4, tools=TOOLS, system=system, kwargs={"enable_thinking": False})
        assert [t.result.token_ids for t in warm] == [t.result.token_ids for t in cold]
        assert all(t.result.usage.reused_prefix_tokens > 0 for t in warm[1:])
        _check_reuse(warm, TOOLS, {"enable_thinking": False})


def test_sampled_turns_give_the_cold_tokens() -> None:
    """Sampling draws depend on (seed, position) only, so a continued checkpoint samples the same."""
    fields = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "presence_penalty": 0.5}
    with build_engine("qwen3_6_tiny", prefix_cache=False) as engine:
        cold = conversation(engine, 4, kwargs={"enable_thinking": False}, **fields)
    with build_engine("qwen3_6_tiny") as engine:
        warm = conversation(engine, 4, kwargs={"enable_thinking": False}, **fields)
    assert [t.result.token_ids for t in warm] == [t.result.token_ids for t in cold]
    assert all(t.result.usage.reused_prefix_tokens > 0 for t in warm[1:])


def test_a_shared_system_prompt_serves_every_session() -> None:
    """Sessions that open with the same system prompt continue one checkpoint at its end; their first
    turns give the cold tokens."""
    ids = frontend(SMALL_CONFIG).prepare_chat(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
    )
    preamble = ids.boundaries[0]
    with build_engine("qwen3_6_tiny", prefix_cache=False) as engine:
        cold = [conversation(engine, 1, topic=f"topic{i}")[0].result for i in range(4)]
    with build_engine("qwen3_6_tiny") as engine:
        warm = [conversation(engine, 1, topic=f"topic{i}", session_id=f"s{i}")[0].result for i in range(4)]
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    assert warm[0].usage.reused_prefix_tokens == 0
    assert all(r.usage.reused_prefix_tokens == preamble for r in warm[1:])


def test_a_long_document_is_continued_from_the_nearest_checkpoint() -> None:
    """A raw prompt has no boundaries: checkpoints every ``capture_interval`` tokens. Prompts that share
    its first n tokens continue the last checkpoint at or below n (never past it)."""
    interval = 96
    (document,) = random_prompts([700], seed=5)
    tails = random_prompts([5] * 6, seed=6)
    cuts = [100, 200, 333, 480, 600, 699]
    requests = [GenerationRequest(prompt=document, max_tokens=6, temperature=0.0, ignore_eos=True)]
    requests += [
        GenerationRequest(prompt=document[:n] + tail, max_tokens=6, temperature=0.0, ignore_eos=True)
        for n, tail in zip(cuts, tails)
    ]
    with build_engine("qwen3_6_tiny_moe", prefix_cache=False, capture_interval=interval) as engine:
        cold = [engine.generate(r) for r in requests]
    with build_engine("qwen3_6_tiny_moe", capture_interval=interval, chunk=64) as engine:
        warm = [engine.generate(r) for r in requests]
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    assert [r.usage.reused_prefix_tokens for r in warm] == [0] + [n // interval * interval for n in cuts]


def test_concurrent_sessions_give_their_cold_tokens() -> None:
    """Four sessions at max_concurrency 4, each turn of each submitted together: the batched, cached run
    gives every session's cold single-lane tokens."""
    kwargs = {"enable_thinking": False}
    with build_engine("qwen3_6_tiny", prefix_cache=False) as engine:
        cold = [conversation(engine, 3, kwargs=kwargs, topic=f"t{i}") for i in range(4)]
    with build_engine("qwen3_6_tiny", max_concurrency=4) as engine:
        histories: list[list[dict]] = [[{"role": "system", "content": SYSTEM}] for _ in range(4)]
        warm: list[list[tuple[int, ...]]] = [[] for _ in range(4)]
        reused: list[int] = []
        for t in range(3):
            handles = []
            for i in range(4):
                histories[i].append({"role": "user", "content": f"t{i} {t}: what is it, and why? " * 2})
                request = GenerationRequest(
                    messages=list(histories[i]), chat_template_kwargs=kwargs, max_tokens=10, temperature=0.0,
                    session_id=f"s{i}",
                )  # fmt: skip
                handles.append(engine.submit(request))
            for i, handle in enumerate(handles):
                result = handle.result()
                warm[i].append(result.token_ids)
                reused.append(result.usage.reused_prefix_tokens)
                histories[i].append({"role": "assistant", "content": result.text})
    assert warm == [[t.result.token_ids for t in c] for c in cold]
    assert all(r > 0 for r in reused[4:])


def test_eviction_under_pressure_keeps_outputs_exact() -> None:
    """Two checkpoint slots for six sessions: checkpoints are evicted (least recently used first) and
    every output is still the cold one."""
    kwargs = {"enable_thinking": False}
    with build_engine("qwen3_6_tiny", prefix_cache=False) as engine:
        cold = [
            conversation(engine, 2, kwargs=kwargs, topic=f"e{i}", system=f"System {i}. " * 30)
            for i in range(6)
        ]
    with build_engine("qwen3_6_tiny", checkpoint_slots=2, kv_pages=MAX_PAGES) as engine:
        warm = [
            conversation(
                engine, 2, kwargs=kwargs, topic=f"e{i}", system=f"System {i}. " * 30, session_id=f"s{i}"
            )
            for i in range(6)
        ]
        stats = engine.cache_stats()
    assert [[t.result.token_ids for t in c] for c in warm] == [[t.result.token_ids for t in c] for c in cold]
    assert stats.evictions > 0
    assert all(c[1].result.usage.reused_prefix_tokens > 0 for c in warm)  # each session's own turn


MAX_PAGES = 1024 // 16 + 24  # one lane's pages and a little more: checkpoints compete for pages too


def test_reset_and_opt_out() -> None:
    """``prefix_cache=False`` on a request neither continues nor leaves a checkpoint; ``reset_cache``
    drops every checkpoint, after which a repeated prompt is cold again."""
    (prompt,) = random_prompts([300], seed=9)

    def request(**fields: object) -> GenerationRequest:
        return GenerationRequest(
            prompt=prompt + [11], max_tokens=4, temperature=0.0, ignore_eos=True, **fields
        )

    with build_engine("qwen3_6_tiny") as engine:
        first = engine.generate(request(prefix_cache=False))
        assert engine.cache_stats().checkpoints == 0
        second = engine.generate(request())
        assert second.usage.reused_prefix_tokens == 0 and engine.cache_stats().checkpoints > 0
        third = engine.generate(request())
        assert third.usage.reused_prefix_tokens == 256
        opted_out = engine.generate(request(prefix_cache=False))
        assert opted_out.usage.reused_prefix_tokens == 0
        held = engine.cache_stats().checkpoints
        assert engine.kv_cache_usage() > 0  # the checkpoints' pages, nothing running
        assert engine.reset_cache() == held and engine.cache_stats().checkpoints == 0
        assert engine.kv_cache_usage() == 0
        fourth = engine.generate(request())
        assert fourth.usage.reused_prefix_tokens == 0
        stats = engine.cache_stats()
    assert (stats.queries, stats.hits) == (3, 1)  # second, third, fourth: the opted-out ones never ask
    assert first.token_ids == second.token_ids == third.token_ids == opted_out.token_ids == fourth.token_ids


def test_negative_control_a_corrupted_checkpoint_changes_the_output() -> None:
    """The comparisons above can fail: perturb the recurrent state a checkpoint holds and the request
    that continues it no longer gives the cold tokens (then restore it, and it does again)."""
    (prompt,) = random_prompts([300], seed=9)
    request = GenerationRequest(prompt=prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
    with build_engine("qwen3_6_tiny") as engine:
        cold = engine.generate(request)
        program = engine.core.program
        checkpoint = max(program.book.checkpoints.values(), key=lambda c: c.frontier)
        store, slot = program.store, checkpoint.slot
        saved = store.rec[:, slot].clone()
        store.rec[:, slot] = (
            torch.randn(saved.shape, generator=torch.Generator().manual_seed(0)) * 10 * saved.std()
        )
        corrupted = engine.generate(request)
        store.rec[:, slot] = saved
        restored = engine.generate(request)
    assert corrupted.usage.reused_prefix_tokens == restored.usage.reused_prefix_tokens == checkpoint.frontier
    assert corrupted.token_ids != cold.token_ids
    assert restored.token_ids == cold.token_ids


def test_same_ids_other_content_is_not_reused() -> None:
    """Prefix identity is content: a prompt whose tokens differ from a checkpoint's prefix only in its
    first token continues nothing."""
    (prompt,) = random_prompts([300], seed=9)
    other = [prompt[0] + 1, *prompt[1:]]
    with build_engine("qwen3_6_tiny") as engine:
        engine.generate(GenerationRequest(prompt=prompt, max_tokens=2, temperature=0.0, ignore_eos=True))
        result = engine.generate(
            GenerationRequest(prompt=other, max_tokens=2, temperature=0.0, ignore_eos=True)
        )
    assert result.usage.reused_prefix_tokens == 0


def test_images_are_part_of_the_prefix_identity() -> None:
    """A chat with an image continues its own checkpoints past the image; the same chat with another
    image of the same size (the same token ids) reuses nothing past the image's first pad; both give the
    cold tokens."""
    from vision_oracle import png

    from ninfer.media.decode import decode_image

    def messages(seed: int, turns: int) -> list[dict]:
        image = {"type": "image", "image": decode_image(png(64, 48, seed=seed))}
        out: list[dict] = [{"role": "system", "content": SYSTEM}]
        out.append({"role": "user", "content": [{"type": "text", "text": "What is this? " * 4}, image]})
        for t in range(1, turns):
            out += [
                {"role": "assistant", "content": f"Answer {t}."},
                {"role": "user", "content": f"More {t}? " * 5},
            ]
        return out

    requests = [messages(0, 1), messages(0, 2), messages(1, 1)]
    kwargs = {"enable_thinking": False}

    def run(engine) -> list:
        return [
            engine.generate(
                GenerationRequest(messages=m, chat_template_kwargs=kwargs, max_tokens=6, temperature=0.0)
            )
            for m in requests
        ]

    with build_engine("qwen3_6_tiny", prefix_cache=False) as engine:
        cold = run(engine)
    with build_engine("qwen3_6_tiny") as engine:
        warm = run(engine)
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    (image,) = frontend(SMALL_CONFIG).prepare_chat(requests[2], **kwargs).images
    prompts = [frontend(SMALL_CONFIG).prepare_chat(m, **kwargs).token_ids for m in requests]
    assert prompts[2] == prompts[0]  # the same ids: only the image differs
    assert warm[1].usage.reused_prefix_tokens > image.token_offset + image.num_tokens
    assert 0 < warm[2].usage.reused_prefix_tokens <= image.token_offset
