"""The context cache and speculative decoding as the HTTP gateway shows them.

The gateway decides nothing about reuse (docs/resources-and-context-cache.md): the Engine looks every
prompt up by content. What the gateway does:

- pass a client's session key (``X-Session-Id``) as ``GenerationRequest.session_id``, a hint that finds
  the session's own latest continuation first, and a per-request opt-out (``X-Prefix-Cache: off``) as
  ``GenerationRequest.prefix_cache``;
- report reuse and drafting in OpenAI's usage fields (``prompt_tokens_details.cached_tokens``,
  ``completion_tokens_details.accepted_prediction_tokens`` / ``rejected_prediction_tokens``);
- forward an authenticated reset (``POST /reset_prefix_cache``, SGLang's ``POST /flush_cache``) to
  ``Engine.reset_cache``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import anyio.to_thread
from starlette.requests import Request

from ninfer.serve.convert import usage_dict
from ninfer.serve.errors import ServeError
from ninfer.serve.host import EngineHost
from ninfer.types import Usage

SESSION_HEADER = "X-Session-Id"
PREFIX_CACHE_HEADER = "X-Prefix-Cache"
MAX_SESSION_ID = 256  # GenerationRequest.session_id's own bound
SESSION_ID = re.compile(rf"[A-Za-z0-9._:@/+=~-]{{1,{MAX_SESSION_ID}}}")
RESET_PATHS = ("/reset_prefix_cache", "/flush_cache")  # vLLM's name, SGLang's name
RESET_TIMEOUT_S = 30.0


def reuse_fields(request: Request) -> dict[str, Any]:
    """``session_id`` and ``prefix_cache`` of the GenerationRequest from the request's headers; a bad
    value is a 400 naming the header."""
    out: dict[str, Any] = {}
    session = request.headers.get(SESSION_HEADER)
    if session is not None:
        if SESSION_ID.fullmatch(session) is None:
            raise ServeError(
                400,
                f"header {SESSION_HEADER} must be 1..{MAX_SESSION_ID} characters of letters, digits and "
                f"._:@/+=~- (got {len(session)} characters{_first_bad(session)}); send a conversation id "
                "such as a UUID, or leave the header out",
                code="invalid_request",
                param=SESSION_HEADER,
            )
        out["session_id"] = session
    cache = request.headers.get(PREFIX_CACHE_HEADER)
    if cache is not None:
        value = cache.strip().lower()
        if value not in ("on", "off"):
            raise ServeError(
                400,
                f"header {PREFIX_CACHE_HEADER} must be on or off, got {cache[:32]!r}",
                code="invalid_request",
                param=PREFIX_CACHE_HEADER,
            )
        out["prefix_cache"] = value == "on"
    return out


def _first_bad(text: str) -> str:
    for pos, char in enumerate(text):
        if SESSION_ID.fullmatch(char) is None:
            return f", {char!r} at position {pos}"
    return ""


def usage_out(u: Usage) -> dict[str, Any]:
    """A generation's OpenAI usage: cached prompt tokens (served from a checkpoint, not prefilled) and
    the speculative drafts the verify accepted (kept in the output) or rejected."""
    out = usage_dict(u.prompt_tokens, u.completion_tokens, u.reused_prefix_tokens)
    out["completion_tokens_details"] = {
        "accepted_prediction_tokens": u.accepted_draft_tokens,
        "rejected_prediction_tokens": u.drafted_tokens - u.accepted_draft_tokens,
    }
    return out


def sum_usage(usages: Iterable[Usage]) -> Usage:
    """The usage of a batch (completions with several prompts): every count summed."""
    total = Usage()
    for u in usages:
        total = Usage(
            prompt_tokens=total.prompt_tokens + u.prompt_tokens,
            completion_tokens=total.completion_tokens + u.completion_tokens,
            reused_prefix_tokens=total.reused_prefix_tokens + u.reused_prefix_tokens,
            drafted_tokens=total.drafted_tokens + u.drafted_tokens,
            accepted_draft_tokens=total.accepted_draft_tokens + u.accepted_draft_tokens,
        )
    return total


async def reset_prefix_cache(host: EngineHost) -> dict[str, Any]:
    """Drop every inactive checkpoint (``Engine.reset_cache``; requests in flight keep theirs); on a
    worker thread, since it waits for the Engine worker's next boundary."""
    engine = host.engine()
    if engine.config.purpose != "generation":
        raise ServeError(
            400,
            "this server was started with --purpose causal_scoring, which keeps no prefix cache",
            code="wrong_purpose",
        )
    try:
        dropped = await anyio.to_thread.run_sync(engine.reset_cache, RESET_TIMEOUT_S)
    except TimeoutError:
        raise ServeError(
            503,
            f"the Engine did not reach a point to reset its cache within {RESET_TIMEOUT_S:g} s; retry",
            code="engine_unavailable",
            headers={"Retry-After": str(host.retry_after_s)},
        ) from None
    stats = engine.cache_stats()
    return {"object": "prefix_cache.reset", "dropped": dropped, "checkpoints": stats.checkpoints}
