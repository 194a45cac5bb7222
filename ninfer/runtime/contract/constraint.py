"""Structured outputs: the public `OutputConstraint` value and the row-constraint contract.

Who does what (docs/structured-outputs.md):

- a Gateway turns its protocol fields (``response_format``, ``guided_json``, ``tool_choice``, ...) into one
  `OutputConstraint` on the `GenerationRequest`;
- the Frontend compiles it for its tokenizer (``new_output_session``; a bad schema, regex or grammar
  raises `ConstraintInvalid`, which the Engine turns into an ``invalid_request`` rejection naming the
  field) and keeps the grammar matcher in the request's OutputSession (``session.constraint``, a
  `SessionConstraintLike`);
- the Engine hands each constrained row's constraint to the Program with the unit (a `RowConstraint`)
  and, after the Program committed a unit, advances the matcher by the committed tokens (only then);
- the Program asks the row for its allowed-token bitmasks right before it samples, and samples from the
  masked logits.

A bitmask is a numpy ``int32`` array of ``ceil(vocab / 32)`` words: token ``t`` is allowed when bit
``t % 32`` of word ``t // 32`` is set (the layout llguidance and xgrammar use). Tokens past the words
(model vocabulary padding) are never allowed.

This module imports neither torch nor a grammar engine: the Engine stays model-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "ConstraintInvalid",
    "ConstraintKind",
    "OutputConstraint",
    "RowConstraint",
    "SessionConstraintLike",
]

ConstraintKind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "tool_call"]
CONSTRAINT_KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "choice", "grammar", "tool_call")


class ConstraintInvalid(ValueError):
    """The Frontend cannot compile a constraint (a bad JSON schema, regex or grammar, an unknown tool)."""


@dataclass(frozen=True)
class OutputConstraint:
    """What the output after the reasoning must match. Build it with the class methods.

    - ``json_object``: any JSON object; ``json_schema``: JSON valid under ``schema`` (``strict``: refuse
      schema keywords the grammar engine cannot enforce instead of ignoring them);
    - ``regex``: the whole output matches ``pattern`` (Rust ``regex`` syntax, as vLLM's backends);
    - ``choice``: the output is exactly one of ``choices``;
    - ``grammar``: a context-free grammar, Lark syntax or GBNF (``::=`` rules, llama.cpp / vLLM EBNF);
    - ``tool_call``: the output is tool calls in the family's format, with arguments valid under the
      called function's parameters: ``tool_name`` one call of that function, ``None`` one or more calls
      (one with ``parallel=False``) of the request's tools.

    ``source`` names the request field the constraint came from (``response_format``, ``guided_json``,
    ``tool_choice``, ...): rejections name it. It never changes what is generated.
    """

    kind: ConstraintKind
    schema: Mapping[str, Any] | None = None
    strict: bool = False
    pattern: str | None = None
    choices: tuple[str, ...] = ()
    grammar: str | None = None
    tool_name: str | None = None
    parallel: bool = True
    source: str | None = field(default=None, compare=False)

    # ---- constructors ----
    @classmethod
    def json_object(cls, *, source: str | None = None) -> OutputConstraint:
        return cls("json_object", source=source)

    @classmethod
    def json_schema(
        cls, schema: Mapping[str, Any], *, strict: bool = False, source: str | None = None
    ) -> OutputConstraint:
        return cls("json_schema", schema=schema, strict=strict, source=source)

    @classmethod
    def regex(cls, pattern: str, *, source: str | None = None) -> OutputConstraint:
        return cls("regex", pattern=pattern, source=source)

    @classmethod
    def choice(cls, choices: Sequence[str], *, source: str | None = None) -> OutputConstraint:
        return cls("choice", choices=tuple(choices), source=source)

    @classmethod
    def cfg(cls, grammar: str, *, source: str | None = None) -> OutputConstraint:
        return cls("grammar", grammar=grammar, source=source)

    @classmethod
    def tool_call(
        cls, name: str | None = None, *, parallel: bool = True, source: str | None = None
    ) -> OutputConstraint:
        return cls("tool_call", tool_name=name, parallel=parallel, source=source)

    # ---- checks and identity ----
    @property
    def field_name(self) -> str:
        """How rejections name the constraint: the request field it came from."""
        return self.source or "constraint"

    def problems(self) -> list[str]:
        """Shape errors (the Frontend's compile finds the rest), each starting with ``field_name``."""
        name, out = self.field_name, []
        if self.kind not in CONSTRAINT_KINDS:
            kinds = ", ".join(CONSTRAINT_KINDS)
            return [f"{name}: unknown constraint kind {self.kind!r}; use one of {kinds}"]
        if self.kind == "json_schema":
            if not isinstance(self.schema, Mapping):
                out.append(f"{name}: a JSON schema must be a JSON object")
            else:
                try:
                    json.dumps(self.schema)
                except (TypeError, ValueError) as exc:
                    out.append(f"{name}: the JSON schema is not JSON ({exc})")
        if self.kind == "regex" and (not isinstance(self.pattern, str) or not self.pattern):
            out.append(f"{name}: the regex must be a non-empty string")
        if self.kind == "choice" and (
            not self.choices or any(not isinstance(c, str) or not c for c in self.choices)
        ):
            out.append(f"{name}: choice needs at least one non-empty string")
        if self.kind == "grammar" and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            out.append(f"{name}: the grammar must be a non-empty string")
        if self.kind == "tool_call" and self.tool_name is not None and not self.tool_name:
            out.append(f"{name}: the function name is empty")
        return out

    def key(self) -> str:
        """A canonical text of what is constrained (the Frontend's compile cache digests it)."""
        return json.dumps(
            [self.kind, self.schema, self.strict, self.pattern, list(self.choices), self.grammar,
             self.tool_name, self.parallel],
            sort_keys=True, separators=(",", ":"), ensure_ascii=False,
        )  # fmt: skip


@runtime_checkable
class RowConstraint(Protocol):
    """One constrained row of an execution unit, as the Program sees it (``Program.prefill(...,
    constraint=)``, ``Program.decode(..., constraints=)``).

    ``masks(drafts)`` returns ``len(drafts) + 1`` entries: entry 0 is the bitmask of the token after the
    row's committed tokens, entry ``i`` the one after the committed tokens and ``drafts[:i]`` (a
    speculative unit's drafts); ``None`` means no constraint at that position (the output is still in
    its reasoning). An entry after a draft the grammar refuses is unspecified (that position is never
    reached: the masked verify rejects the draft before it). It never raises, reads only committed
    Frontend state, and the Program calls it at most once per row per unit, on the worker thread, and
    never keeps the object.
    """

    def masks(self, drafts: Sequence[int]) -> Sequence[Any | None]: ...


@runtime_checkable
class SessionConstraintLike(Protocol):
    """The matcher an OutputSession keeps for its constraint (``OutputSession.constraint``).

    ``masks`` as `RowConstraint` (it may raise; the Engine then ends only that request). ``advance``
    takes the tokens the Program committed for the row (``forced`` for forced control), in order, once
    each; nothing else moves the matcher.
    """

    def masks(self, drafts: Sequence[int]) -> Sequence[Any | None]: ...

    def advance(self, token_ids: Sequence[int], *, forced: bool = False) -> None: ...
