"""The three features in one conversation: a chat whose turns carry images, run with the context cache
and speculative drafting (MTP, and DFlash) together at ``max_concurrency`` 4, gives each turn the tokens
and log-probs of the same prompt run cold (cache off) with plain decoding, and reuses its earlier turns
past the images."""

from __future__ import annotations

import pytest
import torch
from cache_helpers import PACKAGE_NAMES, SYSTEM, assistant_message, build_engine
from vision_oracle import SMALL_CONFIG, frontend, png

from ninfer import GenerationRequest, GenerationResult
from ninfer.media.decode import decode_image
from ninfer.runtime.engine.engine import Engine
from ninfer.targets.qwen3_6.impl.runtime.backends.dflash import DFlashDraft
from ninfer.targets.registry import PACKAGES

torch.set_num_threads(1)

KWARGS = {"enable_thinking": False}
TURNS = 3


def _user(turn: int, chat: int) -> dict:
    text = {"type": "text", "text": f"Chat {chat}, picture {turn}: what changed, and why? " * 2}
    if turn == 1:  # the second turn is text only: reuse runs past the first turn's image
        return {"role": "user", "content": text["text"]}
    image = {"type": "image", "image": decode_image(png(48 + 16 * turn, 40, seed=10 * chat + turn))}
    return {"role": "user", "content": [text, image]}


def _chats(engine: Engine, chats: int) -> list[list[GenerationResult]]:
    """``chats`` conversations of ``TURNS`` turns, their turns submitted together (one per chat)."""
    histories: list[list[dict]] = [[{"role": "system", "content": SYSTEM}] for _ in range(chats)]
    results: list[list[GenerationResult]] = [[] for _ in range(chats)]
    for turn in range(TURNS):
        handles = []
        for chat, history in enumerate(histories):
            history.append(_user(turn, chat))
            request = GenerationRequest(
                messages=list(history), chat_template_kwargs=KWARGS, max_tokens=8, temperature=0.0,
                logprobs=True, session_id=f"chat-{chat}",
            )  # fmt: skip
            handles.append(engine.submit(request))
        for chat, handle in enumerate(handles):
            result = handle.result()
            results[chat].append(result)
            histories[chat].append(assistant_message(result))
    return results


@pytest.mark.parametrize("drafter", ["mtp", "dflash"])
@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_reuse_drafts_and_images_together_give_the_cold_plain_tokens(name: str, drafter: str) -> None:
    with build_engine(name, prefix_cache=False, max_concurrency=4) as engine:
        cold = _chats(engine, 3)
    dims = PACKAGES[name].drafter
    speculative = (
        {"draft_tokens": 2}
        if drafter == "mtp"
        else {"backend": DFlashDraft(draft_tokens=3, dims=dims), "drafter": True}
    )
    with build_engine(name, max_concurrency=4, **speculative) as engine:  # type: ignore[arg-type]
        warm = _chats(engine, 3)
        stats = engine.cache_stats()
    for got_chat, want_chat in zip(warm, cold):
        for got, want in zip(got_chat, want_chat):
            assert got.token_ids == want.token_ids
            assert got.logprobs is not None and want.logprobs is not None
            for a, b in zip(got.logprobs, want.logprobs):
                assert abs(a.logprob - b.logprob) <= 1e-4
        assert all(t.usage.reused_prefix_tokens > 0 for t in got_chat[1:])
        assert all(t.usage.drafted_tokens > 0 for t in got_chat)
    assert stats.hits >= 3 * (TURNS - 1)
    # turn 2 (text only) continues turn 1's checkpoint past its image
    first = frontend(SMALL_CONFIG).prepare_chat(
        [{"role": "system", "content": SYSTEM}, _user(0, 0)], **KWARGS
    )  # fmt: skip
    (image,) = first.images
    assert warm[0][1].usage.reused_prefix_tokens > image.token_offset + image.num_tokens
