"""`ninfer chat [ARTIFACT]`: an interactive multi-turn chat in the terminal through the public Engine.

One Engine serves the whole session (one lane, no warmup). Each user turn is one chat request whose
``messages`` hold the whole conversation so far, as OpenAI-style messages: assistant turns keep their
``reasoning_content`` and ``tool_calls`` so the chat template renders the history the way the model
expects. Replies stream; reasoning is dimmed when stdout is a terminal and wrapped in ``<think>`` ...
``</think>`` otherwise.

Input: one line per turn; a line ending in ``\\`` continues on the next line, and ``\"\"\"`` opens a block
that ends at a line ending in ``\"\"\"``. Lines starting with ``/`` are commands (``/help``). Ctrl-C while
a reply streams cancels it (the turn is dropped) and returns to the prompt; Ctrl-D or end of input exits
with status 0. With stdin not a terminal (``echo hi | ninfer chat``) every line is a turn and no prompt
decoration is printed. A turn the Engine rejects (the context limit, for example) prints the Engine's
message and leaves the conversation as it was; ``/reset`` clears it. ``/image PATH`` attaches an image (a
file or a data: URL, read and decoded at once) to the next message; it stays in the history after.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from ninfer.cli.common import (
    add_engine_flags,
    add_reuse_flags,
    check_text,
    fail,
    interactive_engine_config,
    one_line,
    product_errors,
    speculative_problem,
    split_artifact,
)
from ninfer.cli.images import image_part

if TYPE_CHECKING:  # the CLI imports the Engine lazily, so `ninfer --help` stays fast
    from ninfer import Engine, GenerationDelta, GenerationRequest, GenerationResult

DIM, RESET = "\x1b[2m", "\x1b[0m"
PROMPT, CONTINUATION = ">>> ", "... "
TRIPLE_QUOTE = '"""'

HELP = """commands:
  /exit, /quit      leave the chat (Ctrl-D or end of input does too)
  /reset            forget the conversation (the --system message stays)
  /think on|off     let the model think before answering, or not; /think alone shows the setting
  /image PATH       attach an image (a file or a data: URL) to your next message (repeatable); /image
                    alone lists what is attached
  /help             this text
input:
  a line ending in \\ continues on the next line; \"\"\" opens a block that ends at a line ending in \"\"\"
  (a block is always sent as a message, even when it starts with /)
  Ctrl-C while the model answers cancels the reply and drops the turn"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    p.add_argument("artifact", nargs="?", help="a .ninfer file (default: the bundled demo model)")
    p.add_argument("--system", default=None, help="system message for the whole conversation")
    p.add_argument("--no-think", action="store_true", help="start with thinking off (/think on turns it on)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="generated-token cap per reply (default: until the model ends its turn or the context is full)",
    )
    p.add_argument("--temperature", type=float, default=None, help="default: the model's generation config")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="sampling seed of every reply (default: fresh)")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="after each reply print why it ended, token counts and speed on stderr",
    )
    add_engine_flags(p)
    add_reuse_flags(p)
    p.set_defaults(func=run)


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """Sampling fields of every turn's request, as the command line gives them: a flag left out stays
    ``None`` and the Engine takes the model's generation-config default (as for ``ninfer generate`` and
    ``ninfer serve``)."""
    return {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
    }


# ---------------------------------------------------------------------------------------------------
# Conversation
# ---------------------------------------------------------------------------------------------------


@dataclass
class Conversation:
    """The history sent with every turn, as OpenAI-style chat messages."""

    system: str | None = None
    enable_thinking: bool = True
    turns: list[dict[str, Any]] = field(default_factory=list)

    def messages(self, user_text: str, images: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        """The request's messages: system, the history, then the new user message (its ``images``, decoded
        image parts, before the text)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.turns, _user(user_text, images)]

    def record(self, user_text: str, reply: GenerationResult, images: Sequence[dict[str, Any]] = ()) -> None:
        """Keep a finished turn. Reasoning and tool calls go with the assistant message so the chat
        template can render (or drop, per its own rules) them in later prompts."""
        assistant: dict[str, Any] = {"role": "assistant", "content": reply.text}
        if reply.reasoning_text:
            assistant["reasoning_content"] = reply.reasoning_text
        if reply.tool_calls:
            assistant["tool_calls"] = [
                {
                    "id": call.id or f"call_{call.index}",
                    "type": "function",
                    "function": {"name": call.name or "", "arguments": call.arguments},
                }
                for call in reply.tool_calls
            ]
        self.turns += [_user(user_text, images), assistant]

    def reset(self) -> None:
        self.turns.clear()


def _user(text: str, images: Sequence[dict[str, Any]]) -> dict[str, Any]:
    content: Any = [*images, {"type": "text", "text": text}] if images else text
    return {"role": "user", "content": content}


# ---------------------------------------------------------------------------------------------------
# Input
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UserInput:
    """One user turn as typed; ``quoted`` input (a triple-quote block) is never a command."""

    text: str
    quoted: bool = False


class TurnReader:
    """Reads one user turn at a time: a line, a ``\\``-continued line, or a triple-quote block.

    Interactive (stdin is a terminal) it prompts through ``input()`` (readline editing when available);
    otherwise it reads stdin lines silently. ``read`` returns ``None`` at end of input.
    """

    def __init__(self, stream: TextIO, interactive: bool) -> None:
        self.stream = stream
        self.interactive = interactive
        if interactive:
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  (line editing and in-session history for input())

    def _line(self, prompt: str) -> str | None:
        if self.interactive:
            try:
                return input(prompt)
            except EOFError:
                return None
        line = self.stream.readline()
        return line.removesuffix("\n").removesuffix("\r") if line else None

    def read(self) -> UserInput | None:
        line = self._line(PROMPT)
        if line is None:
            return None
        if line.lstrip().startswith(TRIPLE_QUOTE):
            return UserInput(self._block(line.lstrip()[len(TRIPLE_QUOTE) :]), quoted=True)
        parts = []
        while line is not None and line.endswith("\\"):
            parts.append(line[:-1])
            line = self._line(CONTINUATION)
        parts.append(line or "")
        return UserInput("\n".join(parts))

    def _block(self, first: str) -> str:
        """Lines up to the one ending in the closing triple quote (or end of input)."""
        lines: list[str] = []
        line: str | None = first
        while line is not None:
            if line.rstrip().endswith(TRIPLE_QUOTE):
                lines.append(line.rstrip()[: -len(TRIPLE_QUOTE)])
                break
            lines.append(line)
            line = self._line(CONTINUATION)
        return "\n".join(lines).strip("\n")


# ---------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------


class ReplyPrinter:
    """Streams one reply: reasoning dimmed on a terminal (``<think>`` markers otherwise), then the answer."""

    def __init__(self, out: TextIO, terminal: bool) -> None:
        self.out = out
        self.terminal = terminal
        self.channel: str | None = None  # "reasoning" or "content" once something was written

    def _switch(self, channel: str) -> None:
        if channel == self.channel:
            return
        if self.channel == "reasoning":
            self.out.write(RESET + "\n\n" if self.terminal else "\n</think>\n\n")
        if channel == "reasoning":
            self.out.write(DIM if self.terminal else "<think>\n")
        self.channel = channel

    def delta(self, event: GenerationDelta) -> None:
        if event.reasoning_text:
            self._switch("reasoning")
            self.out.write(event.reasoning_text)
        if event.text:
            self._switch("content")
            self.out.write(event.text)
        self.out.flush()

    def finish(self, reply: GenerationResult | None) -> None:
        """Close an open reasoning block, show tool calls, end the reply with a blank line."""
        if self.channel == "reasoning":
            self.out.write(RESET if self.terminal else "\n</think>")
        for call in reply.tool_calls if reply is not None else ():
            self.out.write(f"\n[tool call] {call.name}({call.arguments})")
        self.out.write("\n\n")  # a blank line between replies
        self.out.flush()


# ---------------------------------------------------------------------------------------------------
# Session
# ---------------------------------------------------------------------------------------------------


def new_session_id() -> str:
    return f"chat-{secrets.token_hex(8)}"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class ChatSession:
    """One Engine, one conversation, one reply at a time."""

    def __init__(self, engine: Engine, args: argparse.Namespace, interactive: bool) -> None:
        self.engine = engine
        self.interactive = interactive
        self.conversation = Conversation(system=args.system, enable_thinking=not args.no_think)
        self.sampling = sampling_options(args)
        self.verbose = args.verbose
        self.terminal_out = sys.stdout.isatty()
        # the context cache's session key: each turn continues the checkpoint the last one left (a hint:
        # reuse is decided by content, so a reply never depends on it); /reset starts a new session
        self.session_id = new_session_id()
        self.bad_input = False  # a turn was refused as undecodable text: the exit status says so
        self.images: list[dict[str, Any]] = []  # attached by /image, sent with the next message

    def command(self, text: str) -> bool:
        """Run a ``/command``; False means leave the chat."""
        name, _, rest = text.strip().partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name in ("/reset", "/clear"):
            self.conversation.reset()
            self.images.clear()
            self.session_id = new_session_id()
            _say("[conversation cleared]")
        elif name == "/image":
            self.attach(rest)
        elif name == "/think":
            if rest in ("on", "off"):
                self.conversation.enable_thinking = rest == "on"
            elif rest:
                _say(f"ninfer: error: /think takes on or off, got {rest!r}")
                return True
            _say(f"[thinking {'on' if self.conversation.enable_thinking else 'off'}]")
        elif name in ("/help", "/?"):
            _say(HELP)
        else:
            _say(
                f'ninfer: error: unknown command {name}; /help lists the commands (a """ block sends '
                "text that starts with /)"
            )
        return True

    def attach(self, reference: str) -> None:
        """``/image PATH``: decode the image now (a bad one is one line of error) and keep it for the next
        message; ``/image`` alone lists what is attached."""
        if not reference:
            sizes = ", ".join(f"{p['image'].width} x {p['image'].height}" for p in self.images)
            _say(f"[{len(self.images)} image(s) attached to the next message{': ' + sizes if sizes else ''}]")
            return
        try:
            part = image_part(reference)
        except ValueError as e:
            _say(f"ninfer: error: /image {one_line(e)}")
            return
        self.images.append(part)
        decoded = part["image"]
        _say(
            f"[image attached: {decoded.width} x {decoded.height}; it goes with your next message "
            f"({len(self.images)} attached)]"
        )

    def request(
        self, user_text: str, max_tokens: int | None, images: Sequence[dict[str, Any]] = ()
    ) -> GenerationRequest:
        from ninfer import GenerationRequest

        return GenerationRequest(
            messages=self.conversation.messages(user_text, images),
            chat_template_kwargs={"enable_thinking": self.conversation.enable_thinking},
            session_id=self.session_id,
            **{**self.sampling, "max_tokens": max_tokens},
        )

    def turn(self, user_text: str) -> None:
        """Send one user message, stream the reply, keep the turn if it completed. Raises EngineFailed
        when the Engine as a whole failed (the session cannot go on)."""
        from ninfer import EngineFailed, GenerationDelta, GenerationResult, RequestRejected

        max_tokens = self.sampling["max_tokens"]
        images, self.images = self.images, []  # attachments go with this turn, sent or dropped with it
        dropped = f"; its {len(images)} attached image(s) were dropped too" if images else ""
        try:
            handle = self.engine.submit(self.request(user_text, max_tokens, images))
        except RequestRejected as e:
            if e.kind != "context_too_long" or max_tokens is None:
                _say(f"ninfer: error: {e.message} (/reset clears the conversation{dropped})")
                return
            # the prompt fits but not with --max-tokens more: reply up to the context limit instead
            try:
                handle = self.engine.submit(self.request(user_text, None, images))
            except RequestRejected as again:
                _say(f"ninfer: error: {again.message} (/reset clears the conversation{dropped})")
                return
        printer = ReplyPrinter(sys.stdout, self.terminal_out)
        started = time.monotonic()
        reply: GenerationResult | None = None
        with handle:
            try:
                for event in handle:
                    if isinstance(event, GenerationDelta):
                        printer.delta(event)
                    elif isinstance(event, GenerationResult):
                        reply = event
            except KeyboardInterrupt:
                handle.cancel()  # stop at the worker's next boundary, then collect the terminal result
                reply = handle.result(raise_on_error=False)
            finally:
                printer.finish(reply)  # even if a second Ctrl-C ends the wait: never leave the terminal dim
        assert reply is not None
        if reply.finish_reason == "error":
            if isinstance(reply.error, EngineFailed):
                raise reply.error
            _say(f"ninfer: error: {reply.error}{dropped}")
            return
        if reply.finish_reason == "cancelled":
            _say(f"[cancelled; the turn was dropped{dropped}]")
            return
        self.conversation.record(user_text, reply, images)
        if reply.finish_reason == "length":
            _say(f"[reply cut at {reply.usage.completion_tokens} tokens: --max-tokens or the context limit]")
        if self.verbose:
            seconds = time.monotonic() - started
            u = reply.usage
            rate = u.completion_tokens / max(seconds, 1e-9)
            drafts = ""
            if u.drafted_tokens:
                drafts = f", {u.accepted_draft_tokens}/{u.drafted_tokens} drafts accepted"
            _say(
                f"[{reply.finish_reason}; {u.prompt_tokens} prompt ({u.reused_prefix_tokens} cached) + "
                f"{u.completion_tokens} generated tokens{drafts}, {rate:.1f} tok/s]"
            )

    def loop(self, reader: TurnReader) -> int:
        while True:
            try:
                user = reader.read()
            except KeyboardInterrupt:
                if not self.interactive:
                    raise
                _say("\n(Ctrl-D or /exit to quit)")  # like a shell: Ctrl-C drops the line being typed
                continue
            if user is None:
                if self.interactive:
                    print()  # leave the terminal on a fresh line after ^D
                return 1 if self.bad_input else 0
            problem = check_text(user.text, "the input line")
            if problem is not None:
                self.bad_input = True
                _say(f"ninfer: error: {problem}; the line was not sent")
                continue
            if not user.quoted and user.text.lstrip().startswith("/"):
                if not self.command(user.text):
                    return 0
                continue
            if user.text.strip():
                try:
                    self.turn(user.text)
                except KeyboardInterrupt:
                    # Ctrl-C while the prompt was prepared, or a second one while a cancelled reply wound
                    # down: the handle (if any) was closed, which cancels its request
                    _say("\n[cancelled; the turn was dropped]")


def run(args: argparse.Namespace) -> int:
    from ninfer import Engine, EngineFailed

    artifact, _ = split_artifact([args.artifact] if args.artifact else [], 0, "")
    try:
        config = interactive_engine_config(args)
        problem = speculative_problem(artifact, config.speculative)
        if problem is not None:
            return fail(problem)
        engine = Engine(artifact, config)
    except product_errors() as e:
        return fail(e)
    interactive = sys.stdin.isatty()
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:  # undecodable bytes become one refused line, not a crash of the session
        reconfigure(errors="surrogateescape")
    with engine:
        session = ChatSession(engine, args, interactive)
        # refuse bad sampling flags once, before the first turn, rather than on every turn
        problems = session.request("probe", session.sampling["max_tokens"]).problems()
        if problems:
            return fail("; ".join(problems))
        if interactive:
            _say(
                f"ninfer chat: {engine.package_name or artifact} (context {engine.max_context} tokens, "
                f"thinking {'on' if session.conversation.enable_thinking else 'off'}); /help for commands, "
                "Ctrl-D to quit"
            )
        try:
            return session.loop(TurnReader(sys.stdin, interactive))
        except EngineFailed as e:
            return fail(str(e))
