"""Owning value types of the Qwen3.6 Frontend: resources in, prepared prompts and output deltas out.

All are frozen dataclasses so a value handed to the Engine or a gateway can never change under it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the one OutputOptions value (the Engine builds it; the output session reads it)
from ninfer.runtime.contract.frontend import OutputOptions as OutputOptions


@dataclass(frozen=True)
class FrontendResources:
    """The frontend resources a package artifact carries (bytes and parsed JSON, no file paths)."""

    tokenizer_json: bytes
    chat_template: str
    generation_config: dict[str, Any]
    preprocessor_config: dict[str, Any] | None = None


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt ready for the Engine.

    ``digest`` is the content identity prefix reuse keys on (sha256 over the ids and any media identity).
    ``opens_thinking`` is True when the prompt ends inside an open ``<think>`` block, so the first output
    tokens belong to the reasoning channel. ``tools`` are the tool definitions the prompt was rendered with
    (the output session types tool-call arguments by their JSON schemas).
    """

    token_ids: tuple[int, ...]
    digest: str
    opens_thinking: bool = False
    tools: tuple[dict[str, Any], ...] | None = None
    chat: bool = False  # rendered from messages by the chat template (output has a reasoning channel)


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of a streamed tool call; all ``arguments`` pieces of one ``index`` concatenate to JSON."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class ToolCall:
    """A complete, committed tool call (``arguments`` is a JSON object string)."""

    index: int
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI chat-completions shape, which the chat template accepts back as history."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class OutputDelta:
    """The user-visible effect of one committed span (or of the final flush)."""

    text: str = ""
    reasoning_text: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class OutputPreview:
    """The effect appending a span would have, computed without changing the session.

    ``accepted`` counts the tokens of the span that are kept: a stopping token is accepted (it was
    generated) but produces no text; tokens after a stop are not accepted. ``force_tokens`` is non-empty
    when the session requires a forced-control suffix next (thinking budget reached).
    """

    accepted: int
    stop: bool
    delta: OutputDelta
    force_tokens: tuple[int, ...] = field(default=())
