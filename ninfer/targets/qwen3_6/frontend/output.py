"""OutputSession: one request's output semantics, previewed purely and committed by the Engine.

Per token the pipeline is: stop token check -> thinking-budget accounting (by token id) -> incremental
detokenization -> stop strings (over the text, markers included, like vLLM) -> thinking/content split
-> tool-call parsing of the content. Every stage keeps only a small, immutable-valued state; ``preview``
runs the span on copies and keeps the result with the preview, ``commit`` adopts it. Committed totals
live outside the copied state, so a preview costs O(span), not O(output).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ninfer.targets.qwen3_6.frontend.detokenizer import IncrementalDetokenizer, Piece
from ninfer.targets.qwen3_6.frontend.reasoning import ChannelSplitter
from ninfer.targets.qwen3_6.frontend.stop import StopStringMatcher
from ninfer.targets.qwen3_6.frontend.tokenizer import TextTokenizer
from ninfer.targets.qwen3_6.frontend.tool_calls import ToolCallParser, tool_schemas
from ninfer.targets.qwen3_6.frontend.types import (
    OutputDelta,
    OutputOptions,
    OutputPreview,
    PreparedPrompt,
    ToolCall,
    ToolCallDelta,
)
from ninfer.targets.qwen3_6.variant import SpecialTokens

# added tokens that are markup inside the answer text rather than control tokens
TEXT_MARKUP_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
# the canonical text that closes reasoning at the thinking budget (the template's separator)
FORCED_THINK_CLOSE_TEXT = "\n</think>\n\n"

_DEFAULTS = OutputOptions()


def _option(options: Any, name: str) -> Any:
    """Read an option by attribute name, defaulting what an OutputOptions-shaped value lacks."""
    return getattr(options, name, getattr(_DEFAULTS, name))


@dataclass
class _State:
    """Everything a preview may change; components are copied, never shared, between previews."""

    detok: IncrementalDetokenizer
    stop: StopStringMatcher | None
    splitter: ChannelSplitter | None
    tools: ToolCallParser | None
    in_think: bool
    think_tokens: int

    def copy(self) -> _State:
        return _State(
            detok=self.detok.copy(),
            stop=self.stop.copy() if self.stop else None,
            splitter=self.splitter.copy() if self.splitter else None,
            tools=self.tools.copy() if self.tools else None,
            in_think=self.in_think,
            think_tokens=self.think_tokens,
        )


@dataclass
class _Acc:
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCallDelta] = field(default_factory=list)

    def delta(self, token_ids: tuple[int, ...]) -> OutputDelta:
        return OutputDelta(
            text="".join(self.text),
            reasoning_text="".join(self.reasoning),
            tool_calls=tuple(self.calls),
            token_ids=token_ids,
        )


class OutputSession:
    """Output state of one request. Used by one thread (the Engine worker)."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        special: SpecialTokens,
        prompt: PreparedPrompt,
        options: Any,
        eos_token_ids: Sequence[int],
    ) -> None:
        self._special = special
        stop_ids = set(int(i) for i in _option(options, "stop_token_ids"))
        if not _option(options, "ignore_eos"):
            stop_ids.update(int(i) for i in eos_token_ids)
        self._stop_ids = frozenset(stop_ids)
        self._skip_special = bool(_option(options, "skip_special_tokens"))
        budget = _option(options, "thinking_budget")
        if budget is not None and budget < 0:
            raise ValueError(f"thinking_budget must be >= 0, got {budget}")
        self._thinking_budget: int | None = budget
        self._force_ids = tuple(tokenizer.encode(FORCED_THINK_CLOSE_TEXT))
        stop_strings = tuple(_option(options, "stop_strings"))
        # channel and tool-call semantics are the Frontend's: decided from the prompt unless overridden
        parse_reasoning = _option(options, "parse_reasoning")
        if parse_reasoning is None:
            parse_reasoning = bool(getattr(prompt, "chat", False)) or prompt.opens_thinking
        parse_tools = _option(options, "parse_tool_calls")
        tools = getattr(prompt, "tools", None)
        schemas = tool_schemas(tools) if (bool(tools) if parse_tools is None else parse_tools) else {}
        # markup tokens stay text under skip_special_tokens: the parsers consume them, and unparsed they
        # are part of the raw answer (Qwen3's official tokenizer marks them special: false)
        markup = (tokenizer.token_id(t) for t in TEXT_MARKUP_TOKENS)
        self._markup_ids = frozenset(i for i in markup if i is not None)
        self._state = _State(
            detok=IncrementalDetokenizer(tokenizer),
            stop=StopStringMatcher(stop_strings, bool(_option(options, "include_stop_str")))
            if stop_strings
            else None,
            splitter=ChannelSplitter(prompt.opens_thinking) if parse_reasoning else None,
            tools=ToolCallParser(schemas, secrets.token_hex(8)) if schemas else None,
            in_think=prompt.opens_thinking,
            think_tokens=0,
        )
        self._pending: tuple[OutputPreview, _State, int | str | None] | None = None
        self._done = False
        # committed totals
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._token_ids: list[int] = []
        self._calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended output

    # ---- committed totals ---------------------------------------------------------------------
    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def reasoning_text(self) -> str:
        return "".join(self._reasoning)

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        calls = sorted(self._calls.items())
        return tuple(ToolCall(index=i, id=c[0], name=c[1], arguments=c[2]) for i, c in calls)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._token_ids)

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def force_tokens(self) -> tuple[int, ...]:
        """Forced control the committed state requires before the next model token: the thinking-budget
        close. Previews report the same after the span that reaches the budget; this also covers
        ``thinking_budget=0`` with a prompt that opens thinking, before any token was generated."""
        return () if self._done else self._budget_force(self._state)

    # ---- preview / commit ---------------------------------------------------------------------
    def preview(self, token_ids: Sequence[int]) -> OutputPreview:
        """The effect of appending ``token_ids`` to what is committed; the session does not change."""
        if self._done:
            raise RuntimeError("output session already finished")
        st = self._state.copy()
        acc = _Acc()
        accepted = 0
        stop_reason: int | str | None = None
        for raw in token_ids:
            tid = int(raw)
            accepted += 1
            if tid in self._stop_ids:
                stop_reason = tid
                self._flush(st, acc, pending_text=True)
                break
            self._count_thinking(st, tid)
            text = self._piece_text(st.detok.step(tid))
            if text and self._route(st, text, acc):
                stop_reason = st.stop.last_hit if st.stop is not None else None
                self._flush(st, acc, pending_text=False)
                break
        stop = stop_reason is not None
        force = () if stop else self._budget_force(st)
        ids = tuple(int(t) for t in token_ids[:accepted])
        preview = OutputPreview(accepted=accepted, stop=stop, delta=acc.delta(ids), force_tokens=force)
        self._pending = (preview, st, stop_reason)
        return preview

    def commit(self, preview: OutputPreview) -> OutputDelta:
        """Apply ``preview``, which must be the latest one of this session."""
        if self._pending is None or self._pending[0] is not preview:
            raise ValueError("commit() takes the latest preview of this session, not yet committed")
        _, st, stop_reason = self._pending
        self._pending = None
        self._state = st
        self._apply(preview.delta)
        if preview.stop:
            self._done = True
            self.finish_reason = "stop"
            self.stop_reason = stop_reason
        return preview.delta

    def finish(self) -> OutputDelta:
        """End of generation for a non-stop reason: flush everything held back. Idempotent."""
        self._pending = None
        if self._done:
            return OutputDelta()
        acc = _Acc()
        self._flush(self._state, acc, pending_text=True)
        self._done = True
        delta = acc.delta(())
        self._apply(delta)
        return delta

    # ---- pipeline -----------------------------------------------------------------------------
    def _apply(self, delta: OutputDelta) -> None:
        if delta.text:
            self._text.append(delta.text)
        if delta.reasoning_text:
            self._reasoning.append(delta.reasoning_text)
        self._token_ids.extend(delta.token_ids)
        for d in delta.tool_calls:
            call = self._calls.setdefault(d.index, ["", "", ""])
            if d.id is not None:
                call[0] = d.id
            if d.name is not None:
                call[1] = d.name
            call[2] += d.arguments

    def _budget_force(self, st: _State) -> tuple[int, ...]:
        budget = self._thinking_budget
        return self._force_ids if budget is not None and st.in_think and st.think_tokens >= budget else ()

    def _count_thinking(self, st: _State, tid: int) -> None:
        """Track the reasoning block by token id (independent of text parsing) for the budget."""
        if tid == self._special.think_close:
            st.in_think = False
        elif tid == self._special.think_open:
            st.in_think = True
        elif st.in_think:
            st.think_tokens += 1

    def _piece_text(self, pieces: list[Piece]) -> str:
        out = []
        for p in pieces:
            if p.special_id is None or p.special_id in self._markup_ids or not self._skip_special:
                out.append(p.text)
        return "".join(out)

    def _route(self, st: _State, text: str, acc: _Acc) -> bool:
        """Push text through stop strings and the channel/tool parsers; True if a stop string hit."""
        stopped = False
        if st.stop is not None:
            text, stopped = st.stop.feed(text)
        if text:
            self._channel(st, text, acc)
        return stopped

    def _channel(self, st: _State, text: str, acc: _Acc) -> None:
        segments = st.splitter.feed(text) if st.splitter is not None else [("content", text)]
        for channel, seg in segments:
            if channel == "reasoning":
                acc.reasoning.append(seg)
            else:
                self._content(st, seg, acc)

    def _content(self, st: _State, text: str, acc: _Acc) -> None:
        if st.tools is None:
            acc.text.append(text)
            return
        content, deltas = st.tools.feed(text)
        acc.text.append(content)
        acc.calls.extend(deltas)

    def _flush(self, st: _State, acc: _Acc, *, pending_text: bool) -> None:
        """Release every held-back piece (output ends). ``pending_text``: also the detokenizer's tail and
        the stop matcher's held prefix (False after a stop string, which discards what follows it)."""
        if pending_text:
            text = self._piece_text(st.detok.flush())
            stopped = False
            if st.stop is not None:
                text, stopped = st.stop.feed(text) if text else ("", False)
                if not stopped:
                    text += st.stop.flush()
            if text:
                self._channel(st, text, acc)
        if st.splitter is not None:
            for channel, seg in st.splitter.flush():
                if channel == "reasoning":
                    acc.reasoning.append(seg)
                else:
                    self._content(st, seg, acc)
        if st.tools is not None:
            tail = st.tools.flush()
            if tail:
                acc.text.append(tail)
