"""The lazy OutputSession path and the cheap per-token stages, checked for exactness.

Without stop strings ``preview`` decides by token ids alone and ``commit`` runs the text pipeline; with
them the pipeline runs eagerly in ``preview``. Both must give, span by span, the deltas and totals of a
straightforward eager reference kept here (one token at a time, the two-decode detokenizer, no state
copies), over random streams of the real Qwen3.6 tokenizer. The detokenizer's cached prefix text is
checked against fresh decodes on long random streams (multi-byte characters, invalid UTF-8, specials).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from ninfer.targets.qwen3_6.frontend import (
    Frontend,
    FrontendResources,
    OutputDelta,
    OutputOptions,
    OutputPreview,
    PreparedPrompt,
    SpecialTokens,
)
from ninfer.targets.qwen3_6.frontend.detokenizer import IncrementalDetokenizer, Piece
from ninfer.targets.qwen3_6.frontend.output import FORCED_THINK_CLOSE_TEXT, TEXT_MARKUP_TOKENS, LazyPreview
from ninfer.targets.qwen3_6.frontend.reasoning import ChannelSplitter
from ninfer.targets.qwen3_6.frontend.stop import StopStringMatcher, partial_suffix_len
from ninfer.targets.qwen3_6.frontend.tokenizer import TextTokenizer
from ninfer.targets.qwen3_6.frontend.tool_calls import ToolCallParser, tool_schemas
from ninfer.targets.qwen3_6.frontend.types import ToolCallDelta
from ninfer.targets.qwen3_6.resources import RESOURCE_DIR

IM_END = 248046
ENDOFTEXT = 248044
SPECIAL = SpecialTokens()
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]
USER_TURN = [{"role": "user", "content": "Weather in Rome?"}]
# text fragments a stream is built from: multi-byte characters, a literal U+FFFD, markup (whole and
# broken), separators, stop-string material
TEXT_FRAGMENTS = (
    "Hello world. ",
    "分析一下这个问题",
    "😀🫨 ",
    "𓀀𠀀ꙮ",
    "\ufffd?",
    "\n\n",
    "\n",
    "END",
    " <x> </thi ",
    "<tool_",
    "a<b>c",
    "Ünïcödé ",
    "<think>",
    "</think>",
    "\n</think>\n\n",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=fly>\n<parameter=to>\nMars\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis",
    "</tool_call>",
    "<|im_start|>",
    "<|vision_pad|>",
)
STOP_STRING_SETS = (("END",), ("\n\n", "分析"), ("<tool",), ("Rome", "o w"))


@pytest.fixture(scope="module")
def fe() -> Frontend:
    res = FrontendResources(
        tokenizer_json=(RESOURCE_DIR / "tokenizer.json").read_bytes(),
        chat_template=(RESOURCE_DIR / "qwen3_6.jinja").read_text(encoding="utf-8"),
        generation_config={"eos_token_id": [IM_END, ENDOFTEXT]},
    )
    return Frontend.from_resources(res, SPECIAL)


@pytest.fixture(scope="module")
def prompts(fe: Frontend) -> dict[str, PreparedPrompt]:
    return {
        "thinking": fe.prepare_chat(USER_TURN),
        "plain": fe.prepare_chat(USER_TURN, enable_thinking=False),
        "tools": fe.prepare_chat(USER_TURN, tools=TOOLS),
        "tools_plain": fe.prepare_chat(USER_TURN, tools=TOOLS, enable_thinking=False),
        "raw": fe.prepare_tokens(fe.encode("Once upon a time")),
    }


@pytest.fixture(scope="module")
def byte_tokens(fe: Frontend) -> list[int]:
    """Single tokens that are fragments of multi-byte characters (lead and continuation bytes)."""
    out = []
    for ch in "𓀀𠀀🫨😀分":
        out.extend(t for t in fe.encode(ch) if "\ufffd" in fe.decode([t]))
    assert len(out) >= 8
    return out


# ---- reference -----------------------------------------------------------------------------------
class RefDetok:
    """The prefix-offset detokenizer as first written: two fresh decodes per token."""

    def __init__(self, tok: TextTokenizer) -> None:
        self.tok = tok
        self.window: tuple[int, ...] = ()
        self.read = 0

    def step(self, tid: int) -> list[Piece]:
        special = self.tok.added_token_text(tid)
        if special is not None:
            return self.flush() + [Piece(special, tid)]
        if not 0 <= tid < self.tok.vocab_size:
            return []
        window = self.window + (tid,)
        prefix = self.tok.decode(window[: self.read])
        new = self.tok.decode(window)
        if len(new) > len(prefix) and (not new.endswith("\ufffd") or len(window) - self.read >= 4):
            self.window, self.read = window[self.read :], len(window) - self.read
            return [Piece(new[len(prefix) :])]
        self.window = window
        return []

    def flush(self) -> list[Piece]:
        prefix = self.tok.decode(self.window[: self.read])
        new = self.tok.decode(self.window)
        self.window, self.read = (), 0
        return [Piece(new[len(prefix) :])] if len(new) > len(prefix) else []


def ref_partial_suffix_len(text: str, needles: tuple[str, ...]) -> int:
    best = 0
    for needle in needles:
        for n in range(1, min(len(needle) - 1, len(text)) + 1):
            if text.endswith(needle[:n]):
                best = max(best, n)
    return best


class RefSession:
    """Eager output semantics, one token at a time, every stage mutated in place (no previews)."""

    def __init__(self, fe: Frontend, prompt: PreparedPrompt, opts: OutputOptions, id_salt: str) -> None:
        tok = fe.tokenizer
        self.stop_ids = set(opts.stop_token_ids) | (set() if opts.ignore_eos else {IM_END, ENDOFTEXT})
        self.skip = opts.skip_special_tokens
        self.markup = {tok.token_id(t) for t in TEXT_MARKUP_TOKENS}
        self.budget = opts.thinking_budget
        self.force_ids = tuple(fe.encode(FORCED_THINK_CLOSE_TEXT))
        reasoning = opts.parse_reasoning
        if reasoning is None:
            reasoning = prompt.chat or prompt.opens_thinking
        tools = opts.parse_tool_calls if opts.parse_tool_calls is not None else bool(prompt.tools)
        schemas = tool_schemas(prompt.tools) if tools else {}
        self.detok = RefDetok(tok)
        self.stop = StopStringMatcher(opts.stop_strings, opts.include_stop_str) if opts.stop_strings else None
        self.splitter = ChannelSplitter(prompt.opens_thinking) if reasoning else None
        self.tools = ToolCallParser(schemas, id_salt) if schemas else None
        self.in_think, self.think_tokens = prompt.opens_thinking, 0
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCallDelta] = []

    def force(self) -> tuple[int, ...]:
        over = self.budget is not None and self.in_think and self.think_tokens >= self.budget
        return self.force_ids if over else ()

    def _channel(self, text: str) -> None:
        segments = self.splitter.feed(text) if self.splitter is not None else [("content", text)]
        for channel, seg in segments:
            self._segment(channel, seg)

    def _segment(self, channel: str, seg: str) -> None:
        if channel == "reasoning":
            self.reasoning.append(seg)
        elif self.tools is None:
            self.text.append(seg)
        else:
            content, deltas = self.tools.feed(seg)
            self.text.append(content)
            self.calls.extend(deltas)

    def _flush(self, pending_text: bool) -> None:
        if pending_text:
            text = "".join(self._keep(self.detok.flush()))
            if self.stop is not None:
                text, hit = self.stop.feed(text) if text else ("", False)
                if not hit:
                    text += self.stop.flush()
            if text:
                self._channel(text)
        if self.splitter is not None:
            for channel, seg in self.splitter.flush():
                self._segment(channel, seg)
        if self.tools is not None:
            self.text.append(self.tools.flush())

    def _keep(self, pieces: list[Piece]) -> list[str]:
        return [
            p.text for p in pieces if p.special_id is None or p.special_id in self.markup or not self.skip
        ]

    def _take(self, ids: tuple[int, ...]) -> OutputDelta:
        delta = OutputDelta("".join(self.text), "".join(self.reasoning), tuple(self.calls), ids)
        self.text, self.reasoning, self.calls = [], [], []
        return delta

    def step(self, span: Sequence[int]) -> tuple[int, bool, OutputDelta, tuple[int, ...], int | str | None]:
        """(accepted, stop, delta, force_tokens, stop_reason) of ``span``, applied."""
        accepted, reason = 0, None
        for tid in span:
            accepted += 1
            if tid in self.stop_ids:
                reason = tid
                self._flush(True)
                break
            if tid == SPECIAL.think_close:
                self.in_think = False
            elif tid == SPECIAL.think_open:
                self.in_think = True
            elif self.in_think:
                self.think_tokens += 1
            text = "".join(self._keep(self.detok.step(tid)))
            hit = False
            if text and self.stop is not None:
                text, hit = self.stop.feed(text)
            if text:
                self._channel(text)
            if hit:
                assert self.stop is not None
                reason = self.stop.last_hit
                self._flush(False)
                break
        stop = reason is not None
        delta = self._take(tuple(span[:accepted]))
        return accepted, stop, delta, () if stop else self.force(), reason

    def finish(self) -> OutputDelta:
        self._flush(True)
        return self._take(())


def fold(deltas: Sequence[OutputDelta]) -> tuple[str, str, dict[int, list[str]], tuple[int, ...]]:
    """Totals of a delta stream (tool calls folded by index like a client does)."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.tool_calls:
            call = calls.setdefault(c.index, ["", "", ""])
            call[0] = c.id if c.id is not None else call[0]
            call[1] = c.name if c.name is not None else call[1]
            call[2] += c.arguments
    ids = tuple(t for d in deltas for t in d.token_ids)
    return "".join(d.text for d in deltas), "".join(d.reasoning_text for d in deltas), calls, ids


# ---- random streams ------------------------------------------------------------------------------
def random_stream(fe: Frontend, rnd: random.Random, byte_tokens: list[int], n_fragments: int) -> list[int]:
    ids: list[int] = []
    regular = min(fe.tokenizer.special_ids)  # the added tokens follow the regular vocabulary
    for _ in range(n_fragments):
        r = rnd.random()
        if r < 0.55:
            ids.extend(fe.encode(rnd.choice(TEXT_FRAGMENTS)))
        elif r < 0.7:
            ids.extend(rnd.randrange(regular) for _ in range(rnd.randint(1, 3)))
        elif r < 0.8:
            ids.extend(rnd.choice(byte_tokens) for _ in range(rnd.randint(1, 5)))
        elif r < 0.88:
            ids.append(rnd.choice((SPECIAL.think_open, SPECIAL.think_close, 248058, 248059)))
        elif r < 0.94:
            ids.append(rnd.choice((IM_END, ENDOFTEXT)))
        elif r < 0.97:
            ids.append(fe.tokenizer.vocab_size + rnd.randrange(64))  # vocab padding row: no text
        else:
            ids.extend(fe.encode("\n\n"))
    return ids


def random_options(rnd: random.Random, eager: bool, stop_id: int) -> OutputOptions:
    stops = rnd.choice(STOP_STRING_SETS) if eager else ()
    return OutputOptions(
        stop_strings=stops,
        stop_token_ids=(stop_id,) if rnd.random() < 0.2 else (),
        ignore_eos=rnd.random() < 0.6,  # often: streams contain eos ids and would end early
        include_stop_str=rnd.random() < 0.5,
        skip_special_tokens=rnd.random() < 0.7,
        parse_reasoning=rnd.choice((None, None, True, False)),
        parse_tool_calls=rnd.choice((None, None, True, False)),
        thinking_budget=rnd.choice((None, None, 0, 3, 12)),
    )


def drive_pair(
    fe: Frontend,
    rnd: random.Random,
    prompt: PreparedPrompt,
    opts: OutputOptions,
    ids: list[int],
    byte_tokens: list[int],
) -> None:
    """Drive the session and the reference over ``ids`` like the Engine would, and compare every span."""
    session = fe.new_output_session(prompt, opts)
    salt = session._st.tools._id_salt if session._st.tools is not None else ""
    ref = RefSession(fe, prompt, opts, salt)
    lazy = not opts.stop_strings
    deltas: list[OutputDelta] = []
    pos = 0
    force = session.force_tokens
    assert force == ref.force()
    while not session.finished:
        from_stream, cut = not force, False
        if force:
            span = list(force)
            if rnd.random() < 0.1:  # max_tokens runs out inside the forced suffix: the request ends
                span, cut = span[: rnd.randint(1, len(span))], True
        else:
            if pos >= len(ids):
                break
            n = 1 if rnd.random() < 0.5 else rnd.randint(1, 16)  # speculative rounds: up to 16
            span = ids[pos : pos + n]
        while rnd.random() < 0.3:  # a preview that is dropped (its delta read or not)
            other = random_stream(fe, rnd, byte_tokens, 2)[:16] or [1]
            dropped = session.preview(other)
            if rnd.random() < 0.5:
                dropped.delta  # noqa: B018 - rendering a dropped preview must not change the session
        preview = session.preview(span)
        assert isinstance(preview, LazyPreview if lazy else OutputPreview)
        if lazy:
            assert not preview.rendered  # the text was not computed by preview
        early = preview.delta if rnd.random() < 0.3 else None
        accepted, stop, ref_delta, ref_force, ref_reason = ref.step(span)
        assert (preview.accepted, preview.stop, preview.force_tokens) == (accepted, stop, ref_force)
        delta = session.commit(preview)
        assert delta == ref_delta
        assert preview.delta == ref_delta
        if early is not None:
            assert early is delta
        deltas.append(delta)
        if stop:
            assert session.finish_reason == "stop" and session.stop_reason == ref_reason
        if from_stream:
            pos += accepted
        force = preview.force_tokens
        assert session.force_tokens == force
        if cut:
            break
    tail = session.finish()
    deltas.append(tail)
    assert tail == (OutputDelta() if session.finish_reason == "stop" else ref.finish())
    assert session.finish() == OutputDelta()
    text, reasoning, calls, token_ids = fold(deltas)
    assert (session.text, session.reasoning_text, session.token_ids) == (text, reasoning, token_ids)
    assert {c.index: [c.id, c.name, c.arguments] for c in session.tool_calls} == calls
    assert session.finished and session.force_tokens == ()


@pytest.mark.parametrize("eager", [False, True], ids=["lazy", "eager_stop_strings"])
def test_random_streams_match_reference(
    fe: Frontend, prompts: dict[str, PreparedPrompt], byte_tokens: list[int], eager: bool
) -> None:
    rnd = random.Random(1234 + eager)
    dot = fe.encode(".")[0]
    names = sorted(prompts)
    for _ in range(150):
        prompt = prompts[rnd.choice(names)]
        opts = random_options(rnd, eager, dot)
        ids = random_stream(fe, rnd, byte_tokens, rnd.randint(5, 60))
        drive_pair(fe, rnd, prompt, opts, ids, byte_tokens)


def test_tool_calls_and_thinking_budget_streams(
    fe: Frontend, prompts: dict[str, PreparedPrompt], byte_tokens: list[int]
) -> None:
    """Deterministic streams that surely hit a reported tool call, the budget forcing and a stop id."""
    rnd = random.Random(7)
    call = TEXT_FRAGMENTS[15]
    ids = fe.encode("Let me think about it.\n</think>\n\nChecking. " + call + "\n<|im_end|>")
    for opts in (OutputOptions(), OutputOptions(thinking_budget=2), OutputOptions(stop_strings=("zz",))):
        for _ in range(8):
            drive_pair(fe, rnd, prompts["tools"], opts, ids, byte_tokens)
    session = fe.new_output_session(prompts["tools"], OutputOptions())
    deltas = [session.commit(session.preview([t])) for t in ids]
    assert session.finish_reason == "stop" and session.stop_reason == IM_END
    assert [c.name for c in session.tool_calls] == ["get_weather"]
    assert session.tool_calls[0].arguments == '{"city": "Rome", "days": 3}'
    assert fold(deltas)[0] == session.text == "Checking."


def test_preview_is_lazy_without_stop_strings(
    fe: Frontend, prompts: dict[str, PreparedPrompt], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without stop strings preview does not detokenize; with them it must (a regression guard)."""
    steps = 0
    real_step = IncrementalDetokenizer.step

    def counting_step(self: IncrementalDetokenizer, token_id: int) -> list[Piece]:
        nonlocal steps
        steps += 1
        return real_step(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "step", counting_step)
    ids = fe.encode("Reasoning here.\n</think>\n\nAnswer.") + [IM_END]
    session = fe.new_output_session(prompts["thinking"], OutputOptions(thinking_budget=100))
    previews = [session.preview(ids[:2]), session.preview(ids[:3])]
    assert steps == 0 and all(isinstance(p, LazyPreview) and not p.rendered for p in previews)
    session.commit(previews[1])
    assert steps == 3 and previews[1].rendered
    preview = session.preview(ids[3:])
    assert steps == 3 and preview.stop and preview.accepted == len(ids) - 3
    session.commit(preview)
    assert (session.reasoning_text, session.text) == ("Reasoning here.", "Answer.")

    eager = fe.new_output_session(prompts["thinking"], OutputOptions(stop_strings=("zz",)))
    steps = 0
    assert isinstance(eager.preview(ids[:2]), OutputPreview) and steps == 2


def test_lazy_preview_delta(fe: Frontend, prompts: dict[str, PreparedPrompt]) -> None:
    """A lazy preview's delta: rendered on demand without changing the session, adopted by commit, and
    unavailable once a commit superseded it unread."""
    ids = fe.encode("Hi 😀 there")
    session = fe.new_output_session(prompts["plain"], OutputOptions())
    a, b = session.preview(ids[:2]), session.preview(ids[:2])
    assert a == b and a is not b and a.delta == b.delta and a.delta.token_ids == tuple(ids[:2])
    assert session.text == "" and session.token_ids == ()
    c = session.preview(ids[:3])
    assert c != a
    committed = session.commit(c)
    assert committed == c.delta and session.token_ids == tuple(ids[:3])
    assert a.delta.token_ids == tuple(ids[:2])  # rendered before the commit: still readable
    unread = session.preview(ids[3:4])
    session.commit(session.preview(ids[3:]))
    with pytest.raises(RuntimeError, match="superseded"):
        unread.delta  # noqa: B018
    with pytest.raises(ValueError, match="latest preview"):
        session.commit(unread)
    assert session.text + session.finish().text == "Hi 😀 there"


def test_detokenizer_prefix_cache_is_exact(fe: Frontend, byte_tokens: list[int]) -> None:
    """The cached prefix text equals a fresh decode after every step, and the pieces equal those of the
    two-decode reference, on long random streams (regular tokens, CJK and emoji split into byte tokens,
    invalid UTF-8, a literal U+FFFD, special tokens, vocab padding rows)."""
    tok = fe.tokenizer
    rnd = random.Random(99)
    cached = fresh = 0
    for _ in range(12):
        ids = random_stream(fe, rnd, byte_tokens, 600)
        det, ref = IncrementalDetokenizer(tok), RefDetok(tok)
        for k, tid in enumerate(ids):
            if rnd.random() < 0.05:
                det = det.copy()  # a copy carries the cache along
            assert det.step(tid) == ref.step(tid), k
            window, read, prefix = det._window, det._read, det._prefix
            assert (window, read) == (ref.window, ref.read)
            if prefix is None:
                fresh += 1
            else:
                cached += 1
                assert prefix == tok.decode(window[:read]), k
            if rnd.random() < 0.01:
                assert det.flush() == ref.flush()
        assert det.flush() == ref.flush()
    assert cached > 20 * fresh > 0  # both paths are exercised, the cache nearly always


def test_component_copies_keep_every_field(fe: Frontend) -> None:
    """The hand-written copy() of each stage carries every slot (a new field must be added there)."""
    parts = (
        IncrementalDetokenizer(fe.tokenizer),
        StopStringMatcher(("x",), False),
        ChannelSplitter(True),
        ToolCallParser({}, "salt"),
    )
    for part in parts:
        slots = type(part).__slots__
        marks = {name: object() for name in slots}
        for name, mark in marks.items():
            setattr(part, name, mark)
        twin = part.copy()
        assert type(twin) is type(part) and twin is not part
        assert all(getattr(twin, name) is marks[name] for name in slots), type(part).__name__


def test_partial_suffix_len_matches_reference() -> None:
    rnd = random.Random(5)
    alphabet = "ab<>/\n分"
    for _ in range(20000):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 12)))
        needles = tuple(
            "".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 6))) for _ in range(rnd.randint(1, 3))
        )
        assert partial_suffix_len(text, needles) == ref_partial_suffix_len(text, needles), (text, needles)
