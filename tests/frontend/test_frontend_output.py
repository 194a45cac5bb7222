"""OutputSession semantics: UTF-8-safe streaming, stop strings and tokens, thinking/content channels,
thinking-budget forcing, preview purity. Token sequences come from the real tokenizer, streamed one token
at a time and in random multi-token spans (as speculative decoding commits them)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from ninfer.targets.qwen3_6.frontend import (
    FORCED_THINK_CLOSE_TEXT,
    Frontend,
    FrontendResources,
    OutputDelta,
    OutputOptions,
    OutputSession,
    PreparedPrompt,
    SpecialTokens,
)
from ninfer.targets.qwen3_6.resources import RESOURCE_DIR

IM_END = 248046
USER_TURN = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def fe() -> Frontend:
    res = FrontendResources(
        tokenizer_json=(RESOURCE_DIR / "tokenizer.json").read_bytes(),
        chat_template=(RESOURCE_DIR / "qwen3_6.jinja").read_text(encoding="utf-8"),
        generation_config={"eos_token_id": [248046, 248044]},
    )
    return Frontend.from_resources(res, SpecialTokens())


@pytest.fixture(scope="module")
def thinking_prompt(fe: Frontend) -> PreparedPrompt:
    return fe.prepare_chat(USER_TURN)


@pytest.fixture(scope="module")
def plain_prompt(fe: Frontend) -> PreparedPrompt:
    return fe.prepare_chat(USER_TURN, enable_thinking=False)


def drive(
    session: OutputSession, ids: Sequence[int], sizes: Sequence[int] | None = None
) -> list[OutputDelta]:
    """Preview + commit ``ids`` in spans (default one token each) until a stop; the accepted invariants
    of the Engine contract are checked on every span."""
    deltas = []
    pos, k = 0, 0
    while pos < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        span = ids[pos : pos + n]
        preview = session.preview(span)
        assert 1 <= preview.accepted <= len(span)
        assert preview.stop or preview.accepted == len(span)
        deltas.append(session.commit(preview))
        pos += preview.accepted
        k += 1
        if preview.stop:
            break
    return deltas


def run(
    fe: Frontend,
    prompt: PreparedPrompt,
    ids: Sequence[int],
    options: OutputOptions | None = None,
    sizes: Sequence[int] | None = None,
    finish: bool = True,
) -> tuple[OutputSession, list[OutputDelta]]:
    session = fe.new_output_session(prompt, options or OutputOptions())
    deltas = drive(session, ids, sizes)
    if finish:
        deltas.append(session.finish())
    return session, deltas


def joined(deltas: Sequence[OutputDelta]) -> tuple[str, str]:
    return "".join(d.text for d in deltas), "".join(d.reasoning_text for d in deltas)


def test_multibyte_chars_split_across_tokens(fe: Frontend, plain_prompt: PreparedPrompt) -> None:
    text = "A𠀀B ꙮ🫨 𓀀 龘 end"
    ids = fe.encode(text)
    # the premise: decoding token by token would emit U+FFFD halves
    assert any("\ufffd" in fe.decode([i]) for i in ids)
    for sizes in (None, [2], [3, 1]):
        session, deltas = run(fe, plain_prompt, ids, sizes=sizes)
        assert all("\ufffd" not in d.text for d in deltas)
        assert session.text == text and session.finish_reason is None
    # 𓀀 arrives as four one-byte tokens: nothing is emitted until the character is complete
    quad = fe.encode("𓀀")
    assert len(quad) == 4
    session = fe.new_output_session(plain_prompt, OutputOptions())
    assert [session.commit(session.preview([t])).text for t in quad] == ["", "", "", "𓀀"]


def test_invalid_bytes_are_not_held_forever(fe: Frontend, plain_prompt: PreparedPrompt) -> None:
    lead = fe.encode("𠀀")[0]  # a lone lead byte: never completes if followed by more lead bytes
    session = fe.new_output_session(plain_prompt, OutputOptions())
    texts = [session.commit(session.preview([lead])).text for _ in range(6)]
    assert texts[:3] == ["", "", ""] and "\ufffd" in "".join(texts)
    # an incomplete character at the end is flushed by finish()
    session = fe.new_output_session(plain_prompt, OutputOptions())
    assert session.commit(session.preview(fe.encode("ok") + [lead])).text == "ok"
    assert session.finish().text == "\ufffd"


def test_stop_string_across_tokens(fe: Frontend, plain_prompt: PreparedPrompt) -> None:
    text = "Hello world, this is STOP here and more"
    ids = fe.encode(text)
    stop = "s STO"
    assert not any(stop in fe.decode([i]) for i in ids)  # spans a token boundary
    stop_at = next(k for k in range(1, len(ids) + 1) if stop in fe.decode(ids[:k]))
    for sizes in (None, [len(ids)], [2, 3]):
        session, deltas = run(fe, plain_prompt, ids, OutputOptions(stop_strings=(stop, "never")), sizes)
        assert session.text == "Hello world, this i"
        assert session.finish_reason == "stop" and session.stop_reason == stop
        assert session.token_ids == tuple(ids[:stop_at])
        assert deltas[-1].text == ""  # finish() after a stop adds nothing
    session, _ = run(fe, plain_prompt, ids, OutputOptions(stop_strings=(stop,), include_stop_str=True))
    assert session.text == "Hello world, this is STO"
    # one span carrying the stop and more tokens: accepted ends at the completing token
    session = fe.new_output_session(plain_prompt, OutputOptions(stop_strings=(stop,)))
    preview = session.preview(ids)
    assert preview.stop and preview.accepted == stop_at and preview.delta.token_ids == tuple(ids[:stop_at])
    session.commit(preview)
    with pytest.raises(RuntimeError, match="finished"):
        session.preview(ids[:1])


def test_stop_string_prefix_is_held_then_released(fe: Frontend, plain_prompt: PreparedPrompt) -> None:
    text = "Hello world, and the world is wide"
    ids = fe.encode(text)
    session = fe.new_output_session(plain_prompt, OutputOptions(stop_strings=("world peace",)))
    seen = ""
    for i in ids:
        seen += session.commit(session.preview([i])).text
        # never publish text that could still turn out to be the start of the stop string
        assert not any(seen.endswith("world peace"[:n]) for n in range(1, 12))
    assert session.finish().text == "" and session.text == text  # "wide" does not start it
    session, deltas = run(fe, plain_prompt, fe.encode("say wor"), OutputOptions(stop_strings=("world",)))
    assert [d.text for d in deltas][-1] == "wor" and session.text == "say wor"


def test_stop_tokens(fe: Frontend, plain_prompt: PreparedPrompt) -> None:
    body = fe.encode("Four.")
    ids = body + [IM_END] + fe.encode(" junk")
    session = fe.new_output_session(plain_prompt, OutputOptions())
    preview = session.preview(ids)
    assert preview.stop and preview.accepted == len(body) + 1
    assert preview.delta.text == "Four." and preview.delta.token_ids == tuple(body + [IM_END])
    session.commit(preview)
    assert session.finish_reason == "stop" and session.stop_reason == IM_END and session.finished
    with pytest.raises(RuntimeError):
        session.preview([1])
    # ignore_eos: the eos is ordinary output; its text only shows without skip_special_tokens
    session, _ = run(fe, plain_prompt, ids, OutputOptions(ignore_eos=True))
    assert session.text == "Four. junk" and session.finish_reason is None
    session, _ = run(fe, plain_prompt, ids, OutputOptions(ignore_eos=True, skip_special_tokens=False))
    assert session.text == "Four.<|im_end|> junk"
    # extra stop ids stop too, with or without ignore_eos
    dot = fe.encode(".")[0]
    session, _ = run(fe, plain_prompt, ids, OutputOptions(stop_token_ids=(dot,), ignore_eos=True))
    assert session.text == "Four" and session.stop_reason == dot


def test_thinking_opened_by_prompt(fe: Frontend, thinking_prompt: PreparedPrompt) -> None:
    assert thinking_prompt.opens_thinking
    gen = "2+2 is basic.\nSo 4.\n</think>\n\nThe answer is 4.<|im_end|>"
    ids = fe.encode(gen)
    for sizes in (None, [len(ids)], [3, 1, 2]):
        session, deltas = run(fe, thinking_prompt, ids, sizes=sizes)
        assert (session.reasoning_text, session.text) == ("2+2 is basic.\nSo 4.", "The answer is 4.")
        assert joined(deltas) == ("The answer is 4.", "2+2 is basic.\nSo 4.")
    # the split re-renders through the template to exactly the prompt plus the generated tokens
    answer = {"role": "assistant", "reasoning_content": session.reasoning_text, "content": session.text}
    history = USER_TURN + [answer]
    rendered = fe.render_chat(history, add_generation_prompt=False)
    assert rendered == fe.decode(thinking_prompt.token_ids) + gen + "\n"
    # without reasoning parsing everything is content, </think> included: it is markup, not a control
    # token, so skip_special_tokens keeps it
    session, _ = run(fe, thinking_prompt, ids, OutputOptions(parse_reasoning=False))
    assert session.reasoning_text == "" and session.text == gen.removesuffix("<|im_end|>")


def test_thinking_emitted_by_model(fe: Frontend, plain_prompt: PreparedPrompt) -> None:
    assert not plain_prompt.opens_thinking
    ids = fe.encode("<think>\nhmm, easy\n\n</think>\n\nFour.<|im_end|>")
    for sizes in (None, [2]):
        session, _ = run(fe, plain_prompt, ids, sizes=sizes)
        assert (session.reasoning_text, session.text) == ("hmm, easy", "Four.")
    session, _ = run(fe, plain_prompt, fe.encode("Just four.\n\nReally.<|im_end|>"))
    assert (session.reasoning_text, session.text) == ("", "Just four.\n\nReally.")
    # a stray </think> in content is a marker, not text
    session, _ = run(fe, plain_prompt, fe.encode("Four.</think>"))
    assert session.text == "Four."


def test_reasoning_cut_by_length(fe: Frontend, thinking_prompt: PreparedPrompt) -> None:
    ids = fe.encode("Still thinking about <b>this\n\n")
    session, deltas = run(fe, thinking_prompt, ids)
    assert session.reasoning_text == "Still thinking about <b>this" and session.text == ""
    assert session.finish_reason is None and deltas[-1].token_ids == ()


def test_thinking_budget_forces_close(fe: Frontend, thinking_prompt: PreparedPrompt) -> None:
    force = tuple(fe.encode(FORCED_THINK_CLOSE_TEXT))
    assert force == (198, 248069, 271)
    reasoning_ids = fe.encode("one two three four five six seven")
    session = fe.new_output_session(thinking_prompt, OutputOptions(thinking_budget=4))
    forced_at = None
    for k, t in enumerate(reasoning_ids):
        preview = session.preview([t])
        session.commit(preview)
        if preview.force_tokens:
            forced_at = k
            break
    assert forced_at == 3 and preview.force_tokens == force and session.force_tokens == force
    preview = session.preview(list(force))  # the Engine runs the forced tokens through the same path
    assert preview.force_tokens == () and not preview.stop and preview.accepted == 3
    session.commit(preview)
    deltas = drive(session, fe.encode("Answer: 4.") + [IM_END])
    assert all(d.reasoning_text == "" for d in deltas)
    assert session.reasoning_text == fe.decode(reasoning_ids[:4]) and session.text == "Answer: 4."
    assert session.token_ids == tuple(reasoning_ids[:4]) + force + tuple(fe.encode("Answer: 4.")) + (IM_END,)
    # a span crossing the budget is accepted whole (only a stop shortens a span), then forcing is asked
    session = fe.new_output_session(thinking_prompt, OutputOptions(thinking_budget=4))
    preview = session.preview(reasoning_ids[:6])
    assert preview.accepted == 6 and preview.force_tokens == force
    # no forcing once the model closed reasoning itself, nor when thinking was never opened
    session = fe.new_output_session(thinking_prompt, OutputOptions(thinking_budget=4))
    for t in fe.encode("ok\n</think>\n\nA B C D E F"):
        preview = session.preview([t])
        assert preview.force_tokens == ()
        session.commit(preview)
    assert session.reasoning_text == "ok" and session.text == "A B C D E F"
    # budget 0: the session asks for the close before the first model token
    session = fe.new_output_session(thinking_prompt, OutputOptions(thinking_budget=0))
    assert session.force_tokens == force
    session.commit(session.preview(list(force)))
    assert session.force_tokens == () and session.reasoning_text == ""
    plain = fe.prepare_chat(USER_TURN, enable_thinking=False)
    session = fe.new_output_session(plain, OutputOptions(thinking_budget=0))
    assert session.preview(reasoning_ids).force_tokens == ()
    with pytest.raises(ValueError, match="thinking_budget"):
        fe.new_output_session(thinking_prompt, OutputOptions(thinking_budget=-1))


def test_preview_is_pure(fe: Frontend, thinking_prompt: PreparedPrompt) -> None:
    ids = fe.encode("Reason 😀.\n</think>\n\nAnswer: 𠀀 ok<|im_end|>")
    opts = OutputOptions(stop_strings=("ok",), include_stop_str=True)
    reference, _ = run(fe, thinking_prompt, ids, opts, finish=False)

    session = fe.new_output_session(thinking_prompt, opts)
    pos = 0
    while not session.finished:
        span = ids[pos : pos + 2]
        first = session.preview(span)
        second = session.preview(span)  # previewing again sees the same committed state
        assert first == second
        before = (session.text, session.reasoning_text, session.token_ids)
        session.preview(ids[pos : pos + 5])  # a different preview, dropped
        assert (session.text, session.reasoning_text, session.token_ids) == before
        third = session.preview(span)
        session.commit(third)
        pos += third.accepted
    assert (session.text, session.reasoning_text, session.token_ids, session.stop_reason) == (
        reference.text,
        reference.reasoning_text,
        reference.token_ids,
        reference.stop_reason,
    )
    assert session.text == "Answer: 𠀀 ok" and session.reasoning_text == "Reason 😀."


def test_commit_needs_latest_preview(fe: Frontend, plain_prompt: PreparedPrompt) -> None:
    session = fe.new_output_session(plain_prompt, OutputOptions())
    a = session.preview(fe.encode("a"))
    b = session.preview(fe.encode("b"))
    with pytest.raises(ValueError, match="latest preview"):
        session.commit(a)
    session.commit(b)
    with pytest.raises(ValueError, match="latest preview"):
        session.commit(b)  # already applied
    assert session.text == "b"
    assert session.finish() == OutputDelta() and session.finish() == OutputDelta()


def test_random_spans_agree_with_single_tokens(fe: Frontend, thinking_prompt: PreparedPrompt) -> None:
    rnd = random.Random(3)
    gen = "Plan: 分析 😀 <x> </thi> a\n\nb\n</think>\n\n\nResult ꙮ <thin k> done.\nEND tail<|im_end|>"
    ids = fe.encode(gen)
    opts = OutputOptions(stop_strings=("END",))
    ref, ref_deltas = run(fe, thinking_prompt, ids, opts)
    assert ref.reasoning_text == "Plan: 分析 😀 <x> </thi> a\n\nb"
    assert ref.text == "Result ꙮ <thin k> done.\n" and ref.stop_reason == "END"
    for _ in range(12):
        sizes = [rnd.randint(1, 6) for _ in range(8)]
        session, deltas = run(fe, thinking_prompt, ids, opts, sizes)
        assert joined(deltas) == joined(ref_deltas)
        assert (session.text, session.reasoning_text, session.token_ids) == (
            ref.text,
            ref.reasoning_text,
            ref.token_ids,
        )
