"""Owning value types of the Qwen3.6 Frontend: resources in, prepared prompts and output deltas out.

All are frozen dataclasses so a value handed to the Engine or a gateway can never change under it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# the one OutputOptions value (the Engine builds it; the output session reads it)
from ninfer.runtime.contract.frontend import OutputOptions as OutputOptions
from ninfer.runtime.contract.identity import prefix_digest


@dataclass(frozen=True)
class FrontendResources:
    """The frontend resources a package artifact carries (bytes and parsed JSON, no file paths)."""

    tokenizer_json: bytes
    chat_template: str
    generation_config: dict[str, Any]
    preprocessor_config: dict[str, Any] | None = None


@dataclass(frozen=True, eq=False)
class PreparedImage:
    """One image of a prompt, preprocessed for the vision tower.

    ``pixel_values`` [t*h*w, 3*temporal*patch*patch] float32, read-only, in the processor's row order
    (2 x 2 merge blocks, then rows/columns inside a block); ``grid_thw`` (t, h, w) in patches;
    ``token_offset`` is the index in ``PreparedPrompt.token_ids`` of the image's first ``<|image_pad|>``
    and ``num_tokens`` (t*h*w / merge^2) how many consecutive pads it fills: the tower's output rows for
    this image go to ``token_ids[token_offset : token_offset + num_tokens]``, in order. ``digest`` is the
    identity of (decoded pixels, preprocessing parameters). Equality compares everything but the array
    (which the digest stands for).
    """

    digest: str
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    token_offset: int
    num_tokens: int

    def _key(self) -> tuple[object, ...]:
        return (self.digest, self.grid_thw, self.token_offset, self.num_tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PreparedImage) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"PreparedImage(grid_thw={self.grid_thw}, token_offset={self.token_offset}, "
            f"num_tokens={self.num_tokens}, digest={self.digest[:12]})"
        )


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt ready for the Engine.

    ``digest`` is the content identity prefix reuse keys on (sha256 over the ids and any media identity).
    ``opens_thinking`` is True when the prompt ends inside an open ``<think>`` block, so the first output
    tokens belong to the reasoning channel. ``tools`` are the tool definitions the prompt was rendered with
    (the output session types tool-call arguments by their JSON schemas).

    Vision: ``images`` in prompt order (their pads are in ``token_ids``); ``mrope_positions`` the
    [3, len(token_ids)] int64 T/H/W positions (read-only), None for a prompt without images, whose
    positions are 0..L-1 on every axis; ``mrope_delta``: a token at cache position ``n`` past the prompt
    (decode) has position ``n + mrope_delta`` on all three axes (0 without images). The positions are a
    function of the ids and the grids, so equality does not compare the array.

    Reuse (docs/resources-and-context-cache.md, "Reuse boundaries"): ``boundaries`` are ascending prefix
    lengths, each in ``1..len(token_ids)-1`` and never inside an image's pads, that a later rendering of
    the same conversation with more turns appended reproduces token for token (unless the template drops
    reasoning before them): the end of the system/tools preamble and the start of every assistant
    message's body, the generation prompt's included. A checkpoint there is found again by
    ``prefix_digest(b)``. ``template_kwargs`` are the chat-template variables the prompt was rendered
    with (``add_generation_prompt``, ``enable_thinking``, ``preserve_thinking``, ...): the output session
    renders its turn as history with the same ones. Text and token prompts have neither.
    """

    token_ids: tuple[int, ...]
    digest: str
    opens_thinking: bool = False
    tools: tuple[dict[str, Any], ...] | None = None
    chat: bool = False  # rendered from messages by the chat template (output has a reasoning channel)
    images: tuple[PreparedImage, ...] = ()
    mrope_positions: np.ndarray | None = field(default=None, compare=False, repr=False)
    mrope_delta: int = 0
    boundaries: tuple[int, ...] = ()
    template_kwargs: dict[str, Any] | None = None

    @property
    def image_tokens(self) -> int:
        """Prompt tokens that are image pads (they count in ``prompt_tokens``)."""
        return sum(image.num_tokens for image in self.images)

    def media_spans(self) -> tuple[tuple[int, int, str], ...]:
        """(token offset, token count, media digest) of each image, in prompt order."""
        return tuple((image.token_offset, image.num_tokens, image.digest) for image in self.images)

    def prefix_digest(self, n: int, salt: str = "") -> str:
        """Content identity of the first ``n`` tokens: their ids and the images wholly inside them
        (`ninfer.runtime.contract.identity.prefix_digest`; equal for two prompts whose first ``n`` tokens
        and images are equal). Raises ValueError for ``n`` outside ``0..len(token_ids)`` or inside an
        image's pads (a prefix holding part of an image has no identity a checkpoint could match)."""
        if not 0 <= n <= len(self.token_ids):
            raise ValueError(f"prefix length {n} outside 0..{len(self.token_ids)}")
        media = []
        for offset, count, digest in self.media_spans():
            if offset < n < offset + count:
                raise ValueError(f"prefix length {n} cuts the image pads at {offset}..{offset + count}")
            if offset + count <= n:
                media.append((offset, digest))
        return prefix_digest(self.token_ids[:n], media, salt)


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
    when the session requires a forced-control suffix next (thinking budget reached). ``boundaries``
    (positions ``1..accepted`` relative to the span) are where the output so far, after the prompt, is
    reproduced token for token by the history renderer once the turn is sent back as an assistant
    message: the end of the turn (its ``<|im_end|>``) when the template keeps the turn as generated.
    ``control_horizon``: after this span, the fewest tokens a later span may hold before the thinking
    budget may ask for forced control (None: no budget), so a speculative round never overruns it.
    """

    accepted: int
    stop: bool
    delta: OutputDelta
    force_tokens: tuple[int, ...] = field(default=())
    boundaries: tuple[int, ...] = field(default=())
    control_horizon: int | None = None
