"""OutputSession: one request's output semantics, previewed purely and committed by the Engine.

Per token the pipeline is: stop token check -> thinking-budget accounting (by token id) -> incremental
detokenization -> stop strings (over the text, markers included, like vLLM) -> thinking/content split
-> tool-call parsing of the content. Committed totals live outside the per-stage state, so a preview
costs O(span), not O(output).

What a preview decides (``accepted``, ``stop``, ``force_tokens``) depends on text only through stop
strings: the channel splitter and the tool-call parser never end output. So without stop strings a
preview runs only the id logic and returns a ``LazyPreview``; the text pipeline runs in ``commit``, on
the committed state in place, which the Engine can overlap with the next model step. With stop strings
``preview`` runs the whole pipeline on copies of the stage states, and ``commit`` adopts them.

Reuse boundary: for the span that ends the turn with ``<|im_end|>``, the preview's ``boundaries`` ask
the history renderer how a later prompt renders this turn sent back as an assistant message; if that is
exactly the generation prompt's turn header plus the output, the end of the turn is a boundary. A lazy
preview decides it only when asked (once per request: a small render, a decode and maybe an encode of
the output).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ninfer.targets.qwen3_6.frontend.constraint import GrammarConstraint
from ninfer.targets.qwen3_6.frontend.detokenizer import IncrementalDetokenizer, Piece
from ninfer.targets.qwen3_6.frontend.prompt import last_index
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

# (assistant message as a client sends it back, tool results follow) -> the text a later prompt renders
# for it, from its <|im_start|> through its <|im_end|> (Frontend.history_turn_text)
HistoryRenderer = Callable[[Mapping[str, Any], bool], str]


def _option(options: Any, name: str) -> Any:
    """Read an option by attribute name, defaulting what an OutputOptions-shaped value lacks."""
    return getattr(options, name, getattr(_DEFAULTS, name))


@dataclass(slots=True)
class _TextState:
    """The text stages' state. An eager preview works on a copy; a lazy commit mutates it in place."""

    detok: IncrementalDetokenizer
    stop: StopStringMatcher | None
    splitter: ChannelSplitter | None
    tools: ToolCallParser | None

    def copy(self) -> _TextState:
        return _TextState(
            detok=self.detok.copy(),
            stop=self.stop.copy() if self.stop else None,
            splitter=self.splitter.copy() if self.splitter else None,
            tools=self.tools.copy() if self.tools else None,
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


class _TurnState(NamedTuple):
    """Lengths of the committed totals (text pieces, reasoning pieces, ids) and the tool calls."""

    texts: int
    reasonings: int
    token_ids: int
    calls: dict[int, tuple[str, str, str]]


class LazyPreview:
    """A preview decided by token ids alone (no stop strings); its text is rendered on demand.

    The Engine reads ``accepted``, ``stop`` and ``force_tokens``. ``delta`` is rendered from a copy of the
    committed text state on first access and cached, and ``commit`` then adopts that rendering; if it was
    never read, ``commit`` renders on the committed state in place and caches the result here. A preview
    that a commit superseded before its delta was read cannot render any more (the state it was taken
    from is gone): reading its delta raises RuntimeError.
    """

    __slots__ = (
        "accepted",
        "stop",
        "force_tokens",
        "token_ids",
        "stop_reason",
        "in_think",
        "think_tokens",
        "control_horizon",
        "_turn",
        "_boundaries",
        "_session",
        "_epoch",
        "_delta",
        "_rendered",
    )

    def __init__(
        self,
        session: OutputSession,
        token_ids: tuple[int, ...],
        stop_reason: int | None,
        force_tokens: tuple[int, ...],
        in_think: bool,
        think_tokens: int,
    ) -> None:
        self.accepted = len(token_ids)
        self.stop = stop_reason is not None
        self.force_tokens = force_tokens
        self.token_ids = token_ids  # the accepted ids (a stopping id last)
        self.stop_reason = stop_reason
        self.in_think = in_think  # thinking counters after the span
        self.think_tokens = think_tokens
        self.control_horizon = session._horizon(in_think, think_tokens)
        self._turn: _TurnState | None = None  # set by the session when the span ends the turn
        self._boundaries: tuple[int, ...] | None = None
        self._session = session
        self._epoch = session._epoch  # the committed state this preview extends
        self._delta: OutputDelta | None = None
        self._rendered: _TextState | None = None  # the text state after the span, if rendered pre-commit

    @property
    def rendered(self) -> bool:
        """Whether the text (``delta``) has been computed yet."""
        return self._delta is not None

    @property
    def delta(self) -> OutputDelta:
        if self._delta is None:
            session = self._session
            if session._epoch != self._epoch:
                raise RuntimeError("this preview was superseded by a commit before its delta was read")
            st = session._st.copy()
            self._delta = session._render(st, self.token_ids, self.stop)
            self._rendered = st
        return self._delta

    @property
    def boundaries(self) -> tuple[int, ...]:
        """The output's reuse boundary (see `OutputPreview`). Only a span that ends the turn can have one;
        asking renders its delta (like ``delta``) and the turn as history, once."""
        if self._turn is None:
            return ()
        if self._boundaries is None:
            self._boundaries = self._session._turn_boundaries(self.delta, self._turn)
        return self._boundaries

    def _key(self) -> tuple[Any, ...]:
        return (id(self._session), self._epoch, self.token_ids, self.stop_reason, self.force_tokens)

    def __eq__(self, other: object) -> bool:
        # the delta is a function of the committed state (session, epoch) and the accepted ids
        return isinstance(other, LazyPreview) and self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # mutable cache, value equality

    def __repr__(self) -> str:
        return (
            f"LazyPreview(accepted={self.accepted}, stop={self.stop}, force_tokens={self.force_tokens}, "
            f"rendered={self.rendered})"
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
        history: HistoryRenderer | None = None,
    ) -> None:
        """``history`` (chat prompts with a generation prompt): how a later prompt renders this turn; None
        marks no output boundary."""
        self._think_open = special.think_open
        self._think_close = special.think_close
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
        self._st = _TextState(
            detok=IncrementalDetokenizer(tokenizer),
            stop=StopStringMatcher(stop_strings, bool(_option(options, "include_stop_str")))
            if stop_strings
            else None,
            splitter=ChannelSplitter(prompt.opens_thinking) if parse_reasoning else None,
            tools=ToolCallParser(schemas, secrets.token_hex(8)) if schemas else None,
        )
        # stop strings are the only text-dependent decision of a preview (see the module doc)
        self._lazy = not stop_strings
        # the turn as a later prompt holds it: the generation prompt from its <|im_start|>, then the output
        self._im_end = special.im_end
        self._tokenizer = tokenizer
        self._history = history
        head = last_index(prompt.token_ids, special.im_start) if history is not None else -1
        self._turn_head = prompt.token_ids[head:] if head >= 0 else ()
        # thinking counters, by token id (only the budget reads them)
        self._in_think = prompt.opens_thinking
        self._think_tokens = 0
        # the latest preview; an eager one keeps (text state, stop reason, in_think, think_tokens) beside
        self._pending: OutputPreview | LazyPreview | None = None
        self._pending_eager: tuple[_TextState, int | str | None, bool, int] | None = None
        self._epoch = 0  # counts changes of the committed text state (a LazyPreview renders from one)
        self._done = False
        # committed totals
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._token_ids: list[int] = []
        self._calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended output
        # structured outputs: the request's grammar matcher (set by the Frontend; the Engine drives it)
        self.constraint: GrammarConstraint | None = None

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
        return () if self._done else self._budget_force(self._in_think, self._think_tokens)

    # ---- preview / commit ---------------------------------------------------------------------
    def preview(self, token_ids: Sequence[int]) -> OutputPreview | LazyPreview:
        """The effect of appending ``token_ids`` to what is committed; the session does not change."""
        if self._done:
            raise RuntimeError("output session already finished")
        if not self._lazy:
            return self._preview_eager(token_ids)
        ids = tuple(map(int, token_ids))
        stop_ids = self._stop_ids
        stop_reason: int | None = None
        for k, tid in enumerate(ids):
            if tid in stop_ids:
                stop_reason = tid
                ids = ids[: k + 1]
                break
        in_think, think_tokens = self._in_think, self._think_tokens
        force: tuple[int, ...] = ()
        if self._thinking_budget is not None:  # else the counters are never read: skip them
            span = ids[:-1] if stop_reason is not None else ids
            in_think, think_tokens = self._count_thinking(in_think, think_tokens, span)
            if stop_reason is None:
                force = self._budget_force(in_think, think_tokens)
        preview = LazyPreview(self, ids, stop_reason, force, in_think, think_tokens)
        if stop_reason == self._im_end and self._turn_head:
            preview._turn = self._turn_state()  # decided on demand (LazyPreview.boundaries)
        self._pending = preview
        return preview

    def _preview_eager(self, token_ids: Sequence[int]) -> OutputPreview:
        st = self._st.copy()
        acc = _Acc()
        in_think, think_tokens = self._in_think, self._think_tokens
        accepted = 0
        stop_reason: int | str | None = None
        for raw in token_ids:
            tid = int(raw)
            accepted += 1
            if tid in self._stop_ids:
                stop_reason = tid
                self._flush(st, acc, pending_text=True)
                break
            if self._thinking_budget is not None:
                in_think, think_tokens = self._count_thinking(in_think, think_tokens, (tid,))
            text = self._piece_text(st.detok.step(tid))
            if text and self._route(st, text, acc):
                stop_reason = st.stop.last_hit if st.stop is not None else None
                self._flush(st, acc, pending_text=False)
                break
        stop = stop_reason is not None
        force = () if stop else self._budget_force(in_think, think_tokens)
        ids = tuple(int(t) for t in token_ids[:accepted])
        delta = acc.delta(ids)
        ends_turn = stop_reason == self._im_end and self._turn_head
        boundaries = self._turn_boundaries(delta, self._turn_state()) if ends_turn else ()
        preview = OutputPreview(
            accepted=accepted, stop=stop, delta=delta, force_tokens=force, boundaries=boundaries,
            control_horizon=self._horizon(in_think, think_tokens),
        )  # fmt: skip
        self._pending = preview
        self._pending_eager = (st, stop_reason, in_think, think_tokens)
        return preview

    def commit(self, preview: OutputPreview | LazyPreview) -> OutputDelta:
        """Apply ``preview``, which must be the latest one of this session."""
        if self._pending is None or self._pending is not preview:
            raise ValueError("commit() takes the latest preview of this session, not yet committed")
        self._pending = None
        if isinstance(preview, LazyPreview):
            delta = self._commit_lazy(preview)
            stop_reason: int | str | None = preview.stop_reason
        else:
            assert self._pending_eager is not None
            self._st, stop_reason, self._in_think, self._think_tokens = self._pending_eager
            self._epoch += 1
            delta = preview.delta
        self._pending_eager = None
        self._apply(delta)
        if preview.stop:
            self._done = True
            self.finish_reason = "stop"
            self.stop_reason = stop_reason
        return delta

    def _commit_lazy(self, preview: LazyPreview) -> OutputDelta:
        self._epoch += 1  # any other outstanding preview can no longer render
        self._in_think, self._think_tokens = preview.in_think, preview.think_tokens
        if preview._delta is not None:  # rendered on a copy when its delta was read: adopt that
            assert preview._rendered is not None
            self._st, preview._rendered = preview._rendered, None
            return preview._delta
        try:
            delta = self._render(self._st, preview.token_ids, preview.stop)
        except BaseException:
            # the text state is partly advanced: the session cannot continue (the Engine ends the request)
            self._done = True
            raise
        preview._delta = delta
        return delta

    def finish(self) -> OutputDelta:
        """End of generation for a non-stop reason: flush everything held back. Idempotent."""
        self._pending = None
        self._pending_eager = None
        if self._done:
            return OutputDelta()
        self._epoch += 1
        acc = _Acc()
        self._flush(self._st, acc, pending_text=True)
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
        _merge_calls(self._calls, delta.tool_calls)

    def _turn_state(self) -> _TurnState:
        """The committed totals as of now, kept by a preview that ends the turn: its boundary may be
        asked for after its own commit appended to them."""
        calls = {i: tuple(c) for i, c in self._calls.items()}
        return _TurnState(len(self._text), len(self._reasoning), len(self._token_ids), calls)

    def _turn_boundaries(self, delta: OutputDelta, turn: _TurnState) -> tuple[int, ...]:
        """``(len(span),)`` if the history renderer reproduces the turn ending with ``delta``'s span
        token for token, else (). The message is what the serve layer returns and a client sends back."""
        assert self._history is not None
        calls = {i: list(c) for i, c in turn.calls.items()}
        _merge_calls(calls, delta.tool_calls)
        tool_calls = [ToolCall(i, *c).to_openai() for i, c in sorted(calls.items())]
        text = "".join(self._text[: turn.texts]) + delta.text
        reasoning = "".join(self._reasoning[: turn.reasonings]) + delta.reasoning_text
        message = {
            "role": "assistant",
            "content": text if text or not tool_calls else None,
            "reasoning_content": reasoning or None,
            "tool_calls": tool_calls,
        }
        rendered = self._history(message, bool(tool_calls))
        produced = (*self._turn_head, *self._token_ids[: turn.token_ids], *delta.token_ids)
        # the text first (a decode is several times cheaper than an encode): it tells most misses, e.g.
        # reasoning the template drops; then the tokens, since the model may have split text unusually
        if not rendered or self._tokenizer.decode(produced) != rendered:
            return ()
        return (len(delta.token_ids),) if tuple(self._tokenizer.encode(rendered)) == produced else ()

    def _horizon(self, in_think: bool, think_tokens: int) -> int | None:
        """The fewest tokens after which the thinking budget may ask for forced control (None: it never
        will): a decode unit that produces no more than this many never overruns the budget."""
        budget = self._thinking_budget
        if budget is None:
            return None
        left = max(0, budget - think_tokens)
        return max(1, left) if in_think else 1 + left  # out of a block: its opening token first

    def _budget_force(self, in_think: bool, think_tokens: int) -> tuple[int, ...]:
        budget = self._thinking_budget
        return self._force_ids if budget is not None and in_think and think_tokens >= budget else ()

    def _count_thinking(self, in_think: bool, think_tokens: int, ids: Sequence[int]) -> tuple[bool, int]:
        """Track the reasoning block by token id (independent of text parsing) for the budget."""
        close, open_ = self._think_close, self._think_open
        for tid in ids:
            if tid == close:
                in_think = False
            elif tid == open_:
                in_think = True
            elif in_think:
                think_tokens += 1
        return in_think, think_tokens

    def _render(self, st: _TextState, ids: tuple[int, ...], stop: bool) -> OutputDelta:
        """The text pipeline over the ids of a lazy preview, advancing ``st``: what the eager preview
        computes for the same span when there are no stop strings (a stopping id, last, flushes)."""
        acc = _Acc()
        for tid in ids[:-1] if stop else ids:
            text = self._piece_text(st.detok.step(tid))
            if text:
                self._channel(st, text, acc)
        if stop:
            self._flush(st, acc, pending_text=True)
        return acc.delta(ids)

    def _piece_text(self, pieces: list[Piece]) -> str:
        out = []
        for p in pieces:
            if p.special_id is None or p.special_id in self._markup_ids or not self._skip_special:
                out.append(p.text)
        return "".join(out)

    def _route(self, st: _TextState, text: str, acc: _Acc) -> bool:
        """Push text through stop strings and the channel/tool parsers; True if a stop string hit."""
        stopped = False
        if st.stop is not None:
            text, stopped = st.stop.feed(text)
        if text:
            self._channel(st, text, acc)
        return stopped

    def _channel(self, st: _TextState, text: str, acc: _Acc) -> None:
        segments = st.splitter.feed(text) if st.splitter is not None else [("content", text)]
        for channel, seg in segments:
            if channel == "reasoning":
                acc.reasoning.append(seg)
            else:
                self._content(st, seg, acc)

    def _content(self, st: _TextState, text: str, acc: _Acc) -> None:
        if st.tools is None:
            acc.text.append(text)
            return
        content, deltas = st.tools.feed(text)
        acc.text.append(content)
        acc.calls.extend(deltas)

    def _flush(self, st: _TextState, acc: _Acc, *, pending_text: bool) -> None:
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


def _merge_calls(calls: dict[int, list[str]], deltas: Iterable[ToolCallDelta]) -> None:
    """Fold tool-call deltas into ``calls`` (index -> [id, name, arguments])."""
    for d in deltas:
        call = calls.setdefault(d.index, ["", "", ""])
        if d.id is not None:
            call[0] = d.id
        if d.name is not None:
            call[1] = d.name
        call[2] += d.arguments
