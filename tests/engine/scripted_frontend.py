"""A byte-level Frontend for Engine tests (token id = byte), implementing the Frontend contract.

Output semantics it implements for real: EOS (id 0) and stop token ids end generation (the stopping
token is accepted, never shown); stop strings end generation inside a span (accepted = tokens up to the
one completing the stop string), with held-back text while a stop string may still be forming; a
thinking budget forces the close tag ``</think>`` as forced-control tokens once the budget is reached,
and with ``parse_reasoning`` the text before it goes to ``reasoning_text``.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ninfer.runtime.contract.frontend import OutputOptions

EOS = 0
THINK_CLOSE: tuple[int, ...] = tuple(b"</think>")


@dataclass(frozen=True)
class PreparedPrompt:
    token_ids: tuple[int, ...]
    digest: str
    opens_thinking: bool = False
    tools: tuple[Mapping[str, Any], ...] | None = None
    serial: int = 0  # test-only: which prepare call made it (maps Program sequences to requests)


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class OutputDelta:
    text: str = ""
    reasoning_text: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class _SessionState:
    content: str = ""  # all decoded content characters committed (including held-back ones)
    emitted: int = 0  # content characters already published
    tokens: int = 0  # committed model tokens
    thinking_open: bool = False
    awaiting_force: bool = False
    forced: bool = False
    stopped: bool = False


@dataclass(frozen=True)
class OutputPreview:
    accepted: int
    stop: bool
    delta: OutputDelta
    force_tokens: tuple[int, ...]
    base: _SessionState
    after: _SessionState


class OutputSession:
    def __init__(self, prompt: PreparedPrompt, options: OutputOptions) -> None:
        self.prompt = prompt
        self.options = options
        parse = options.parse_reasoning
        self.state = _SessionState(
            thinking_open=prompt.opens_thinking if parse is None else parse and prompt.opens_thinking
        )
        self.committed: list[OutputDelta] = []
        self.forced_tokens = 0  # committed tokens that came as forced control
        self.finished = False
        self._latest: OutputPreview | None = None

    @property
    def awaiting_force(self) -> bool:
        """As of the latest preview: the Engine decides the next unit from it and commits the session
        only while that unit runs (Committer.publish_committed)."""
        latest = self._latest
        if latest is not None and latest.base is self.state:  # previewed, commit still to come
            return latest.after.awaiting_force
        return self.state.awaiting_force

    def _held_back(self, content: str) -> int:
        """Length of the longest content suffix that is a proper prefix of a stop string."""
        best = 0
        for stop in self.options.stop_strings:
            for k in range(min(len(stop) - 1, len(content)), 0, -1):
                if content.endswith(stop[:k]):
                    best = max(best, k)
                    break
        return best

    def preview(self, token_ids: Sequence[int]) -> OutputPreview:
        s = self.state
        if s.stopped or self.finished:
            raise AssertionError("preview after the session stopped")
        ids = tuple(token_ids)
        # the Engine may cut forced tokens at the max_tokens budget: any non-empty prefix is legal
        is_forced = s.awaiting_force and ids == THINK_CLOSE[: len(ids)]
        if s.awaiting_force and not is_forced:
            raise AssertionError(f"expected (a prefix of) the forced close tag, got {ids}")
        stop_ids = set(self.options.stop_token_ids) | (set() if self.options.ignore_eos else {EOS})
        content, reasoning = s.content, ""
        thinking_open = s.thinking_open
        accepted, stop, stop_at = len(ids), False, None
        if is_forced:
            thinking_open = False
        else:
            for i, t in enumerate(ids):
                if t in stop_ids:
                    accepted, stop = i + 1, True
                    break
                if t == EOS:  # ignore_eos: EOS is a special token, never shown
                    continue
                if thinking_open:
                    reasoning += chr(t)
                    continue
                content += chr(t)
                for stop_str in self.options.stop_strings:
                    at = content.find(stop_str, max(0, len(s.content) - len(stop_str) + 1))
                    if at != -1 and (stop_at is None or at < stop_at):
                        stop_at = at
                if stop_at is not None:
                    accepted, stop = i + 1, True
                    break
        if stop_at is not None:
            stop_str = next(x for x in self.options.stop_strings if content.startswith(x, stop_at))
            visible_end = stop_at + (len(stop_str) if self.options.include_stop_str else 0)
            content = content[:visible_end]
            emit_to = len(content)
        elif stop:
            emit_to = len(content)  # a stop token ends it: nothing can still form a stop string
        else:
            emit_to = len(content) - self._held_back(content)
        tokens = s.tokens + accepted
        force: tuple[int, ...] = ()
        budget = self.options.thinking_budget
        if not stop and budget is not None and thinking_open and not s.forced and tokens >= budget:
            force = THINK_CLOSE
        after = _SessionState(
            content=content,
            emitted=max(s.emitted, emit_to),
            tokens=tokens,
            thinking_open=thinking_open,
            awaiting_force=bool(force),
            forced=s.forced or bool(force) or is_forced,
            stopped=stop,
        )
        delta = OutputDelta(
            text=content[s.emitted : after.emitted], reasoning_text=reasoning, token_ids=ids[:accepted]
        )
        self._latest = OutputPreview(accepted, stop, delta, force, s, after)
        return self._latest

    def commit(self, preview: OutputPreview) -> OutputDelta:
        if preview.base is not self.state:
            raise AssertionError("commit of a stale preview")
        if preview.base.awaiting_force:
            self.forced_tokens += preview.accepted
        self.state = preview.after
        self.committed.append(preview.delta)
        return preview.delta

    def finish(self) -> OutputDelta:
        if self.finished:
            raise AssertionError("finish twice")
        self.finished = True
        s = self.state
        if s.stopped:
            return OutputDelta()
        self.state = _SessionState(
            s.content, len(s.content), s.tokens, s.thinking_open, False, s.forced, stopped=True
        )
        return OutputDelta(text=s.content[s.emitted :])


class ScriptedFrontend:
    def __init__(self, generation_defaults: Mapping[str, Any] | None = None) -> None:
        self._serials = itertools.count(1)
        self.sessions: dict[int, OutputSession] = {}  # prompt serial -> its session
        # the model's generation_config sampling defaults (none: every field takes its neutral value)
        self.generation_defaults: dict[str, Any] = dict(generation_defaults or {})

    def _prepared(self, ids: Sequence[int], opens_thinking: bool = False) -> PreparedPrompt:
        ids = tuple(ids)
        digest = hashlib.sha256(bytes(ids)).hexdigest()
        return PreparedPrompt(ids, digest, opens_thinking, None, next(self._serials))

    def prepare_text(self, text: str) -> PreparedPrompt:
        data = text.encode("utf-8")
        if EOS in data:
            raise ValueError("text contains the EOS byte")
        return self._prepared(data)

    def prepare_tokens(self, token_ids: Sequence[int]) -> PreparedPrompt:
        if any(not 0 <= t < 256 for t in token_ids):
            raise ValueError("token id outside the byte vocabulary 0..255")
        return self._prepared(token_ids)

    def prepare_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> PreparedPrompt:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        thinking = bool(template_kwargs.get("enable_thinking", False))
        if thinking:
            text += "<think>"
        return self._prepared(text.encode("utf-8"), opens_thinking=thinking)

    def new_output_session(self, prompt: PreparedPrompt, options: OutputOptions) -> OutputSession:
        session = OutputSession(prompt, options)
        self.sessions[prompt.serial] = session
        return session
