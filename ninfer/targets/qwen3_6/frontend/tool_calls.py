"""Qwen3-Coder XML tool calls in the content stream.

Format (what the chat template renders and the model is told to produce)::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

A call is reported when its ``</tool_call>`` arrives, and only if it parses completely and names one of
the prompt's tools: a call that turns out malformed (unknown function, broken XML, unterminated at the
end) stays content, which is only possible if nothing of it was published early. Values are typed by the
tool's JSON schema (integer/number/boolean/object/array/null parsed, strings kept verbatim; no schema:
JSON if it parses, else the string). Whitespace between content and calls, and between calls, is the
template's separator and is not content.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ninfer.targets.qwen3_6.frontend.stop import partial_suffix_len
from ninfer.targets.qwen3_6.frontend.types import ToolCallDelta

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_FUNCTION_OPEN = "<function="
_FUNCTION_CLOSE = "</function>"
_PARAM_OPEN = "<parameter="
_PARAM_CLOSE = "</parameter>"
_WS = re.compile(r"\s*")

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_INTEGER_TYPES = {"integer", "int"}
_NUMBER_TYPES = {"number", "float", "double"}
_BOOLEAN_TYPES = {"boolean", "bool"}
_JSON_TYPES = {"object", "array", "dict", "list"}


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Function name -> its ``parameters.properties`` (OpenAI ``{"type": "function", "function": ...}``
    entries or bare function objects)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


def _schema_type(schema: Any) -> str | None:
    if not isinstance(schema, Mapping):
        return None
    t = schema.get("type")
    if isinstance(t, list):  # e.g. ["integer", "null"]: the first non-null type decides
        t = next((x for x in t if x != "null"), None)
    if isinstance(t, str):
        return t.lower()
    values = schema.get("enum")
    if isinstance(values, list) and values:  # a malformed enum types nothing (never raises)
        return "string" if all(isinstance(v, str) for v in values) else None
    return None


def _json_or_none(text: str) -> tuple[bool, Any]:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False, None
    if isinstance(value, float) and not math.isfinite(value):
        return False, None
    return True, value


def convert_param_value(raw: str, schema: Any) -> Any:
    """The typed value of one ``<parameter>`` body; never raises (falls back to the raw string)."""
    t = _schema_type(schema)
    if t in _STRING_TYPES:
        return raw
    stripped = raw.strip()
    if t is not None and stripped.lower() == "null":
        return None
    if t in _INTEGER_TYPES:
        try:
            return int(stripped)
        except ValueError:
            ok, value = _json_or_none(stripped)
            return value if ok and isinstance(value, int) and not isinstance(value, bool) else raw
    if t in _NUMBER_TYPES:
        ok, value = _json_or_none(stripped)
        if ok and isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        return raw
    if t in _BOOLEAN_TYPES:
        low = stripped.lower()
        return True if low == "true" else False if low == "false" else raw
    if t in _JSON_TYPES:
        ok, value = _json_or_none(stripped)
        return value if ok else raw
    ok, value = _json_or_none(stripped)  # no or unknown schema type
    return value if ok else raw


def parse_tool_call(
    block: str, schemas: Mapping[str, Mapping[str, Any]]
) -> tuple[str, dict[str, Any]] | None:
    """(name, typed arguments) of one complete ``<tool_call>...</tool_call>`` block, or None if malformed."""
    if not (block.startswith(TOOL_CALL_OPEN) and block.endswith(TOOL_CALL_CLOSE)):
        return None
    body = block[len(TOOL_CALL_OPEN) : len(block) - len(TOOL_CALL_CLOSE)]
    pos = _WS.match(body, 0).end()
    if not body.startswith(_FUNCTION_OPEN, pos):
        return None
    end = body.find(">", pos)
    if end < 0:
        return None
    name = body[pos + len(_FUNCTION_OPEN) : end].strip()
    if name not in schemas or "\n" in name:
        return None
    props = schemas[name]
    args: dict[str, Any] = {}
    pos = end + 1
    while True:
        pos = _WS.match(body, pos).end()
        if body.startswith(_FUNCTION_CLOSE, pos):
            pos += len(_FUNCTION_CLOSE)
            break
        if not body.startswith(_PARAM_OPEN, pos):
            return None
        end = body.find(">", pos)
        close = body.find(_PARAM_CLOSE, pos)
        if end < 0 or close < 0 or close < end:
            return None
        arg = body[pos + len(_PARAM_OPEN) : end].strip()
        if not arg or "\n" in arg or "<" in arg:
            return None
        value = body[end + 1 : close]
        # the template writes "<parameter=ARG>\n" + value + "\n</parameter>"
        value = value.removeprefix("\n").removesuffix("\n")
        args[arg] = convert_param_value(value, props.get(arg))
        pos = close + len(_PARAM_CLOSE)
    if body[pos:].strip():
        return None
    return name, args


def _partial_function_open(after_open: str) -> bool:
    """Whether text after ``<tool_call>`` can still be the start of a well-formed call."""
    rest = after_open.lstrip()
    return rest.startswith(_FUNCTION_OPEN) or _FUNCTION_OPEN.startswith(rest)


class ToolCallParser:
    """Streaming splitter of the content channel into content text and complete tool calls."""

    __slots__ = ("_schemas", "_id_salt", "_held", "_in_call", "_call_buf", "_pre_ws", "_after_call", "count")

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]], id_salt: str) -> None:
        self._schemas = schemas
        self._id_salt = id_salt
        self._held = ""  # content that may be a partial <tool_call> or separator whitespace
        self._in_call = False
        self._call_buf = ""  # the open call, from its <tool_call>
        self._pre_ws = ""  # whitespace dropped before the open call, restored if it turns out malformed
        self._after_call = False  # drop whitespace right after a call (template separator)
        self.count = 0  # calls reported so far (= next index)

    def copy(self) -> ToolCallParser:
        # field by field: copy.copy takes the generic __reduce_ex__ path (microseconds per preview)
        new = ToolCallParser.__new__(ToolCallParser)
        new._schemas = self._schemas
        new._id_salt = self._id_salt
        new._held = self._held
        new._in_call = self._in_call
        new._call_buf = self._call_buf
        new._pre_ws = self._pre_ws
        new._after_call = self._after_call
        new.count = self.count
        return new

    def call_id(self, index: int) -> str:
        """Deterministic per session and index, so previewing twice gives the same id."""
        return "call_" + hashlib.sha256(f"{self._id_salt}:{index}".encode()).hexdigest()[:24]

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        buf = text
        while True:
            if self._in_call:
                done, buf = self._feed_call(buf, content, deltas)
                if not done:
                    break
                continue
            buf = self._held + buf
            self._held = ""
            if self._after_call:
                buf = buf.lstrip()
                if not buf:
                    break
                self._after_call = False
            i = buf.find(TOOL_CALL_OPEN)
            if i >= 0:
                before = buf[:i]
                stripped = before.rstrip()
                content.append(stripped)
                self._pre_ws = before[len(stripped) :]
                self._in_call, self._call_buf = True, ""
                buf = buf[i:]
                continue
            keep = partial_suffix_len(buf, (TOOL_CALL_OPEN,))
            body = buf[: len(buf) - keep]
            stripped = body.rstrip()
            content.append(stripped)
            self._held = body[len(stripped) :] + buf[len(buf) - keep :]
            break
        return "".join(content), deltas

    def _feed_call(self, text: str, content: list[str], deltas: list[ToolCallDelta]) -> tuple[bool, str]:
        """Extend the open call; (True, rest) when it ended (reported or turned into content)."""
        start = max(0, len(self._call_buf) - len(TOOL_CALL_CLOSE))
        buf = self._call_buf + text
        after_open = buf[len(TOOL_CALL_OPEN) :]
        if not _partial_function_open(after_open[:64]):
            # cannot become a call: it is content, and scanning resumes right after its <tool_call>
            content.append(self._pre_ws + TOOL_CALL_OPEN)
            self._in_call, self._call_buf, self._pre_ws = False, "", ""
            return True, after_open
        nested = buf.find(TOOL_CALL_OPEN, max(start, len(TOOL_CALL_OPEN)))
        close = buf.find(TOOL_CALL_CLOSE, start)
        if nested >= 0 and (close < 0 or nested < close):
            # a second <tool_call> before this one closed: this one is broken text
            content.append(self._pre_ws + buf[:nested])
            self._in_call, self._call_buf, self._pre_ws = False, "", ""
            return True, buf[nested:]
        if close < 0:
            self._call_buf = buf
            return False, ""
        end = close + len(TOOL_CALL_CLOSE)
        block, rest = buf[:end], buf[end:]
        parsed = parse_tool_call(block, self._schemas)
        if parsed is None:
            content.append(self._pre_ws + block)
        else:
            name, args = parsed
            index = self.count
            self.count += 1
            deltas.append(ToolCallDelta(index=index, id=self.call_id(index), name=name, arguments=""))
            deltas.append(
                ToolCallDelta(index=index, id=None, name=None, arguments=json.dumps(args, ensure_ascii=False))
            )
            self._after_call = True
        self._in_call, self._call_buf, self._pre_ws = False, "", ""
        return True, rest

    def flush(self) -> str:
        """End of output: held text and an unterminated call are content."""
        if self._in_call:
            out = self._pre_ws + self._call_buf
        elif self._after_call:
            out = ""  # only separator whitespace after the last call
        else:
            out = self._held
        self._held, self._call_buf, self._pre_ws, self._in_call = "", "", "", False
        return out
