"""``POST /v1/chat/completions``: messages -> Engine request -> OpenAI chat completion (or chunk stream).

Reasoning arrives from the Frontend as its own channel (``reasoning_content``); Qwen3-Coder XML tool
calls arrive parsed (``tool_calls``), so the gateway only reshapes them. ``finish_reason`` is
``tool_calls`` when a call was made and the model stopped on its own.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ninfer.serve.convert import (
    TokenTexts,
    bad_request,
    chat_messages,
    check_common,
    sampling_kwargs,
    template_kwargs,
    tool_dicts,
)
from ninfer.serve.errors import ServeError
from ninfer.serve.gateway import EngineRun, Gateway
from ninfer.serve.images import ImageAcquirer
from ninfer.serve.protocol import ChatCompletionRequest
from ninfer.serve.responses import JSONBody
from ninfer.serve.reuse import reuse_fields, usage_out
from ninfer.serve.streaming import SSE_DONE, ClientGone, EventStreamResponse, sse, unless_disconnected
from ninfer.serve.structured import output_constraint
from ninfer.types import GenerationDelta, GenerationRequest, GenerationResult, ToolCallDelta

ENDPOINT = "/v1/chat/completions"


def generation_request(body: ChatCompletionRequest, vocab_size: int) -> GenerationRequest:
    check_common(body, vocab_size)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    choice = body.tool_choice
    # structured outputs: response_format, guided_*, structured_outputs, tool_choice required / named
    constraint = output_constraint(
        body, tool_choice=choice, tools=body.tools, parallel_tool_calls=body.parallel_tool_calls
    )
    tools = None if choice == "none" else tool_dicts(body.tools)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return GenerationRequest(
        messages=chat_messages(body.messages, images=True),  # image_url parts: acquired by the handler
        tools=tools,
        chat_template_kwargs=template_kwargs(body.chat_template_kwargs),
        max_tokens=max_tokens,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0,
        thinking_budget=body.thinking_budget,
        constraint=constraint,
        **sampling_kwargs(body),
    )


def _tool_call_out(call: ToolCallDelta) -> dict[str, Any]:
    return {
        "id": call.id or f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": call.name or "", "arguments": call.arguments},
    }


def _tool_call_delta(call: ToolCallDelta) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": call.arguments}
    if call.name is not None:
        function["name"] = call.name
    out: dict[str, Any] = {"index": call.index, "function": function}
    if call.id is not None:
        out["id"] = call.id
        out["type"] = "function"
    return out


def _finish_reason(result: GenerationResult) -> str:
    if result.tool_calls and result.finish_reason == "stop":
        return "tool_calls"
    return result.finish_reason


class ChatHandler:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.tokens = TokenTexts(gateway.host.frontend)
        self.images = ImageAcquirer(gateway.config.images, gateway.config.model_name)

    async def __call__(self, body: ChatCompletionRequest, request: Request) -> Response:
        gw = self.gateway
        gw.check_model(body.model)
        engine = gw.host.engine()
        if engine.config.purpose != "generation":
            raise ServeError(
                400,
                "this server was started with --purpose causal_scoring: it only scores prompts "
                "(POST /v1/completions with echo and logprobs, max_tokens 0); start it with "
                "--purpose generation to chat",
                code="wrong_purpose",
            )
        generation = generation_request(body, gw.host.frontend.vocab_size)
        assert generation.messages is not None
        messages = await self.images.acquire(list(generation.messages))  # off the loop; 400 if refused
        if messages is not generation.messages:
            generation = dataclasses.replace(generation, messages=messages)
        generation = dataclasses.replace(generation, **reuse_fields(request))
        run = await gw.submit(generation, ENDPOINT, "messages")
        meta = {
            "id": f"chatcmpl-{secrets.token_hex(16)}",
            "created": int(time.time()),
            "model": gw.config.model_name,
        }
        try:
            if body.stream:
                await unless_disconnected(request, run.wait_start())
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return EventStreamResponse(
                    self._chunks(run, meta, include_usage, bool(body.logprobs)), run.close
                )
            result = await unless_disconnected(request, run.collect())
        except ClientGone:
            run.close()
            return ServeError(499, "client closed the request").response()
        except BaseException:
            run.close()
            raise
        run.close()
        return JSONBody(self._response(result, meta, bool(body.logprobs)))

    # ---- one piece ----
    def _response(self, result: GenerationResult, meta: dict[str, Any], logprobs: bool) -> dict[str, Any]:
        calls = [_tool_call_out(c) for c in result.tool_calls]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": result.text if result.text or not calls else None,
            "reasoning_content": result.reasoning_text or None,
            "tool_calls": calls,
        }
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": [self.tokens.chat_entry(lp) for lp in result.logprobs or ()]}
            if logprobs
            else None,
            "finish_reason": _finish_reason(result),
        }
        return {**meta, "object": "chat.completion", "choices": [choice], "usage": usage_out(result.usage)}

    # ---- stream ----
    async def _chunks(
        self, run: EngineRun, meta: dict[str, Any], include_usage: bool, logprobs: bool
    ) -> AsyncIterator[bytes]:
        base = {**meta, "object": "chat.completion.chunk"}
        if include_usage:
            base["usage"] = None

        def chunk(delta: dict[str, Any], finish: str | None = None, lps: list[Any] | None = None) -> bytes:
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": {"content": lps} if lps is not None else None,
                "finish_reason": finish,
            }
            return sse({**base, "choices": [choice]})

        yield chunk({"role": "assistant", "content": ""})
        pending: list[Any] = []  # logprobs of tokens whose text is still held back
        async for event in run.events():
            if isinstance(event, GenerationDelta):
                if logprobs and event.logprobs:
                    pending.extend(self.tokens.chat_entry(lp) for lp in event.logprobs)
                delta: dict[str, Any] = {}
                if event.reasoning_text:
                    delta["reasoning_content"] = event.reasoning_text
                if event.text:
                    delta["content"] = event.text
                if event.tool_calls:
                    delta["tool_calls"] = [_tool_call_delta(c) for c in event.tool_calls]
                if delta:
                    yield chunk(delta, lps=pending if logprobs else None)
                    pending = []
                continue
            if event.error is not None or event.finish_reason in ("error", "cancelled"):
                yield sse(run.error_of(event).body())
                yield SSE_DONE
                return
            yield chunk({}, _finish_reason(event), pending if logprobs and pending else None)
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage_out(event.usage)})
        yield SSE_DONE
