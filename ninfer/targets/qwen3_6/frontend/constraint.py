"""Structured outputs for the Qwen3.6 family: `OutputConstraint` -> an llguidance matcher per request.

`ConstraintCompiler` (one per Frontend) turns a constraint into an llguidance grammar for the Frontend's
tokenizer, validates it once (a bad schema, regex or grammar raises `ConstraintInvalid` naming the
request field) and keeps a pristine matcher per grammar digest, so a request pays a copy (microseconds),
not a compile. The llguidance tokenizer is built on the first constrained request (about 1.8 s for the
248k-token Qwen3.6 vocabulary, 40 ms for the demo's 8k), never for unconstrained ones.

`GrammarConstraint` is the matcher inside one request's OutputSession (``session.constraint``):

- while the output is in its reasoning (the prompt opens ``<think>``), nothing is masked; the constraint
  applies from the token after ``</think>`` (sampled, or forced by the thinking budget);
- ``masks(drafts)`` gives the allowed-token bitmask of the next position (and, for a speculative
  unit, of each position after a draft prefix, on a copy of the matcher): the grammar's tokens, plus the
  request's stop tokens exactly when the grammar is complete (accepting); the committed matcher does not
  move;
- ``advance(tokens)`` moves the matcher by the tokens the Program committed, and only then. Forced
  control (the thinking-budget close ``\\n</think>\\n\\n``) never reaches the matcher: its tail after
  ``</think>`` is the template's separator, not output the grammar describes.

Tool calls (``tool_call``) are constrained in the Qwen3-Coder XML format that `tool_calls.ToolCallParser`
parses: ``<tool_call>\\n<function=NAME>\\n`` then each parameter as
``<parameter=ARG>\\nVALUE\\n</parameter>\\n``
(required ones always, optional ones may be left out, in the schema's order), ``</function>\\n</tool_call>``.
A string value is any text without ``</parameter>`` (within its ``minLength``/``maxLength``; an enum:
one of its values); any other type is
JSON under the parameter's schema, which the parser reads back typed.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ninfer.runtime.contract.constraint import ConstraintInvalid, OutputConstraint
from ninfer.targets.qwen3_6.frontend.tool_calls import _STRING_TYPES, _schema_type, tool_schemas

# JSON output format: no free whitespace (a model cannot wander off into blank lines), json.dumps'
# separators; a schema's own "x-guidance" options may change it
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_ENTRIES = 256

# a string parameter value with its closing tag: any text up to the first "</parameter>", which must be
# followed by the newline the template writes
_STRING_VALUE = r"/(?s:.*)\n<\/parameter>\n/ & ~/(?s:.*<\/parameter>.*<\/parameter>.*)/"


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ConstraintInvalid(
            "structured outputs need the llguidance package (pip install llguidance)"
        ) from exc
    return llguidance


class ConstraintCompiler:
    """Compiles constraints for one tokenizer (thread-safe: sessions are made on callers' threads)."""

    def __init__(self, tokenizer_json: bytes | str, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self._eos = [int(i) for i in eos_token_ids]
        self._lock = threading.Lock()
        self._tok: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.compiled = 0  # grammars compiled (cache misses); tests read it

    def tokenizer(self) -> Any:
        """The llguidance tokenizer (built once, on first use)."""
        with self._lock:
            if self._tok is None:
                llg = _llguidance()
                text = self._tokenizer_json
                text = text.decode("utf-8") if isinstance(text, bytes) else text
                self._tok = llg.LLTokenizer(text, eos_token=self._eos)
            return self._tok

    @property
    def mask_words(self) -> int:
        return (self.tokenizer().vocab_size + 31) // 32

    def matcher(self, constraint: OutputConstraint, tools: Sequence[Mapping[str, Any]] | None) -> Any:
        """A fresh matcher at the start of ``constraint``'s grammar. Raises `ConstraintInvalid`."""
        problems = constraint.problems()
        if problems:
            raise ConstraintInvalid("; ".join(problems))
        grammar = self._grammar(constraint, tools)
        key = hashlib.sha256(grammar.encode()).hexdigest()
        tok = self.tokenizer()
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
                return pristine.deep_copy()
        llg = _llguidance()
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if failed or (constraint.strict and messages):
            raise ConstraintInvalid(f"{constraint.field_name}: {_first_line(messages)}")
        pristine = llg.LLMatcher(tok, grammar, log_level=0)
        if pristine.is_error():
            raise ConstraintInvalid(f"{constraint.field_name}: {_first_line([pristine.get_error()])}")
        with self._lock:
            self.compiled += 1
            self._cache[key] = pristine
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return pristine.deep_copy()

    def _grammar(self, c: OutputConstraint, tools: Sequence[Mapping[str, Any]] | None) -> str:
        llg = _llguidance()
        name = c.field_name
        try:
            if c.kind == "json_object":
                return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if c.kind == "json_schema":
                assert c.schema is not None
                return llg.LLMatcher.grammar_from_json_schema(
                    dict(c.schema), defaults=JSON_OPTIONS, overrides={"lenient": not c.strict}
                )
            if c.kind == "regex":
                assert c.pattern is not None
                return llg.LLMatcher.grammar_from_regex(c.pattern)
            if c.kind == "choice":
                alternatives = " | ".join(json.dumps(x) for x in c.choices)
                return llg.LLMatcher.grammar_from_lark(f"start: {alternatives}")
            if c.kind == "grammar":
                assert c.grammar is not None
                return llg.grammar_from("grammar", c.grammar)  # Lark, or GBNF converted to Lark
            return llg.LLMatcher.grammar_from_lark(tool_call_lark(tools, c.tool_name, c.parallel))
        except ConstraintInvalid as exc:
            raise ConstraintInvalid(f"{name}: {exc}") from exc
        except (ValueError, TypeError, KeyError) as exc:
            raise ConstraintInvalid(f"{name}: {exc}") from exc


def _first_line(messages: Iterable[str]) -> str:
    text = next((m for m in messages if m), "the grammar engine refused it")
    return text.strip().splitlines()[0][:500]


def tool_call_lark(tools: Sequence[Mapping[str, Any]] | None, name: str | None, parallel: bool) -> str:
    """A Lark grammar of Qwen3-Coder XML tool calls of ``tools`` (``name``: exactly one call of it; else
    one or more calls, one when not ``parallel``)."""
    schemas = _parameter_schemas(tools)
    if name is not None:
        if name not in schemas:
            raise ConstraintInvalid(f"function {name!r} is not one of the request's tools {sorted(schemas)}")
        schemas = {name: schemas[name]}
    if not schemas:
        raise ConstraintInvalid("a tool call needs at least one tool with a function name")
    rules = []
    functions = []
    for i, (fn, (props, required)) in enumerate(schemas.items()):
        params = []
        for j, (arg, schema) in enumerate(props.items()):
            rule = f"p{i}_{j}"
            head = json.dumps(f"<parameter={arg}>\n")
            value = _value(schema)
            if value.startswith("/"):  # a string's own terminal
                rules.append(f"STR_{i}_{j}: {value}")
                value = f"STR_{i}_{j}"
            rules.append(f"{rule}: {head} {value}")
            params.append(rule if arg in required else f"{rule}?")
        body = " ".join([json.dumps(f"<function={fn}>\n"), *params, json.dumps("</function>")])
        rules.append(f"f{i}: {body}")
        functions.append(f"f{i}")
    call = 'call: <tool_call> "\\n" (' + " | ".join(functions) + ') "\\n" </tool_call>'
    start = 'start: call ("\\n" call)*' if parallel and name is None else "start: call"
    return "\n".join([start, call, *rules])


def _parameter_schemas(
    tools: Sequence[Mapping[str, Any]] | None,
) -> dict[str, tuple[dict[str, Any], frozenset[str]]]:
    """Function name -> (its parameters' properties, the required names)."""
    out: dict[str, tuple[dict[str, Any], frozenset[str]]] = {}
    props = tool_schemas(tools)
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or fn.get("name") not in props:
            continue
        params = fn.get("parameters") or {}
        required = params.get("required") if isinstance(params, Mapping) else None
        names = frozenset(r for r in required or () if isinstance(r, str))
        out[fn["name"]] = (props[fn["name"]], names)
    return out


def _value(schema: Any) -> str:
    """The grammar of one parameter's value and its closing tag (how `convert_param_value` reads it)."""
    kind = _schema_type(schema)
    if kind in _STRING_TYPES:
        values = schema.get("enum") if isinstance(schema, Mapping) else None
        if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
            return "(" + " | ".join(json.dumps(v) for v in values) + ") " + json.dumps("\n</parameter>\n")
        low, high = _string_length(schema)
        return (
            _STRING_VALUE.replace("(?s:.*)", f"(?s:.{{{low},{high}}})", 1)
            if high is not None
            else _STRING_VALUE
        )
    sub = dict(schema) if isinstance(schema, Mapping) else {}
    sub.setdefault("x-guidance", JSON_OPTIONS)  # the JSON output format of every other constraint
    return f"%json {json.dumps(sub)} " + json.dumps("\n</parameter>\n")


def _string_length(schema: Any) -> tuple[int, int | None]:
    """A string parameter's (minLength, maxLength) when it bounds the length (maxLength None: not)."""
    if not isinstance(schema, Mapping):
        return 0, None
    high, low = schema.get("maxLength"), schema.get("minLength", 0)
    if not isinstance(high, int) or isinstance(high, bool) or not 0 <= high <= 10_000:
        return 0, None
    low = low if isinstance(low, int) and not isinstance(low, bool) and 0 <= low <= high else 0
    return low, high


class GrammarConstraint:
    """One request's matcher (see the module docstring). Used by the Engine worker only."""

    __slots__ = ("_matcher", "_active", "_think_close", "_stop_ids", "_words", "_eos")

    def __init__(
        self,
        matcher: Any,
        words: int,
        stop_ids: Iterable[int],
        *,
        in_reasoning: bool,
        think_close: int,
        eos_ids: Iterable[int],
    ) -> None:
        self._matcher = matcher
        self._active = not in_reasoning
        self._think_close = think_close
        self._words = words
        stops = sorted({int(t) for t in stop_ids if 0 <= int(t) < 32 * words})
        self._stop_ids = np.array(stops, dtype=np.int64)
        self._eos = np.array(sorted({int(t) for t in eos_ids if 0 <= int(t) < 32 * words}), dtype=np.int64)

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (the reasoning has ended)."""
        return self._active

    @property
    def matcher(self) -> Any:
        return self._matcher

    def masks(self, drafts: Sequence[int]) -> list[np.ndarray | None]:
        active = self._active
        out: list[np.ndarray | None] = [self._mask(self._matcher) if active else None]
        if not drafts:
            return out
        copy = self._matcher.deep_copy() if active else None
        dead = False
        for d in drafts:
            if dead:
                out.append(None)  # never reached: the verify rejects the refused draft before it
            elif not active:
                active = d == self._think_close
                if active:
                    copy = self._matcher.deep_copy()
                out.append(self._mask(copy) if active else None)
            else:
                assert copy is not None
                if int(d) in self._stop_ids or not copy.consume_token(int(d)):
                    dead = True
                    out.append(None)
                else:
                    out.append(self._mask(copy))
        return out

    def advance(self, token_ids: Sequence[int], *, forced: bool = False) -> None:
        for t in token_ids:
            t = int(t)
            if not self._active:
                self._active = t == self._think_close
                continue
            if forced:
                continue  # the thinking-budget close's separator (see the module docstring)
            if t in self._stop_ids:
                if not self._matcher.is_accepting():
                    raise RuntimeError(f"stop token {t} committed before the grammar is complete")
                continue
            if not self._matcher.consume_token(t):
                error = self._matcher.get_error()[:300]
                raise RuntimeError(f"token {t} committed outside the grammar: {error}")

    def _mask(self, matcher: Any) -> np.ndarray:
        words = np.zeros(self._words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if matcher.is_error():
            raise RuntimeError(f"the grammar matcher failed: {matcher.get_error()[:300]}")
        view = words.view(np.uint32)
        # the request's stop tokens, exactly when the grammar is complete (llguidance sets its eos ids)
        _set_bits(view, self._eos, False)
        if matcher.is_accepting():
            _set_bits(view, self._stop_ids, True)
        return words


def _set_bits(words: np.ndarray, ids: np.ndarray, on: bool) -> None:
    if not len(ids):
        return
    index, bit = ids // 32, (ids % 32).astype(np.uint32)
    values = np.left_shift(np.uint32(1), bit)
    for i, v in zip(index.tolist(), values.tolist()):  # a handful of stop ids
        if on:
            words[i] |= np.uint32(v)
        else:
            words[i] &= ~np.uint32(v)
