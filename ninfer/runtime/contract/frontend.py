"""The package-neutral Frontend contract the Engine codes against.

A family Frontend (``ninfer/targets/qwen3_6/frontend``) owns input and output semantics: tokenizer, chat
template, vision preprocessing, stop handling, thinking/content channels, detokenization and tool calls.
The Engine only needs the shapes below; it imports no target. ``OutputOptions`` is a plain value the
Engine builds from the public request; a Frontend reads it by attribute name.

Rules a Frontend must keep:
- ``prepare_*`` are pure and thread-safe (they run on the caller's thread, before submit).
- An ``OutputSession`` belongs to one request and is used only by the Engine worker.
- ``preview`` is pure: it computes the effect of ``token_ids`` appended to what was committed, without
  changing the session. ``commit(preview)`` applies exactly that preview; it is called only after the
  Program committed the same tokens, and before the session's next ``preview``, but possibly while the
  next model step already runs (the Engine overlaps it). A preview not committed is simply dropped.
- Only what ``preview`` decides (``accepted``, ``stop``, ``force_tokens``) is needed before the Program
  commit; a session may defer its text work (the delta) to ``commit``, which may then raise for a
  parser bug like ``preview`` may (the Engine ends only that request either way).
- ``OutputPreview.accepted`` counts model tokens the output consumes (a stopping token counts), so it is
  ``>= 1`` for a non-empty span. ``accepted < len(token_ids)`` only together with ``stop=True``.
- ``force_tokens`` non-empty (only when not stopping) asks the Engine to run those tokens as forced
  control next (e.g. closing a thinking block at the thinking budget). Forced tokens count against
  max_tokens: when fewer remain, the Engine forces only that prefix (the request then ends by length),
  so the session's next ``preview`` must accept any non-empty prefix of what it asked to force.
- ``finish()`` flushes whatever the session still holds back (at length, cancellation or error).
- A session made with ``OutputOptions.constraint`` has a ``constraint`` attribute
  (``ninfer.runtime.contract.constraint.SessionConstraintLike``): the Engine hands it to the Program with
  each unit and advances it by the committed tokens right after the Program commit (before the
  possibly deferred ``commit``); a session without one has ``constraint`` absent or None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ninfer.runtime.contract.constraint import OutputConstraint


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """Per-request output semantics, built by the Engine from the public request.

    ``stop_token_ids`` stop in addition to the eos ids (which stop unless ``ignore_eos``).
    ``thinking_budget`` caps the reasoning tokens; at the cap the session asks for the family's
    canonical end-of-thinking suffix as forced control.
    """

    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    # None: the Frontend decides from the prepared prompt (its channel and tool semantics); the Engine
    # never decides them. True/False override for callers that know better (tests, raw tools).
    parse_reasoning: bool | None = None
    parse_tool_calls: bool | None = None
    thinking_budget: int | None = None
    # structured outputs: the Frontend compiles it in ``new_output_session`` (raising
    # ``ConstraintInvalid``) and the session exposes the matcher as ``constraint``
    # (``SessionConstraintLike``); a Frontend without structured outputs leaves it unset and the Engine
    # refuses the request
    constraint: OutputConstraint | None = None


@runtime_checkable
class PreparedPromptLike(Protocol):
    """An owning prepared prompt: token ids plus content identity (tokens and media).

    Optional (read with ``getattr``; a prompt without them offers no reuse points):

    - ``boundaries: tuple[int, ...]`` — ascending prefix lengths in ``1..len(token_ids)-1``, never inside
      a media item's tokens, that the Frontend expects a later prompt of the same conversation to
      reproduce token for token (chat: the end of the system/tools preamble and the start of every
      assistant message's body, the generation prompt's included; raw text/token prompts: none). They
      are hints: checkpoints are found by content, so a wrong boundary costs hits, never correctness.
    - ``media_spans() -> tuple[tuple[int, int, str], ...]`` — (token offset, token count, media digest)
      of each media item, in prompt order.
    - ``prefix_digest(n: int, salt: str = "") -> str`` — the identity of the first ``n`` tokens and the
      media wholly inside them, `ninfer.runtime.contract.identity.prefix_digest` (ValueError for an
      ``n`` that cuts a media item). A Program digests prompt + output frontiers with that same function.
    """

    @property
    def token_ids(self) -> tuple[int, ...]: ...

    @property
    def digest(self) -> str: ...

    @property
    def opens_thinking(self) -> bool: ...


@runtime_checkable
class ToolCallDeltaLike(Protocol):
    """Incremental tool call: ``index`` identifies the call; later deltas extend ``arguments``."""

    @property
    def index(self) -> int: ...

    @property
    def id(self) -> str | None: ...

    @property
    def name(self) -> str | None: ...

    @property
    def arguments(self) -> str: ...


@runtime_checkable
class OutputDeltaLike(Protocol):
    """The user-visible effect of committed tokens."""

    @property
    def text(self) -> str: ...

    @property
    def reasoning_text(self) -> str: ...

    @property
    def tool_calls(self) -> Sequence[ToolCallDeltaLike]: ...

    @property
    def token_ids(self) -> Sequence[int]: ...


@runtime_checkable
class OutputPreviewLike(Protocol):
    """A pure preview of appending a span of model tokens to an OutputSession.

    Optional ``boundaries: tuple[int, ...]`` (read with ``getattr``, default ``()``): ascending positions
    in ``1..accepted``, relative to the span, where the prompt plus the output up to there is what the
    history renderer reproduces token for token once this turn is sent back as an assistant message
    (e.g. the end of the turn when the template keeps the turn as generated). The Engine checks the
    range and carries them in ``RowDecision.boundaries``; the Program makes them absolute.

    Optional ``control_horizon: int | None`` (read with ``getattr``, default None): after this span,
    the fewest tokens the next one may hold before the session may require forced control (a thinking
    budget); the Engine caps the row's next decode budget there, so a unit that produces several tokens
    (a speculative round) stops where one-token decoding would have been forced.
    """

    @property
    def accepted(self) -> int: ...

    @property
    def stop(self) -> bool: ...

    @property
    def delta(self) -> OutputDeltaLike: ...

    @property
    def force_tokens(self) -> tuple[int, ...]: ...


@runtime_checkable
class OutputSessionLike(Protocol):
    def preview(self, token_ids: Sequence[int]) -> OutputPreviewLike: ...

    def commit(self, preview: OutputPreviewLike) -> OutputDeltaLike: ...

    def finish(self) -> OutputDeltaLike: ...


@runtime_checkable
class FrontendLike(Protocol):
    # the model's sampling defaults from its generation_config.json (``do_sample``, ``temperature``,
    # ``top_p``, ...; absent keys are absent); the Engine fills the request fields left ``None`` from it
    generation_defaults: Mapping[str, Any]

    def prepare_text(self, text: str) -> PreparedPromptLike: ...

    def prepare_tokens(self, token_ids: Sequence[int]) -> PreparedPromptLike: ...

    def prepare_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> PreparedPromptLike: ...

    def new_output_session(self, prompt: PreparedPromptLike, options: OutputOptions) -> OutputSessionLike: ...
