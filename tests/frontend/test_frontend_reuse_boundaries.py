"""Reuse boundaries against the real tokenizer and both Qwen templates, over multi-turn conversations.

Each conversation is replayed the way a chat client drives it: turn k's prompt is prepared, the model
"answers" with exactly the ids the template renders for that assistant message (reasoning, content,
tool-call XML), the OutputSession parses them, and the client appends the parsed turn as the OpenAI
message it sends back, then tool results or the next user query. For every consecutive pair of turns,
the expectations are derived here from the template rules alone (which assistant messages keep their
reasoning in which render) and checked against both renders: every prompt boundary is reproduced in
turn k+1's ids (with an equal prefix digest) or lies past reasoning the template drops, the output
boundary is marked exactly when turn k+1 reproduces prompt + output, and the reuse a cache could get
(the longest common prefix cut to the last boundary) is the one the rules predict, and tight.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from vision_oracle import SMALL_CONFIG, png

from ninfer.media.decode import decode_image
from ninfer.runtime.contract.frontend import OutputOptions, OutputPreviewLike, PreparedPromptLike
from ninfer.runtime.contract.identity import PrefixHasher, prefix_digest
from ninfer.targets.qwen3_6.frontend import (
    ChatTemplate,
    Frontend,
    OutputSession,
    PreparedPrompt,
    SpecialTokens,
    TextTokenizer,
)
from ninfer.targets.qwen3_6.resources import CHAT_TEMPLATES, chat_template, tokenizer_json

S = SpecialTokens()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Web search.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
TOOLS = [WEATHER, SEARCH]


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(tokenizer_json())


@pytest.fixture(scope="module")
def frontends(tokenizer: TextTokenizer) -> dict[str, Frontend]:
    return {
        name: Frontend(tokenizer, ChatTemplate(chat_template(name)), S, {}, SMALL_CONFIG)
        for name in CHAT_TEMPLATES
    }


@pytest.fixture(scope="module")
def images() -> list[Any]:
    return [decode_image(png(64 + 16 * i, 48, seed=i)) for i in range(3)]


# ---- conversation scripts -----------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What the model says in one turn (reasoning only when thinking is on)."""

    reasoning: str
    content: str
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()


@dataclass(frozen=True)
class Turn:
    reply: Reply
    follow: tuple[dict[str, Any] | str, ...]  # messages the client appends after the reply ("image:i")


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def tool(text: str) -> dict[str, Any]:
    return {"role": "tool", "content": text}


CHAT_SCRIPT = [
    Turn(Reply("The user greets me.", "Hello! How can I help?"), (user("Name three rivers."),)),
    Turn(Reply("Rivers: Nile, Amazon, Danube.", "Nile, Amazon and Danube."), (user("Which is longest?"),)),
    Turn(Reply("Nile is usually cited.", "The Nile, at about 6650 km."), (user("And the shortest?"),)),
    Turn(Reply("Of the three, the Danube.", "The Danube (2850 km)."), (user("Thanks. A haiku?"),)),
    Turn(
        Reply("Five, seven, five.", "Long rivers run on\nthrough the dust of old empires\nto a patient sea"),
        (),
    ),
    Turn(Reply("Closing.", "Glad to help!"), ()),
]
CHAT_FOLLOWS = [user("One more question: what is a delta?"), user("Bye.")]

# images in the first user message and in a later one
IMAGE_SCRIPT = [*CHAT_SCRIPT[:2], Turn(CHAT_SCRIPT[2].reply, ("image:1",)), *CHAT_SCRIPT[3:]]

TOOL_SCRIPT = [
    Turn(
        Reply(
            "I need the weather for Paris.", "Let me check.", (("get_weather", {"city": "Paris", "days": 1}),)
        ),
        (tool('{"temp_c": 18, "sky": "cloudy"}'),),
    ),
    Turn(
        Reply(
            "Compare with Rome and Berlin.",
            "",
            (("get_weather", {"city": "Rome", "days": 1}), ("get_weather", {"city": "Berlin", "days": 2})),
        ),
        (tool('{"temp_c": 24}'), tool('{"temp_c": 12}')),
    ),
    Turn(Reply("Rome is warmest.", "Paris 18 °C, Rome 24 °C, Berlin 12 °C."), (user("Any news on Rome?"),)),
    Turn(
        Reply("Search the news.", "Searching.", (("search", {"query": "Rome news today"}),)),
        (tool("Rome: new metro line opens."),),
    ),
    Turn(Reply("Summarise it.", "A new metro line opened in Rome."), (user("Thanks! Weather tomorrow?"),)),
    Turn(Reply("Answer from memory.", "I would need another lookup for tomorrow."), ()),
]
TOOL_FOLLOWS = [user("Then look it up."), user("Bye.")]


@dataclass(frozen=True)
class Scenario:
    name: str
    system: str | None
    tools: list[dict[str, Any]] | None
    script: list[Turn]
    follows: list[dict[str, Any]]  # appended after the replies whose Turn.follow is empty
    first: tuple[dict[str, Any] | str, ...] = field(default=())

    def opening(self) -> list[dict[str, Any] | str]:
        head: list[dict[str, Any] | str] = [{"role": "system", "content": self.system}] if self.system else []
        return head + list(self.first)


SCENARIOS = [
    Scenario("chat", "You are concise.", None, CHAT_SCRIPT, CHAT_FOLLOWS, (user("Hi there."),)),
    Scenario("chat-no-system", None, None, CHAT_SCRIPT, CHAT_FOLLOWS, (user("Hi there."),)),
    Scenario("tools+system", "Use tools when useful.", TOOLS, TOOL_SCRIPT, TOOL_FOLLOWS, (user("Paris?"),)),
    Scenario("tools", None, TOOLS, TOOL_SCRIPT, TOOL_FOLLOWS, (user("Weather in Paris?"),)),
    Scenario("images", "Describe pictures.", None, IMAGE_SCRIPT, CHAT_FOLLOWS, ("image:0",)),
]
KWARGS = {
    "thinking": {},
    "thinking+preserve": {"preserve_thinking": True},
    "thinking-preserve": {"preserve_thinking": False},
    "no-thinking": {"enable_thinking": False},
    "no-thinking+preserve": {"enable_thinking": False, "preserve_thinking": True},
    "no-thinking-preserve": {"enable_thinking": False, "preserve_thinking": False},
}


def materialize(messages: Sequence[dict[str, Any] | str], images: list[Any]) -> list[dict[str, Any]]:
    """``"image:i"`` becomes a user message with image i and a question."""
    out = []
    for m in messages:
        if isinstance(m, str):
            i = int(m.split(":")[1])
            parts = [
                {"type": "image", "image": images[i]},
                {"type": "text", "text": f"What is in picture {i}?"},
            ]
            out.append({"role": "user", "content": parts})
        else:
            out.append(dict(m))
    return out


# ---- the template rules, as the test knows them ------------------------------------------------


def keeps_all_reasoning(template: str, kwargs: Mapping[str, Any]) -> bool:
    """3.6 keeps past reasoning only with preserve_thinking=true; 3.8 unless preserve_thinking=false."""
    preserve = kwargs.get("preserve_thinking")
    return preserve is True if template == "qwen3_6" else preserve is not False


def last_query_index(messages: Sequence[Mapping[str, Any]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m["role"] != "user":
            continue
        content = m["content"] if isinstance(m["content"], str) else "x"
        text = content.strip()
        if not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
            return i
    raise AssertionError("no user query")


def keeps(template: str, kwargs: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], i: int) -> bool:
    """Whether the render of ``messages`` gives assistant message ``i`` its think block."""
    return keeps_all_reasoning(template, kwargs) or i > last_query_index(messages)


def has_preamble(template: str, kwargs: Mapping[str, Any], scenario: Scenario) -> bool:
    # the 3.8 template adds a reasoning-effort system turn whenever thinking is on
    thinking = kwargs.get("enable_thinking", True)
    return bool(scenario.tools or scenario.system or (template == "qwen3_8" and thinking))


# ---- the simulated model ------------------------------------------------------------------------


def reply_message(reply: Reply, thinking: bool) -> dict[str, Any]:
    calls = [
        {"type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in reply.calls
    ]
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "tool_calls": calls}
    if thinking:
        message["reasoning_content"] = reply.reasoning
    return message


def model_output(
    fe: Frontend, prompt: PreparedPrompt, reply: Reply, kwargs: Mapping[str, Any]
) -> tuple[int, ...]:
    """The ids the template renders for ``reply`` as the last message (where it is kept as generated),
    after the generation prompt: what a model trained on this template produces for that turn."""
    thinking = kwargs.get("enable_thinking", True)
    text = fe.chat_template.render([user("."), reply_message(reply, thinking)], **kwargs)
    start = text.rindex("<|im_start|>assistant\n")
    ids = tuple(fe.encode(text[start : text.index("<|im_end|>", start) + len("<|im_end|>")]))
    head = prompt.token_ids[max(i for i, t in enumerate(prompt.token_ids) if t == S.im_start) :]
    assert ids[: len(head)] == head, "the generation prompt is not a token prefix of the rendered turn"
    return ids[len(head) :]


def run_turn(
    fe: Frontend, prompt: PreparedPrompt, out: Sequence[int]
) -> tuple[OutputSession, tuple[int, ...]]:
    """Feed ``out`` in uneven spans like an Engine (boundaries read before each commit); returns the
    session and the output boundaries, relative to the output's start."""
    session = fe.new_output_session(prompt, OutputOptions())
    found: list[int] = []
    pos = 0
    for n in itertools.cycle((1, 5, 2, 9, 3)):
        preview = session.preview(out[pos : pos + n])
        assert isinstance(preview, OutputPreviewLike)
        bounds = getattr(preview, "boundaries", ())
        assert all(1 <= b <= preview.accepted for b in bounds)
        if not preview.stop:
            assert bounds == ()
        found += [pos + b for b in bounds]
        session.commit(preview)
        pos += preview.accepted
        if session.finished:
            break
    assert pos == len(out) and session.finish_reason == "stop"
    return session, tuple(found)


def sent_back(session: OutputSession) -> dict[str, Any]:
    """The assistant message as the serve layer returns it and a client sends it back."""
    calls = [c.to_openai() for c in session.tool_calls]
    return {
        "role": "assistant",
        "content": session.text if session.text or not calls else None,
        "reasoning_content": session.reasoning_text or None,
        "tool_calls": calls,
    }


@dataclass
class TurnRecord:
    messages: list[dict[str, Any]]
    prompt: PreparedPrompt
    out: tuple[int, ...]
    out_boundaries: tuple[int, ...]  # absolute (prompt + output positions)
    reply_index: int  # the reply's index in the next turn's messages


def replay(
    fe: Frontend, scenario: Scenario, kwargs: Mapping[str, Any], images: list[Any]
) -> list[TurnRecord]:
    thinking = kwargs.get("enable_thinking", True)
    messages = materialize(scenario.opening(), images)
    follows = iter(scenario.follows)
    records = []
    for turn in scenario.script:
        prompt = fe.prepare_chat(messages, tools=scenario.tools, **kwargs)
        out = model_output(fe, prompt, turn.reply, kwargs)
        session, bounds = run_turn(fe, prompt, out)
        # the parse is exact: what goes back is what the model said
        assert session.text == turn.reply.content
        assert session.reasoning_text == (turn.reply.reasoning if thinking else "")
        assert [(c.name, json.loads(c.arguments)) for c in session.tool_calls] == list(turn.reply.calls)
        records.append(
            TurnRecord(messages, prompt, out, tuple(len(prompt.token_ids) + b for b in bounds), len(messages))
        )
        follow = materialize(turn.follow, images) if turn.follow else [next(follows)]
        messages = [*messages, sent_back(session), *follow]
    return records


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def media(prompt: PreparedPrompt, n: int) -> list[tuple[int, str]]:
    return [(o, d) for o, c, d in prompt.media_spans() if o + c <= n]


# ---- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs_name", list(KWARGS))
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
@pytest.mark.parametrize("template", CHAT_TEMPLATES)
def test_boundaries_across_turns(
    template: str, scenario: Scenario, kwargs_name: str, frontends: dict[str, Frontend], images: list[Any]
) -> None:
    fe, kwargs = frontends[template], KWARGS[kwargs_name]
    records = replay(fe, scenario, kwargs, images)
    assert len(records) >= 6
    for rec, nxt in zip(records, records[1:]):
        ids, ids1 = rec.prompt.token_ids, nxt.prompt.token_ids
        bounds = rec.prompt.boundaries

        # where the boundaries are: preamble end, then one per assistant message, then the generation's
        assistants = [i for i, m in enumerate(rec.messages) if m["role"] == "assistant"]
        preamble = has_preamble(template, kwargs, scenario)
        assert len(bounds) == preamble + len(assistants) + 1
        assert list(bounds) == sorted(set(bounds)) and bounds[0] > 0 and bounds[-1] < len(ids)
        if preamble:
            assert ids[bounds[0] - 2 : bounds[0]] == (S.im_end, fe.encode("\n")[0])
            assert ids[bounds[0]] == S.im_start
        header = tuple(fe.encode("<|im_start|>assistant\n"))
        for b in bounds[preamble:]:
            assert ids[b - len(header) : b] == header
        for o, c, _ in rec.prompt.media_spans():
            assert not any(o < b < o + c for b in bounds)
        body = dict(zip(assistants, bounds[preamble:-1]))

        # which renders drop reasoning: an assistant message kept in turn k and not in turn k+1
        changed = [
            body[i]
            for i in assistants
            if keeps(template, kwargs, rec.messages, i) != keeps(template, kwargs, nxt.messages, i)
        ]
        first_change = min(changed, default=len(ids))
        for b in bounds:
            reproduced = ids1[:b] == ids[:b]
            assert reproduced == (b <= first_change), (b, first_change)
            same_digest = rec.prompt.prefix_digest(b) == nxt.prompt.prefix_digest(b)
            assert same_digest == reproduced

        # the output boundary: marked exactly when the next render keeps this turn as generated
        full = ids + rec.out
        kept = keeps(template, kwargs, nxt.messages, rec.reply_index)
        assert rec.out_boundaries == ((len(full),) if kept else ())
        assert (ids1[: len(full)] == full) == kept
        if kept:
            assert not changed  # a kept turn never follows dropped history
            assert prefix_digest(full, media(rec.prompt, len(full))) == nxt.prompt.prefix_digest(len(full))

        # the reuse a cache gets from turn k's boundaries, from the renders alone, and what the rules say
        candidates = [*bounds, *rec.out_boundaries]
        lcp = common_prefix(full if rec.out_boundaries else ids, ids1)
        reuse = max(b for b in candidates if b <= lcp)
        if kept:
            assert reuse == len(full)
        elif changed:
            assert reuse == first_change  # the body start of the first message that loses its reasoning
        else:
            assert reuse == bounds[-1]  # the generation prompt's body start: only the think opening is new
        # tight: one token more is not reproduced (when there is one)
        if reuse < min(len(full) if rec.out_boundaries else len(ids), len(ids1)):
            assert reuse == lcp
            assert rec.prompt.prefix_digest(reuse + 1) != nxt.prompt.prefix_digest(reuse + 1)


def test_rules_seen_in_the_conversations(frontends: dict[str, Frontend], images: list[Any]) -> None:
    """The template facts the expectations rest on, shown on the tool conversation: 3.6 drops the tool
    loop's reasoning at the next user query unless preserve_thinking; 3.8 keeps it unless
    preserve_thinking=false; thinking off reproduces the empty think block only where the turn is kept."""
    tools = SCENARIOS[3]

    def outputs(template: str, kwargs: dict[str, Any]) -> list[bool]:
        return [bool(r.out_boundaries) for r in replay(frontends[template], tools, kwargs, images)]

    loop = [True, True, False, True, False, False]  # tool-call turns are kept while their loop lasts
    assert outputs("qwen3_6", {}) == loop
    assert outputs("qwen3_6", {"enable_thinking": False}) == loop
    assert outputs("qwen3_6", {"preserve_thinking": True}) == [True] * 6
    assert outputs("qwen3_8", {}) == [True] * 6
    assert outputs("qwen3_8", {"enable_thinking": False}) == [True] * 6
    assert outputs("qwen3_8", {"preserve_thinking": False}) == loop
    # preserve_thinking=None is the template's own default, for the output renderer too
    assert outputs("qwen3_8", {"preserve_thinking": None}) == [True] * 6
    assert outputs("qwen3_6", {"preserve_thinking": None}) == loop


def test_boundary_one_token_off_is_not_reproduced(frontends: dict[str, Frontend], images: list[Any]) -> None:
    """Negative control: 3.6 default chat. The generation prompt's body start is reproduced next turn,
    the position one token later (inside the dropped think block) is not, nor does its digest match."""
    records = replay(frontends["qwen3_6"], SCENARIOS[0], {}, images)
    for rec, nxt in zip(records, records[1:]):
        b = rec.prompt.boundaries[-1]
        ids, ids1 = rec.prompt.token_ids, nxt.prompt.token_ids
        assert ids1[:b] == ids[:b] and ids[b] == S.think_open
        assert ids1[: b + 1] != ids[: b + 1]
        assert rec.prompt.prefix_digest(b + 1) != nxt.prompt.prefix_digest(b + 1)


@pytest.mark.parametrize("template", CHAT_TEMPLATES)
@pytest.mark.parametrize("edit", [1, 2, 3, 7, 8, 11])
def test_edited_history_reproduces_no_later_boundary(
    template: str, edit: int, frontends: dict[str, Frontend], images: list[Any]
) -> None:
    """Negative control: edit one earlier message of the last turn's history; no boundary after the edit
    is reproduced (ids or digest), every one before it is."""
    fe = frontends[template]
    kwargs = {"preserve_thinking": True}
    last = replay(fe, SCENARIOS[2], kwargs, images)[-1]
    messages = [dict(m) for m in last.messages]
    target = messages[edit]
    assert isinstance(target["content"], str) and target["content"]
    messages[edit] = {**target, "content": target["content"] + " (edited)"}
    edited = fe.prepare_chat(messages, tools=TOOLS, **kwargs)
    ids, ids1 = last.prompt.token_ids, edited.token_ids
    cut = common_prefix(ids, ids1)
    after = [b for b in last.prompt.boundaries if b > cut]
    assert after and len(after) < len(last.prompt.boundaries)
    for b in last.prompt.boundaries:
        reproduced = b <= cut
        assert (ids1[:b] == ids[:b]) == reproduced
        assert (edited.prefix_digest(b) == last.prompt.prefix_digest(b)) == reproduced


def test_client_that_drops_reasoning_falls_back_to_the_turn_start(
    frontends: dict[str, Frontend], images: list[Any]
) -> None:
    """The output boundary assumes the client sends ``reasoning_content`` back; one that drops it makes the
    kept turn render an empty think block, so the turn's end is not reproduced, but its start is."""
    fe = frontends["qwen3_6"]
    prompt = fe.prepare_chat([user("Weather in Paris?")], tools=TOOLS)
    out = model_output(fe, prompt, TOOL_SCRIPT[0].reply, {})
    session, bounds = run_turn(fe, prompt, out)
    assert bounds == (len(out),)
    message = {**sent_back(session), "reasoning_content": None}
    nxt = fe.prepare_chat([user("Weather in Paris?"), message, tool("18")], tools=TOOLS)
    full = prompt.token_ids + out
    assert nxt.token_ids[: len(full)] != full
    b = prompt.boundaries[-1]
    assert nxt.token_ids[:b] == prompt.token_ids[:b]


def test_output_boundary_needs_the_exact_tokens(
    frontends: dict[str, Frontend], tokenizer: TextTokenizer
) -> None:
    """The end of a kept turn is a boundary only for the ids the renderer gives: the same text split into
    other tokens, text the parse normalises away, or another stopping token give none."""
    fe = frontends["qwen3_8"]
    prompt = fe.prepare_chat([user("Hi there.")])
    reply = Reply("The user greets me.", "Hello! How can I help?")
    out = model_output(fe, prompt, reply, {})
    assert run_turn(fe, prompt, out)[1] == (len(out),)
    # "Hello" spelled as two tokens: same text, other ids
    hello = tokenizer.encode("Hello")
    assert len(hello) == 1
    k = out.index(hello[0])
    split = out[:k] + tuple(tokenizer.encode("Hel") + tokenizer.encode("lo")) + out[k + 1 :]
    assert tokenizer.decode(split) == tokenizer.decode(out)
    assert run_turn(fe, prompt, split)[1] == ()
    # an extra newline opening the reasoning: the parse drops it, so the render cannot give it back
    extra = tuple(tokenizer.encode("\n")) + out
    assert run_turn(fe, prompt, extra)[1] == ()
    # the turn ended by <|endoftext|> (also an eos): not the turn end the renderer writes
    other_stop = out[:-1] + (S.endoftext,)
    assert run_turn(fe, prompt, other_stop)[1] == ()


def test_lazy_preview_boundary_on_demand(frontends: dict[str, Frontend]) -> None:
    """A lazy preview computes its boundary only when asked, the same before and after its commit."""
    fe = frontends["qwen3_8"]
    prompt = fe.prepare_chat([user("Hi there.")])
    out = model_output(fe, prompt, Reply("Greeting.", "Hello!"), {})
    first = fe.new_output_session(prompt, OutputOptions())
    preview = first.preview(out)
    assert not preview.rendered
    assert preview.boundaries == (len(out),) and preview.rendered
    first.commit(preview)
    second = fe.new_output_session(prompt, OutputOptions())
    late = second.preview(out)
    second.commit(late)
    assert late.boundaries == (len(out),)
    # stop strings make previews eager: the same boundary
    eager = fe.new_output_session(prompt, OutputOptions(stop_strings=("never-said",)))
    assert eager.preview(out).boundaries == (len(out),)


def test_prompts_without_boundaries(frontends: dict[str, Frontend]) -> None:
    fe = frontends["qwen3_6"]
    chat = fe.prepare_chat([user("Hi there.")])
    for prompt in (fe.prepare_text(fe.decode(chat.token_ids)), fe.prepare_tokens(chat.token_ids)):
        assert prompt.boundaries == () and prompt.template_kwargs is None
        session = fe.new_output_session(prompt, OutputOptions())
        out = model_output(fe, chat, Reply("Greeting.", "Hello!"), {"preserve_thinking": True})
        assert session.preview(out).boundaries == ()
    # a prompt without a generation prompt has prompt boundaries but no output boundary
    done = fe.prepare_chat(
        [user("Hi."), {"role": "assistant", "content": "Hello."}], add_generation_prompt=False
    )
    assert len(done.boundaries) == 1
    session = fe.new_output_session(done, OutputOptions())
    assert session.preview((S.im_end,)).boundaries == ()
    # the contract shape: the optional members are there on the family's prompt
    assert isinstance(chat, PreparedPromptLike) and chat.boundaries


def test_prefix_digest_identity(frontends: dict[str, Frontend], images: list[Any]) -> None:
    fe = frontends["qwen3_6"]
    conversation = [user("Look."), {"role": "user", "content": [{"type": "image", "image": images[0]}]}]
    a = fe.prepare_chat(conversation)
    other = [conversation[0], {"role": "user", "content": [{"type": "image", "image": images[1]}]}]
    b = fe.prepare_chat(other)
    ((offset, count, digest),) = a.media_spans()
    assert digest == a.images[0].digest and count == a.images[0].num_tokens
    # images of different sizes: the pads differ; use a same-sized image for "same ids, other image"
    same_size = decode_image(png(64, 48, seed=7))
    c = fe.prepare_chat(
        [conversation[0], {"role": "user", "content": [{"type": "image", "image": same_size}]}]
    )
    assert c.token_ids == a.token_ids and c.digest != a.digest
    end = offset + count
    assert a.prefix_digest(offset) == c.prefix_digest(offset) == b.prefix_digest(offset)
    assert a.prefix_digest(end) != c.prefix_digest(end)
    for n in (offset + 1, end - 1):
        with pytest.raises(ValueError, match="cuts the image"):
            a.prefix_digest(n)
    with pytest.raises(ValueError):
        a.prefix_digest(len(a.token_ids) + 1)
    # deterministic, domain-separated from the whole-prompt digest, salted, equal to the neutral function
    n = len(a.token_ids)
    assert a.prefix_digest(n) == a.prefix_digest(n) != a.digest
    assert a.prefix_digest(n, salt="mtp") != a.prefix_digest(n)
    assert a.prefix_digest(n) == prefix_digest(a.token_ids, [(offset, digest)])
    # incremental hashing gives the one-shot digest at every boundary on the way
    hasher = PrefixHasher()
    pos = 0
    for bound in (*a.boundaries, n):
        hasher.extend(a.token_ids[pos:bound])
        if pos <= offset < bound:
            hasher.add_media(offset, digest)
        pos = bound
        assert hasher.hexdigest() == a.prefix_digest(bound)
    with pytest.raises(ValueError):
        prefix_digest([1, 2, 3], [(3, "x")])
    with pytest.raises(ValueError):
        prefix_digest([1, 2, 3], [(1, "x"), (0, "y")])
    # the digest's fields cannot run into each other: ids, media, salt and lengths are all framed
    variants = [
        prefix_digest([1]),
        prefix_digest([1], [(0, "a")]),
        prefix_digest([1], [(0, "ab")]),
        prefix_digest([1, 0]),
        prefix_digest([1], salt="a"),
        prefix_digest([]),
    ]
    assert len(set(variants)) == len(variants)
