"""`ninfer chat` on the bundled demo model, driven through `ninfer.cli.main.main` with a fake stdin.

Every request the CLI sends is captured by wrapping `Engine.submit`, so the tests read the exact
messages, template switches and results of each turn: history grows turn by turn, `/reset` and
`/think` change the next request, rejected and cancelled turns leave the history as it was, and the
streamed stdout is exactly the replies the Engine produced.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import pytest
import torch

from ninfer import (
    Engine,
    GenerationDelta,
    GenerationEvent,
    GenerationRequest,
    GenerationResult,
    ToolCallDelta,
    Usage,
)
from ninfer.cli.chat import DIM, RESET, Conversation, ReplyPrinter, TurnReader
from ninfer.cli.common import bundled_artifact
from ninfer.cli.main import main
from ninfer.runtime.contract.types import RequestPlan
from ninfer.runtime.engine.engine import GenerationHandle
from ninfer.targets.open import load_frontend

torch.set_num_threads(1)
GREEDY = ("--temperature", "0", "--device", "cpu")


@dataclass
class Turn:
    request: GenerationRequest
    handle: GenerationHandle

    @property
    def result(self) -> GenerationResult:
        return self.handle.result(raise_on_error=False)  # the CLI consumed it; the final result stays


@dataclass
class Spy:
    """Records every request the CLI submits, the handle it got back and the Engine's plan for it."""

    turns: list[Turn] = field(default_factory=list)
    plans: list[RequestPlan] = field(default_factory=list)
    interrupt_after_deltas: int | None = None  # raise KeyboardInterrupt mid-stream on the next request


class InterruptingHandle:
    """Stands in for a GenerationHandle and raises KeyboardInterrupt (as Ctrl-C does) mid-stream."""

    def __init__(self, inner: GenerationHandle, after_deltas: int) -> None:
        self.inner = inner
        self.after_deltas = after_deltas
        self.deltas = 0

    def __iter__(self) -> Iterator[GenerationEvent]:
        return self

    def __next__(self) -> GenerationEvent:
        event = next(self.inner)
        if isinstance(event, GenerationDelta):
            self.deltas += 1
            if self.deltas > self.after_deltas:
                raise KeyboardInterrupt
        return event

    def cancel(self) -> None:
        self.inner.cancel()

    def result(self, timeout: float | None = None, *, raise_on_error: bool = True) -> GenerationResult:
        return self.inner.result(timeout, raise_on_error=raise_on_error)

    def __enter__(self) -> InterruptingHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.inner.close()


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    recorded = Spy()
    real_submit = Engine.submit
    real_plan = Engine._plan

    def submit(self: Engine, request: GenerationRequest) -> Any:
        handle = real_submit(self, request)
        recorded.turns.append(Turn(request, handle))
        if recorded.interrupt_after_deltas is not None:
            after, recorded.interrupt_after_deltas = recorded.interrupt_after_deltas, None
            return InterruptingHandle(handle, after)
        return handle

    def plan(self: Engine, request: GenerationRequest, prompt: Any) -> RequestPlan:
        recorded.plans.append(real_plan(self, request, prompt))
        return recorded.plans[-1]

    monkeypatch.setattr(Engine, "submit", submit)
    monkeypatch.setattr(Engine, "_plan", plan)
    return recorded


def chat(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stdin: str, *flags: str
) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    capsys.readouterr()
    rc = main(["chat", *flags])
    out, err = capsys.readouterr()
    return rc, out, err


def shown(result: GenerationResult) -> str:
    """What the CLI prints for a reply when stdout is not a terminal."""
    out = f"<think>\n{result.reasoning_text}\n</think>" if result.reasoning_text else ""
    if result.text:
        out += ("\n\n" if out else "") + result.text
    return out + "\n\n"


def assistant(result: GenerationResult) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.reasoning_text:
        message["reasoning_content"] = result.reasoning_text
    return message


def test_two_turns_send_the_history_and_stream_both_replies(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], spy: Spy
) -> None:
    rc, out, err = chat(monkeypatch, capsys, "def add(a, b):\nand subtract?\n", "--max-tokens", "8", *GREEDY)
    assert rc == 0, err
    assert "bundled demo model qwen3_6_demo" in err
    first, second = spy.turns
    r1, r2 = first.result, second.result
    assert r1.finish_reason == r2.finish_reason == "length" and r1.usage.completion_tokens == 8
    assert out == shown(r1) + shown(r2)  # no prompt decoration: stdin is not a terminal
    assert ">>>" not in out
    assert first.request.messages == [{"role": "user", "content": "def add(a, b):"}]
    assert second.request.messages == [
        {"role": "user", "content": "def add(a, b):"},
        assistant(r1),
        {"role": "user", "content": "and subtract?"},
    ]
    assert first.request.chat_template_kwargs == {"enable_thinking": True}
    assert first.request.temperature == 0.0 and first.request.max_tokens == 8
    # sampling flags left out reach the Engine as None; it takes the model's generation config defaults
    assert first.request.top_k is None and first.request.repetition_penalty is None
    sampling = spy.plans[0].sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repetition_penalty) == (
        0.0,
        20,
        0.95,
        1.1,
    )
    # the second prompt is the rendered conversation, longer than the first
    frontend = load_frontend(bundled_artifact())
    expected = frontend.prepare_chat(second.request.messages, enable_thinking=True).token_ids
    assert r2.usage.prompt_tokens == len(expected) > r1.usage.prompt_tokens


def test_reset_keeps_the_system_message_and_forgets_the_turns(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], spy: Spy
) -> None:
    stdin = "first\n/reset\nsecond\n"
    rc, _, err = chat(monkeypatch, capsys, stdin, "--system", "Be brief.", "--max-tokens", "2", *GREEDY)
    assert rc == 0, err
    assert "[conversation cleared]" in err
    system = {"role": "system", "content": "Be brief."}
    assert [t.request.messages for t in spy.turns] == [
        [system, {"role": "user", "content": "first"}],
        [system, {"role": "user", "content": "second"}],
    ]


def test_think_toggles_enable_thinking(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], spy: Spy
) -> None:
    stdin = "one\n/think off\ntwo\n/think\n/think on\nthree\n/think maybe\n"
    rc, _, err = chat(monkeypatch, capsys, stdin, "--max-tokens", "4", *GREEDY)
    assert rc == 0, err
    flags = [t.request.chat_template_kwargs["enable_thinking"] for t in spy.turns]
    assert flags == [True, False, True]
    assert err.count("[thinking off]") == 2 and "[thinking on]" in err
    assert "/think takes on or off, got 'maybe'" in err
    # thinking off: the template closes the think block, so the reply has no reasoning
    assert spy.turns[0].result.reasoning_text and not spy.turns[1].result.reasoning_text
    # --no-think starts with it off
    spy.turns.clear()
    rc, _, _ = chat(monkeypatch, capsys, "hi\n", "--no-think", "--max-tokens", "2", *GREEDY)
    assert rc == 0 and spy.turns[0].request.chat_template_kwargs == {"enable_thinking": False}


def test_eof_and_exit_end_the_session_cleanly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], spy: Spy
) -> None:
    rc, out, _ = chat(monkeypatch, capsys, "", *GREEDY)
    assert rc == 0 and out == "" and not spy.turns
    rc, _, err = chat(monkeypatch, capsys, "\n   \n/help\n/nope\n/exit\nnever sent\n", *GREEDY)
    assert rc == 0 and not spy.turns  # blank lines and commands are not turns; /exit stops reading
    assert "/reset" in err and "unknown command /nope" in err


def test_too_long_input_is_refused_and_the_session_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], spy: Spy
) -> None:
    long_line = " ".join(f"word{i}" for i in range(80))
    stdin = f"{long_line}\nhi\n"
    rc, out, err = chat(monkeypatch, capsys, stdin, "--max-context", "64", "--max-tokens", "4", *GREEDY)
    assert rc == 0, err
    assert "max_context is 64" in err and "/reset clears the conversation" in err
    assert len(spy.turns) == 1  # the long turn never reached the Engine
    (turn,) = spy.turns
    assert turn.request.messages == [{"role": "user", "content": "hi"}]  # the refused turn was not kept
    assert out == shown(turn.result)


def test_max_tokens_beyond_the_context_replies_up_to_the_limit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], spy: Spy
) -> None:
    rc, _, err = chat(monkeypatch, capsys, "hi\n", "--max-context", "24", "--max-tokens", "50", *GREEDY)
    assert rc == 0, err
    (turn,) = spy.turns  # the request with max_tokens 50 was refused at submit; this is the retry
    assert turn.request.max_tokens is None
    result = turn.result
    assert result.finish_reason == "length"
    assert result.usage.prompt_tokens + result.usage.completion_tokens == 24
    assert "[reply cut at" in err


def test_ctrl_c_cancels_the_reply_and_drops_the_turn(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], spy: Spy
) -> None:
    spy.interrupt_after_deltas = 1
    rc, _, err = chat(monkeypatch, capsys, "hi\nagain\n", "--max-tokens", "120", "--no-think", *GREEDY)
    assert rc == 0, err
    interrupted, after = spy.turns
    cancelled = interrupted.result
    assert cancelled.finish_reason == "cancelled" and 1 <= cancelled.usage.completion_tokens < 120
    assert "[cancelled; the turn was dropped]" in err
    assert after.request.messages == [{"role": "user", "content": "again"}]
    assert after.result.usage.completion_tokens == 120


class TerminalStdin(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_interactive_session_prompts_and_survives_ctrl_c_at_the_prompt(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], spy: Spy
) -> None:
    script: list[str | type[BaseException]] = [KeyboardInterrupt, "two \\", "lines", EOFError]
    prompts: list[str] = []

    def scripted_input(prompt: str = "") -> str:
        prompts.append(prompt)
        step = script.pop(0)
        if isinstance(step, str):
            return step
        raise step

    monkeypatch.setattr("builtins.input", scripted_input)
    monkeypatch.setattr("sys.stdin", TerminalStdin(""))
    capsys.readouterr()
    assert main(["chat", "--max-tokens", "2", *GREEDY]) == 0
    _, err = capsys.readouterr()
    assert prompts == [">>> ", ">>> ", "... ", ">>> "]
    assert "ninfer chat: qwen3_6_demo (context 8192 tokens, thinking on); /help for commands" in err
    assert "(Ctrl-D or /exit to quit)" in err  # Ctrl-C at the prompt drops the line, not the session
    assert [t.request.messages for t in spy.turns] == [[{"role": "user", "content": "two \nlines"}]]


def test_bad_sampling_flag_is_refused_before_the_first_turn(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], spy: Spy
) -> None:
    rc, _, err = chat(monkeypatch, capsys, "hi\n", "--top-p", "0", *GREEDY)
    assert rc == 1 and "top_p must be in (0, 1]" in err and not spy.turns


def test_reader_joins_continued_lines_and_quoted_blocks() -> None:
    stdin = 'one \\\ntwo\\\nthree\n"""\n/not a command\n  indented\n"""\n"""inline"""\nplain\n"""open\n'
    reader = TurnReader(io.StringIO(stdin), interactive=False)
    turns = []
    while (turn := reader.read()) is not None:
        turns.append((turn.text, turn.quoted))
    assert turns == [
        ("one \ntwo\nthree", False),
        ("/not a command\n  indented", True),
        ("inline", True),
        ("plain", False),
        ("open", True),  # end of input closes an open block
    ]


def test_quoted_block_starting_with_slash_is_a_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], spy: Spy
) -> None:
    rc, _, err = chat(monkeypatch, capsys, '"""\n/usr/bin/env python3\n"""\n', "--max-tokens", "1", *GREEDY)
    assert rc == 0, err
    assert spy.turns[0].request.messages == [{"role": "user", "content": "/usr/bin/env python3"}]


def test_printer_dims_reasoning_on_a_terminal() -> None:
    out = io.StringIO()
    printer = ReplyPrinter(out, terminal=True)
    printer.delta(GenerationDelta(request_id=1, reasoning_text="let me see"))
    printer.delta(GenerationDelta(request_id=1, reasoning_text=" more"))
    printer.delta(GenerationDelta(request_id=1, text="answer"))
    printer.finish(None)
    assert out.getvalue() == f"{DIM}let me see more{RESET}\n\nanswer\n\n"
    out = io.StringIO()
    printer = ReplyPrinter(out, terminal=True)
    printer.delta(GenerationDelta(request_id=1, reasoning_text="cut off"))
    printer.finish(None)
    assert out.getvalue() == f"{DIM}cut off{RESET}\n\n"  # the terminal is never left dimmed


def test_history_with_tool_calls_renders_through_the_chat_template() -> None:
    conversation = Conversation()
    call = ToolCallDelta(index=0, id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    reply = GenerationResult(
        request_id=1,
        text="",
        reasoning_text="I should look it up.",
        tool_calls=(call,),
        token_ids=(),
        finish_reason="stop",
        usage=Usage(prompt_tokens=10, completion_tokens=20),
    )
    conversation.record("Weather in Paris?", reply)
    messages = conversation.messages("Thanks")
    function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert messages[1]["tool_calls"] == [{"id": "call_1", "type": "function", "function": function}]
    frontend = load_frontend(bundled_artifact())
    text = frontend.render_chat(messages, preserve_thinking=True)
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text
    assert "<think>\nI should look it up.\n</think>" in text
