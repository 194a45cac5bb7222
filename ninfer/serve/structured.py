"""Structured-output request fields -> one `OutputConstraint` (docs/structured-outputs.md).

Chat and completions accept OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's and
SGLang's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and the newer
``structured_outputs`` object; chat also ``tool_choice`` ``"required"`` or a named function. Each is
turned into a constraint or refused with a 400 naming the field: never accepted and ignored. The
constraint's ``source`` is the field's name, so an Engine rejection of a bad schema, regex or grammar
names it too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ninfer.serve.convert import bad_request
from ninfer.serve.protocol import NamedToolChoice, StructuredOutputFields, ToolDef
from ninfer.types import OutputConstraint

BACKENDS = ("auto", "llguidance", "guidance")
CONSTRAINT_PARAMS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "tool_choice",
)


def _schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{param}: the JSON schema is not valid JSON ({exc})", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param}: a JSON schema must be a JSON object", param)
    return value


def output_constraint(
    body: StructuredOutputFields,
    *,
    tool_choice: Any = None,
    tools: Sequence[ToolDef] | None = None,
    parallel_tool_calls: bool | None = None,
) -> OutputConstraint | None:
    """The request's one constraint (None: unconstrained); 400 for a refused or conflicting field."""
    found: list[OutputConstraint] = []
    if body.guided_whitespace_pattern is not None:
        raise bad_request(
            "guided_whitespace_pattern is not supported: JSON is generated without free whitespace",
            "guided_whitespace_pattern",
        )
    backend = body.guided_decoding_backend
    if backend is not None and backend.split(":")[0] not in BACKENDS:
        raise bad_request(
            f"guided_decoding_backend {backend!r} is not available; NInfer constrains with llguidance "
            "(send 'llguidance' or 'auto', or leave it out)",
            "guided_decoding_backend",
        )
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(OutputConstraint.json_object(source="response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, str)):
            raise bad_request(
                'response_format json_schema needs {"name": ..., "schema": {...}, "strict": ...}',
                "response_format",
            )
        strict = bool(spec.get("strict"))
        schema = _schema(spec["schema"], "response_format")
        found.append(OutputConstraint.json_schema(schema, strict=strict, source="response_format"))
    if body.guided_json is not None:
        found.append(
            OutputConstraint.json_schema(_schema(body.guided_json, "guided_json"), source="guided_json")
        )
    if body.guided_regex is not None:
        found.append(OutputConstraint.regex(body.guided_regex, source="guided_regex"))
    if body.guided_choice is not None:
        found.append(OutputConstraint.choice(body.guided_choice, source="guided_choice"))
    if body.guided_grammar is not None:
        found.append(OutputConstraint.cfg(body.guided_grammar, source="guided_grammar"))
    so = body.structured_outputs
    if so is not None:
        if so.structural_tag is not None or so.whitespace_pattern is not None:
            which = "structural_tag" if so.structural_tag is not None else "whitespace_pattern"
            raise bad_request(f"structured_outputs.{which} is not supported", "structured_outputs")
        param = "structured_outputs"
        given = [
            OutputConstraint.json_schema(_schema(so.json_value, param), source=param)
            if so.json_value is not None
            else None,
            OutputConstraint.regex(so.regex, source=param) if so.regex is not None else None,
            OutputConstraint.choice(so.choice, source=param) if so.choice is not None else None,
            OutputConstraint.cfg(so.grammar, source=param) if so.grammar is not None else None,
            OutputConstraint.json_object(source=param) if so.json_object else None,
        ]
        given = [c for c in given if c is not None]
        if len(given) > 1:
            raise bad_request(
                "structured_outputs: give one of json, regex, choice, grammar, json_object", param
            )
        found.extend(given)
    if isinstance(tool_choice, NamedToolChoice) or tool_choice == "required":
        if not tools:
            raise bad_request(f"tool_choice {_choice_text(tool_choice)} needs tools", "tool_choice")
        if isinstance(tool_choice, NamedToolChoice):
            name = tool_choice.function.name
            names = [t.function.name for t in tools]
            if name not in names:
                raise bad_request(
                    f"tool_choice names {name!r}, which is not one of the tools {names}", "tool_choice"
                )
            found.append(OutputConstraint.tool_call(name, source="tool_choice"))
        else:
            found.append(
                OutputConstraint.tool_call(parallel=parallel_tool_calls is not False, source="tool_choice")
            )
    if len(found) > 1:
        names = ", ".join(c.field_name for c in found)
        raise bad_request(f"give one structured-output constraint, got {names}", found[1].field_name)
    return found[0] if found else None


def _choice_text(choice: Any) -> str:
    return f"function {choice.function.name!r}" if isinstance(choice, NamedToolChoice) else repr(choice)
