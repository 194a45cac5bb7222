"""Protocol values -> public Engine values (requests), and Engine values -> protocol pieces (logprobs).

Only translation lives here: what a field means for generation is decided by the Engine and Frontend.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from ninfer.serve.errors import ServeError
from ninfer.serve.host import ServeFrontend
from ninfer.serve.protocol import (
    SEED_LIMIT,
    AssistantMessage,
    ChatMessage,
    ContentPart,
    ImagePart,
    MediaPart,
    SamplingFields,
    SystemMessage,
    TextPart,
    ToolDef,
    ToolMessage,
)
from ninfer.types import NEUTRAL_SAMPLING, GenerationRequest, NInferError, RequestRejected, TokenLogprob

# keyword arguments the gateway itself gives the chat template; chat_template_kwargs may not override them
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents"})
BOOL_TEMPLATE_KWARGS = (
    "enable_thinking",
    "preserve_thinking",
    "add_generation_prompt",
    "continue_final_message",
)
# roles whose messages may hold images (the chat template refuses them in system messages)
IMAGE_ROLES = ("user", "tool")


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> ServeError:
    return ServeError(400, message, code=code, param=param)


# ---------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------


def sampling_kwargs(body: SamplingFields) -> dict[str, Any]:
    """GenerationRequest sampling/stop fields as the request gives them: a sampling field left out stays
    ``None``, and the Engine fills it from the model's generation config (as vLLM does)."""
    out: dict[str, Any] = {name: getattr(body, name) for name in NEUTRAL_SAMPLING}
    out["seed"] = body.seed
    out["stop"] = body.stop
    out["stop_token_ids"] = tuple(body.stop_token_ids or ())
    out["ignore_eos"] = bool(body.ignore_eos)
    out["skip_special_tokens"] = True if body.skip_special_tokens is None else body.skip_special_tokens
    out["include_stop_str_in_output"] = bool(body.include_stop_str_in_output)
    out["logit_bias"] = logit_bias(body.logit_bias)
    out["min_tokens"] = body.min_tokens or 0
    return out


def logit_bias(bias: Mapping[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys, so strings) as token id -> bias."""
    if not bias:
        return None
    bad = next((key for key in bias if not (key.isascii() and key.isdigit())), None)
    if bad is not None:
        raise bad_request(f'logit_bias keys must be token ids such as "258", got {bad!r}', "logit_bias")
    return {int(key): value for key, value in bias.items()}


def choices_of(body: SamplingFields, max_concurrency: int) -> int:
    """``n``: independent choices of one prompt, at most the server's lanes (they run side by side);
    with a ``seed`` choice i samples with ``seed + i``, which must stay below 2**63."""
    n = body.n or 1
    if n > max_concurrency:
        raise bad_request(
            f"n={n} exceeds this server's max_concurrency of {max_concurrency} (the choices run side by "
            f"side); send n <= {max_concurrency}, or several requests",
            "n",
        )
    if body.seed is not None and body.seed + n - 1 >= SEED_LIMIT:
        raise bad_request("seed + n - 1 must be below 2**63 (choice i samples with seed + i)", "seed")
    return n


def choice_seeds(seed: int | None, n: int) -> list[int | None]:
    """Choice i's seed: ``seed + i`` (a fresh one per choice without a seed)."""
    return [None if seed is None else seed + i for i in range(n)]


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """400 naming ``param`` and the first id outside the vocabulary ``[0, vocab_size)``."""
    for pos, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"{param}: token id {token_id} at position {pos} is outside the vocabulary [0, {vocab_size})",
                param,
            )


def check_common(body: SamplingFields, vocab_size: int) -> None:
    """Fields every generating endpoint refuses the same way."""
    check_token_ids(body.stop_token_ids or (), vocab_size, "stop_token_ids")
    check_token_ids(sorted(logit_bias(body.logit_bias) or ()), vocab_size, "logit_bias")
    if body.prompt_logprobs is not None:
        raise bad_request(
            "prompt_logprobs: log-probs of the prompt's own tokens come from the scoring purpose; start a "
            "server with --purpose causal_scoring and send POST /v1/completions with echo: true, logprobs: "
            "N, max_tokens: 0 (docs/cli-and-http.md, Prompt log-probs)",
            "prompt_logprobs",
        )
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only valid with stream: true", "stream_options")


def _content_part(part: ContentPart, where: str, images: bool, role: str) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    if isinstance(part, ImagePart) and images:
        if role not in IMAGE_ROLES:
            raise bad_request(
                f"{where}: the {role} message cannot hold images; put them in a user message",
                where,
                code="unsupported_content",
            )
        url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
        return {"type": "image_url", "image_url": {"url": url}}  # acquired by the chat handler
    if isinstance(part, ImagePart):
        raise bad_request(
            f"{where}: image content is not accepted here; send images to /v1/chat/completions",
            where,
            code="unsupported_content",
        )
    if isinstance(part, MediaPart):
        hint = " (images are image_url parts)" if part.type in ("image", "input_image") else ""
        raise bad_request(
            f"{where}: {part.type} content is not supported{hint}; send text and image_url parts",
            where,
            code="unsupported_content",
        )
    raise bad_request(f"{where}: unknown content part", where)


def _content(
    content: str | list[ContentPart] | None, where: str, images: bool, role: str
) -> str | list[dict[str, Any]] | None:
    if content is None or isinstance(content, str):
        return content
    return [_content_part(part, f"{where}[{j}]", images, role) for j, part in enumerate(content)]


def chat_messages(messages: Sequence[ChatMessage], *, images: bool = False) -> list[dict[str, Any]]:
    """Plain message dicts in the shape the chat template reads. ``images``: image_url parts of user and
    tool messages stay ``{"type": "image_url", "image_url": {"url": ...}}`` for the caller to acquire
    (``ninfer.serve.images``); without it every media part is refused with a 400."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        role = "system" if isinstance(m, SystemMessage) else m.role
        msg: dict[str, Any] = {"role": role}
        msg["content"] = _content(m.content, where, images, role)
        if isinstance(m, AssistantMessage):
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            if m.tool_calls:
                msg["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments},
                    }
                    for call in m.tool_calls
                ]
        if isinstance(m, ToolMessage) and m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if getattr(m, "name", None) is not None:
            msg["name"] = m.name  # type: ignore[union-attr]
        out.append(msg)
    return out


def tool_dicts(tools: Sequence[ToolDef] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]


def template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` checked: no keys the gateway sets itself, booleans where the template
    tests ``is true``/``is false``."""
    out = dict(kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_KWARGS.intersection(out))
    if clash:
        raise bad_request(
            f"chat_template_kwargs may not set {clash}; give messages/tools as request fields",
            "chat_template_kwargs",
        )
    for name in BOOL_TEMPLATE_KWARGS:
        if name in out and not isinstance(out[name], bool):
            raise bad_request(
                f"chat_template_kwargs.{name} must be true or false, got {out[name]!r}",
                "chat_template_kwargs",
            )
    return out


def _string_bytes(value: Any) -> int:
    """UTF-8 bytes of every string (keys included) in a JSON-like value, walked without recursion."""
    total, stack = 0, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            total += len(node.encode("utf-8", "surrogatepass"))
        elif isinstance(node, Mapping):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return total


def check_prompt_size(
    frontend: ServeFrontend, request: GenerationRequest, max_context: int | None, param: str
) -> None:
    """Refuse a prompt that cannot fit ``max_context`` before it is tokenized, from its size alone: token
    ids are counted; text is bounded from below by its bytes (``frontend.min_tokens``). A conversation is
    rendered first (cheap next to tokenizing), and only when its strings are long enough to matter; a
    template error is left for the Engine to report. Runs on a worker thread."""
    if max_context is None:
        return
    prompt, n_bytes = request.prompt, 0
    if prompt is not None and not isinstance(prompt, str):
        if len(prompt) >= max_context:
            raise _too_long(f"{param} has {len(prompt)} tokens", max_context, param)
        return
    if isinstance(prompt, str):
        n_bytes = len(prompt.encode("utf-8", "surrogatepass"))
    elif request.messages is not None:
        content = _string_bytes([request.messages, request.tools])
        if frontend.min_tokens(content) < max_context:
            return
        kwargs = {"add_generation_prompt": True, **request.chat_template_kwargs}
        try:
            rendered = frontend.render_chat(request.messages, tools=request.tools, **kwargs)
        except ValueError:
            return
        n_bytes = len(rendered.encode("utf-8", "surrogatepass"))
    least = frontend.min_tokens(n_bytes)
    if least >= max_context:
        raise _too_long(f"{param} has at least {least} tokens ({n_bytes} bytes of text)", max_context, param)


def _too_long(what: str, max_context: int, param: str) -> ServeError:
    return bad_request(
        f"{what} but max_context is {max_context} (prompt plus at least one generated token); shorten it",
        param,
        code="context_length_exceeded",
    )


# GenerationRequest fields whose name starts an Engine problem message ("temperature must be ...")
_REQUEST_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop_token_ids",
    "stop",
    "top_logprobs",
    "thinking_budget",
    "logit_bias",
    "min_tokens",
    "tools",
    "messages",
    "prompt",
    # structured outputs: a constraint's rejection starts with the field it came from (serve/structured.py)
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "tool_choice",
)


def engine_param(exc: NInferError, input_param: str) -> str | None:
    """The request field an Engine rejection is about (OpenAI ``param``): the input for a prompt that is
    too long or cannot be prepared, the named field for an invalid value, none for overload and the like.
    The Engine names fields at the start of each problem it reports (``GenerationRequest.problems``)."""
    if not isinstance(exc, RequestRejected):
        return None
    if exc.kind in ("context_too_long", "infeasible"):
        return input_param
    if exc.kind != "invalid_request":
        return None
    first = exc.message.split("; ", 1)[0]
    for name in _REQUEST_FIELDS:
        if first.startswith(name) and not first[len(name) : len(name) + 1].isalnum():
            return input_param if name in ("prompt", "messages") else name
    if first.startswith("the model's generation config"):
        return None  # the model's own defaults are bad, not a field of the request
    return input_param


# ---------------------------------------------------------------------------------------------------
# Output pieces
# ---------------------------------------------------------------------------------------------------


class TokenTexts:
    """Text of single tokens for logprob listings (special tokens shown; a byte fragment of a multi-byte
    character shows as U+FFFD, its ``bytes`` are still exact where the text is)."""

    def __init__(self, frontend: ServeFrontend) -> None:
        self._frontend = frontend
        self.text = functools.lru_cache(maxsize=65536)(self._text)
        self.piece = functools.lru_cache(maxsize=65536)(self._piece)

    def _text(self, token_id: int) -> str:
        return self._frontend.decode([token_id], skip_special_tokens=False)

    def _piece(self, token_id: int, skip_special_tokens: bool) -> str:
        """What one token adds to a choice's text (special tokens dropped when the request skips them)."""
        return self._frontend.decode([token_id], skip_special_tokens=skip_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self._frontend.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_entry(self, lp: TokenLogprob) -> dict[str, Any]:
        text = self.text(lp.token_id)
        return {
            "token": text,
            "logprob": lp.logprob,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := self.text(tid)), "logprob": value, "bytes": list(t.encode("utf-8"))}
                for tid, value in lp.top
            ],
        }

    def top_dict(self, lp: TokenLogprob) -> dict[str, float]:
        """Completions ``top_logprobs`` entry: the alternatives plus the chosen token (as vLLM does)."""
        out: dict[str, float] = {}
        for tid, value in lp.top:
            out.setdefault(self.text(tid), value)
        out.setdefault(self.text(lp.token_id), lp.logprob)
        return out


# a UTF-8 character spans at most 4 bytes and every token holds at least one byte: 4 tokens that still end
# in an incomplete character are invalid UTF-8, counted as decoded (U+FFFD), as the detokenizer emits them
_MAX_PENDING_TOKENS = 4


class TextOffsets:
    """Completions ``text_offset``: where each token starts in the choice's text (``start`` = the echoed
    prompt's length), counted in characters of the decoded text rather than by adding up single-token
    texts: a character split over byte-level tokens (an emoji, say) is one character of text but one
    U+FFFD per token in ``tokens``, and a special token the request skips adds no text. A token that
    continues an unfinished character gets that character's offset.

    One instance per choice, fed every token in order. The offsets depend only on the tokens, never on
    how much text a stream had emitted when they arrived (stop-string hold-back delays the text, not the
    tokens), so a stream's offsets are the non-streamed ones. Tokens whose text a stop string cut off
    point at or past the end of the text.
    """

    def __init__(self, texts: TokenTexts, start: int, skip_special_tokens: bool) -> None:
        self._texts = texts
        self._skip = skip_special_tokens
        self._chars = start  # characters of text up to the end of the last complete character
        self._pending: tuple[int, ...] = ()  # tokens since then: their bytes end inside a character

    def feed(self, token_ids: Sequence[int]) -> list[int]:
        out = []
        for token_id in token_ids:
            if self._pending:
                text = self._texts.decode(self._pending, self._skip)
                out.append(self._chars + len(text.rstrip("\ufffd")))  # the unfinished character's offset
                tokens = (*self._pending, token_id)
                text = self._texts.decode(tokens, self._skip)
            else:
                out.append(self._chars)
                tokens = (token_id,)
                text = self._texts.piece(token_id, self._skip)  # cached: the common, one-token case
            if text.endswith("\ufffd") and len(tokens) < _MAX_PENDING_TOKENS:
                self._pending = tokens
            else:
                self._chars += len(text)
                self._pending = ()
        return out


def usage_dict(prompt_tokens: int, completion_tokens: int, reused_prefix_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": reused_prefix_tokens},
    }
