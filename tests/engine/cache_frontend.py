"""The byte-level scripted Frontend with the context cache's reuse boundaries.

A chat renders every message as ``role:`` + body + EOS + ``\\n`` (EOS, id 0, plays ``<|im_end|>``); an
assistant body opens with ``>`` (the empty think block of the real templates), and the generation prompt
is ``assistant:>``. So a reply that ends with EOS is reproduced token for token by the next turn's
render (`assistant_message`), and the prompt boundaries are those of the real Frontend: the end of the
system preamble and the start of every assistant body (the generation prompt's included, one token
before the prompt's end). An output span that ends the turn with EOS has the boundary ``accepted``; a
stop string, a stop id other than EOS or a length cut has none. Previews also carry the thinking
budget's ``control_horizon``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from scripted_frontend import (
    EOS,
    THINK_CLOSE,
    OutputPreview,
    OutputSession,
    PreparedPrompt,
    ScriptedFrontend,
)

from ninfer.runtime.contract.frontend import OutputOptions
from ninfer.types import GenerationResult


@dataclasses.dataclass(frozen=True)
class BoundedPrompt(PreparedPrompt):
    boundaries: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class BoundedPreview(OutputPreview):
    boundaries: tuple[int, ...] = ()
    control_horizon: int | None = None


class BoundedSession(OutputSession):
    """`OutputSession` whose previews say where the history renderer reproduces the output."""

    def __init__(self, prompt: PreparedPrompt, options: OutputOptions, fail: dict[str, int] | None) -> None:
        super().__init__(prompt, options)
        self.fail = fail or {}  # {"preview"|"commit"|"finish"|"boundaries": n}: the n-th call raises
        self.counts: dict[str, int] = {}

    def _maybe_fail(self, name: str) -> None:
        n = self.counts.get(name, 0) + 1
        self.counts[name] = n
        if self.fail.get(name) == n:
            raise RuntimeError(f"injected output fault in {name} (call {n})")

    def preview(self, token_ids: Sequence[int]) -> BoundedPreview:
        self._maybe_fail("preview")
        p = super().preview(token_ids)
        ids = tuple(token_ids)
        ends_turn = p.stop and ids[p.accepted - 1] == EOS and not p.base.awaiting_force
        budget = self.options.thinking_budget
        horizon = None
        if budget is not None and p.after.thinking_open and not p.after.forced and not p.stop:
            horizon = max(1, budget - p.after.tokens)
        fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(OutputPreview)}
        preview: BoundedPreview | _FailingBoundaries
        if ends_turn and "boundaries" in self.fail:
            preview = _FailingBoundaries(**fields, control_horizon=horizon)
        else:
            bounds = (p.accepted,) if ends_turn else ()
            if ends_turn and "bad_boundaries" in self.fail:  # a Frontend contract break
                bounds = (p.accepted + 1,)
            preview = BoundedPreview(**fields, boundaries=bounds, control_horizon=horizon)
        self._latest = preview
        return preview

    def commit(self, preview: OutputPreview) -> Any:
        self._maybe_fail("commit")
        return super().commit(preview)

    def finish(self) -> Any:
        self._maybe_fail("finish")
        return super().finish()


@dataclasses.dataclass(frozen=True)
class _FailingBoundaries(OutputPreview):
    """A preview whose ``boundaries`` raise (a Frontend hint that fails)."""

    control_horizon: int | None = None

    @property
    def boundaries(self) -> tuple[int, ...]:
        raise RuntimeError("injected output fault in boundaries")


class CacheFrontend(ScriptedFrontend):
    """See the module docstring. ``fail``: output faults for the sessions of prompts whose text contains
    a key of it (``{"boom": {"commit": 1}}``)."""

    def __init__(self, fail: dict[str, dict[str, int]] | None = None) -> None:
        super().__init__()
        self.fail = fail or {}

    def _bounded(self, ids: Sequence[int], boundaries: Sequence[int], opens_thinking: bool) -> BoundedPrompt:
        p = self._prepared(ids, opens_thinking)
        return BoundedPrompt(p.token_ids, p.digest, p.opens_thinking, None, p.serial, tuple(boundaries))

    def prepare_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> BoundedPrompt:
        ids: list[int] = []
        boundaries: list[int] = []
        for m in messages:
            ids += f"{m['role']}:".encode()
            if m["role"] == "assistant":
                boundaries.append(len(ids))
                ids += b">"
            ids += str(m["content"]).encode()
            ids += bytes([EOS]) + b"\n"
            if m["role"] == "system" and len(boundaries) == 0:
                boundaries.append(len(ids))
        ids += b"assistant:"
        boundaries.append(len(ids))
        ids += b">"
        thinking = bool(template_kwargs.get("enable_thinking", False))
        if thinking:
            ids += b"<think>"
        return self._bounded(ids, boundaries, thinking)

    def new_output_session(self, prompt: PreparedPrompt, options: OutputOptions) -> BoundedSession:
        text = bytes(prompt.token_ids).decode("latin-1")
        fail = next((f for key, f in self.fail.items() if key in text), None)
        session = BoundedSession(prompt, options, fail)
        self.sessions[prompt.serial] = session
        return session


def assistant_message(result: GenerationResult) -> dict[str, Any]:
    """The assistant message a client sends back (the content; EOS ends it in the render)."""
    return {"role": "assistant", "content": result.text}


__all__ = ["EOS", "THINK_CLOSE", "BoundedPrompt", "CacheFrontend", "assistant_message"]
