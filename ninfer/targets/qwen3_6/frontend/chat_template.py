"""Chat-template rendering that matches transformers' ``apply_chat_template(..., tokenize=False)``.

Same jinja2 sandbox and globals as transformers 5.x (``ImmutableSandboxedEnvironment`` with
``trim_blocks``, ``lstrip_blocks`` and ``loopcontrols``; ``raise_exception``, ``strftime_now``, a
``tojson`` filter that does not HTML-escape, a restricted ``dict`` and ``namespace``), and the same input
preparation: every value the template sees is rebuilt from plain JSON types, and reasoning given as
``thinking`` / ``reasoning`` is aliased to ``reasoning_content``.
One addition: an OpenAI-style tool call whose ``arguments`` is a JSON string is parsed to the object the
Qwen templates iterate over (transformers would fail on the string).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (its ``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes; chat templates expect plain json.dumps output
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore attributes (no route to interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no named self: jinja's trick so self= works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


# deepest nesting of lists/objects the template may see: far beyond any real message, tool schema or
# tool-call arguments, and small enough that rendering (``tojson``) and json.dumps never recurse too deep
MAX_TEMPLATE_DEPTH = 64


def _plain_scalar(value: Any) -> tuple[bool, Any]:
    """(True, copy) for JSON scalars and non-container objects; (False, None) for containers."""
    if value is None or type(value) in (str, int, float, bool):
        return True, value
    if isinstance(value, bool):
        return True, bool(value)
    if isinstance(value, str):
        return True, str.__str__(value)
    if isinstance(value, int):
        return True, int.__int__(value)
    if isinstance(value, float):
        return True, float.__float__(value)
    if isinstance(value, (Mapping, list, tuple)):
        return False, None
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy" and getattr(value, "ndim", 0) == 0:
        return _plain_scalar(item())  # a numpy scalar (an array becomes "<ndarray>" below)
    return True, f"<{type(value).__name__}>"


def _expand(value: Any) -> Any:
    """A dataclass or pydantic model as its field mapping; anything else unchanged."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)
    if callable(dump) and not isinstance(value, (Mapping, list, tuple)):
        return dump()
    return value


def plain_template_data(value: Any, max_depth: int = MAX_TEMPLATE_DEPTH) -> Any:
    """A fresh copy of ``value`` built from JSON types only; anything else becomes ``"<TypeName>"``.

    The template can then neither mutate the caller's messages nor reach methods of rich objects
    (decoded images, arrays) through the sandbox; templates only test media keys for presence.
    Built without recursion; nesting deeper than ``max_depth`` raises ChatTemplateError (never
    RecursionError), so a hostile input is refused like any other bad conversation.
    """
    value = _expand(value)
    done, scalar = _plain_scalar(value)
    if done:
        return scalar
    root: list[Any] = [None]
    # (source container, destination, key in destination, depth): containers still to copy
    stack: list[tuple[Any, Any, Any, int]] = [(value, root, 0, 1)]
    tuples: list[tuple[Any, Any, list[Any]]] = []  # copied as lists, made tuples once filled
    while stack:
        source, dest, key, depth = stack.pop()
        if depth > max_depth:
            raise ChatTemplateError(f"input nested deeper than {max_depth} levels")
        if isinstance(source, Mapping):
            mapping: dict[Any, Any] = {}
            for k, v in source.items():
                k, v = plain_template_data(k, 1), _expand(v)  # keys are scalars in JSON
                done, mapping[k] = _plain_scalar(v)
                if not done:
                    stack.append((v, mapping, k, depth + 1))
            dest[key] = mapping
            continue
        items: list[Any] = []
        for i, v in enumerate(source):
            v = _expand(v)
            done, scalar = _plain_scalar(v)
            items.append(scalar)
            if not done:
                stack.append((v, items, i, depth + 1))
        dest[key] = items
        if isinstance(source, tuple):
            tuples.append((dest, key, items))
    for dest, key, items in reversed(tuples):  # inner tuples first, so outer ones hold them
        dest[key] = tuple(items)
    return root[0]


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _parse_string_arguments(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    fixed = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        target = fn if isinstance(fn, dict) else call
        args = target.get("arguments") if isinstance(target, dict) else None
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
            except (json.JSONDecodeError, RecursionError):  # a hostile nesting depth stays a string
                parsed = None
            if isinstance(parsed, dict):
                parsed = plain_template_data(parsed)  # refuses nesting beyond MAX_TEMPLATE_DEPTH
            if isinstance(parsed, dict):
                target = {**target, "arguments": parsed}
                call = {**call, "function": target} if isinstance(fn, dict) else target
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain, owned copies of the messages in the shape the Qwen templates read."""
    out = []
    for i, message in enumerate(plain_template_data(list(messages))):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"message {i} is not a mapping: {message!r}")
        out.append(_parse_string_arguments(_alias_reasoning(message)))
    return out


class ChatTemplate:
    """A compiled chat template; ``render`` is thread-safe (the compiled template holds no state)."""

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._template = compile_chat_template(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render like transformers: ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and
        the extra kwargs are the only variables. Raises ChatTemplateError with the template's message."""
        for tool in tools or ():
            if not isinstance(tool, Mapping):
                raise ChatTemplateError(f"tools must be JSON-schema mappings, got {type(tool).__name__}")
        try:
            return self._template.render(
                messages=prepare_messages(messages),
                tools=plain_template_data(list(tools)) if tools is not None else None,
                documents=plain_template_data(list(documents)) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **plain_template_data(kwargs),
            )
        except (jinja2.exceptions.TemplateError, TypeError) as e:
            # TypeError: a filter got the wrong kind of value (e.g. ``|items`` on a string)
            raise ChatTemplateError(f"chat template: {e}") from e
