"""Engines and conversations for the context-cache tests.

Every test compares a cached Engine with a cold one (``prefix_cache=False``): the same requests must give
the same tokens. The tiny random models almost never emit ``<|im_end|>`` on their own, so the views here
make them: the ``<|im_end|>`` row of ``lm_head`` becomes 1.25 x the row of a token the model emits early
in a reply, so a turn ends where that token would win, and finished turns exercise retention.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))

from qwen3_6_model_harness import tiny_view  # noqa: E402
from tiny_artifacts import with_drafter  # noqa: E402
from vision_oracle import SMALL_CONFIG, frontend  # noqa: E402

from ninfer import EngineConfig, GenerationRequest, GenerationResult  # noqa: E402
from ninfer.runtime.engine.engine import Engine  # noqa: E402
from ninfer.targets.qwen3_6.impl.runtime.backends.mtp import MtpDraft  # noqa: E402
from ninfer.targets.qwen3_6.impl.runtime.program import ProgramConfig, Qwen36Program  # noqa: E402
from ninfer.targets.qwen3_6.view import ModelView  # noqa: E402

PACKAGE_NAMES = ("qwen3_6_tiny", "qwen3_6_tiny_moe")
MAX_CONTEXT = 1024
PAGE_SIZE = 16
SYSTEM = "You are a careful assistant who answers in short sentences. " * 8
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def stopping_view(name: str, thinking: bool = False) -> ModelView:
    """`tiny_view` whose replies end with ``<|im_end|>`` after a few tokens (module docstring)."""
    return _stopping_view(name, thinking)


@functools.cache
def _stopping_view(name: str, thinking: bool) -> ModelView:
    view = tiny_view(name)
    with build_engine(name, view=view, prefix_cache=False) as engine:
        turns = conversation(engine, 6, kwargs={"enable_thinking": thinking})
    # the token the replies of this conversation repeat most, past their first three (so a reply that
    # stops has a few tokens)
    counts = collections.Counter(t for turn in turns for t in turn.result.token_ids[3:])
    marker = counts.most_common(1)[0][0]
    head = view.text.lm_head.clone()
    head[view.variant.special.im_end] = 1.25 * head[marker]
    return dataclasses.replace(view, text=dataclasses.replace(view.text, lm_head=head))


def build_engine(
    name: str,
    *,
    view: ModelView | None = None,
    thinking: bool = False,
    prefix_cache: bool = True,
    max_concurrency: int = 1,
    checkpoint_slots: int = 16,
    kv_pages: int | None = None,
    host_slots: int = 0,
    host_pages: int = 0,
    chunk: int = 32,
    capture_interval: int = 128,
    start_worker: bool = True,
    draft_tokens: int = 0,
    backend: Any = None,
    drafter: bool = False,
    clock: Any = None,
    **config_fields: Any,
) -> Engine:
    """A CPU fp32 Engine on the tiny package (the `stopping_view` of its chats with ``thinking`` unless
    ``view``) with room for ``checkpoint_slots`` checkpoints (``kv_pages`` defaults to the lanes' own
    pages plus as many again) and a host tier of ``host_slots`` slots and ``host_pages`` pages.
    ``start_worker=False``: no worker thread, the caller steps the core.
    ``draft_tokens``: decode with the MTP backend drafting that many tokens a round; ``backend``: decode
    with this backend instead; ``drafter``: the view also holds the package's DFlash drafter weights
    (`tiny_artifacts.with_drafter`); ``clock``: the
    Engine's clock; ``config_fields``: more EngineConfig fields."""
    if view is None:
        view = stopping_view(name, thinking)
    if drafter:
        view = with_drafter(view, name)
    lane_pages = MAX_CONTEXT // PAGE_SIZE * max_concurrency
    program = Qwen36Program(
        view.variant,
        view,
        ProgramConfig(
            max_concurrency=max_concurrency, max_context=MAX_CONTEXT, page_size=PAGE_SIZE,
            kv_pages=kv_pages if kv_pages is not None else 2 * lane_pages, device=torch.device("cpu"),
            dtype=torch.float32, checkpoint_slots=checkpoint_slots if prefix_cache else 0,
            host_checkpoint_slots=host_slots, host_kv_pages=host_pages,
        ),
        backend=backend or (MtpDraft(draft_tokens=draft_tokens, layers=1) if draft_tokens else None),
    )  # fmt: skip
    config = EngineConfig(
        max_concurrency=max_concurrency, device="cpu", dtype="float32", max_context=MAX_CONTEXT,
        page_size=PAGE_SIZE, prefill_chunk_tokens=chunk, warmup=False, prefix_cache=prefix_cache,
        capture_interval=capture_interval, **config_fields,
    )  # fmt: skip
    return Engine.from_parts(
        program, frontend(SMALL_CONFIG), config, package_name=name, clock=clock, start_worker=start_worker
    )


def _turn_request(
    messages: Sequence[Mapping[str, Any]],
    max_tokens: int,
    kwargs: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]] | None = None,
    session_id: str | None = None,
    **fields: Any,
) -> GenerationRequest:
    return GenerationRequest(
        messages=list(messages), tools=tools, chat_template_kwargs=dict(kwargs), max_tokens=max_tokens,
        temperature=fields.pop("temperature", 0.0), session_id=session_id, **fields,
    )  # fmt: skip


def assistant_message(result: GenerationResult) -> dict[str, Any]:
    """The assistant message an OpenAI client sends back for ``result``."""
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.reasoning_text:
        message["reasoning_content"] = result.reasoning_text
    return message


@dataclasses.dataclass
class Turn:
    messages: list[dict[str, Any]]  # the request's messages
    result: GenerationResult


def conversation(
    engine: Engine,
    turns: int,
    *,
    kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    session_id: str | None = None,
    system: str | None = SYSTEM,
    topic: str = "item",
    max_tokens: int = 10,
    **fields: Any,
) -> list[Turn]:
    """A chat of ``turns`` user turns, each reply sent back as the client would; with ``tools`` the
    second turn is a tool loop (a client-made call and its result)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    out: list[Turn] = []
    for t in range(turns):
        if tools and t == 1:
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'})
        else:
            messages.append({"role": "user", "content": f"{topic} {t}: what is it, and why? " * 2})
        request = _turn_request(messages, max_tokens, kwargs or {}, tools, session_id, **dict(fields))
        result = engine.generate(request)
        out.append(Turn(list(messages), result))
        messages.append(assistant_message(result))
    return out
