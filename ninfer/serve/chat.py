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
    choice_seeds,
    choices_of,
    sampling_kwargs,
    template_kwargs,
    tool_dicts,
)
from ninfer.serve.errors import ServeError
from ninfer.serve.gateway import EngineRun, Gateway
from ninfer.serve.images import ImageAcquirer
from ninfer.serve.protocol import ChatCompletionRequest
from ninfer.serve.responses import JSONBody
from ninfer.serve.reuse import reuse_fields, sum_usage, usage_out
from ninfer.serve.streaming import (
    SSE_DONE,
    ClientGone,
    EventStreamResponse,
    all_or_none,
    merged,
    sse,
    unless_disconnected,
)
from ninfer.serve.structured import output_constraint
from ninfer.types import GenerationDelta, GenerationRequest, GenerationResult, ToolCallDelta, Usage

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
        chat_template_kwargs=chat_template_options(body),
        max_tokens=max_tokens,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0,
        thinking_budget=body.thinking_budget,
        constraint=constraint,
        **sampling_kwargs(body),
    )


def chat_template_options(body: ChatCompletionRequest) -> dict[str, Any]:
    """``chat_template_kwargs`` with the chat-level switches folded in: ``reasoning_effort`` (``none``:
    thinking off; any other value: on, NInfer has no graded effort), ``continue_final_message`` and
    ``add_generation_prompt`` (vLLM's). A per-request ``chat_template`` is refused: it would run a
    client's template on the server (vLLM refuses it too unless started with
    --trust-request-chat-template)."""
    if body.chat_template is not None:
        raise bad_request(
            "chat_template: a per-request chat template is not accepted (it would run a client's template "
            "on the server); the model's own template renders every request: pass its switches in "
            "chat_template_kwargs, or send a raw prompt to /v1/completions",
            "chat_template",
        )
    kwargs = template_kwargs(body.chat_template_kwargs)
    if body.reasoning_effort is not None:
        thinking = body.reasoning_effort != "none"
        if kwargs.get("enable_thinking", thinking) != thinking:
            raise bad_request(
                f"reasoning_effort {body.reasoning_effort!r} contradicts "
                f"chat_template_kwargs.enable_thinking "
                f"{kwargs['enable_thinking']}; give one of them",
                "reasoning_effort",
            )
        kwargs["enable_thinking"] = thinking
    for name in ("continue_final_message", "add_generation_prompt"):
        value = getattr(body, name)
        if value is not None:
            if kwargs.get(name, value) != value:
                raise bad_request(f"{name} is given twice, differently (also in chat_template_kwargs)", name)
            kwargs[name] = value
    if kwargs.get("continue_final_message"):
        if kwargs.setdefault("add_generation_prompt", False):
            raise bad_request(
                "continue_final_message continues the last message, so it cannot have add_generation_prompt "
                "true (which starts a new one)",
                "continue_final_message",
            )
        if body.messages[-1].role != "assistant":
            raise bad_request(
                "continue_final_message needs an assistant message last: the text the model continues",
                "continue_final_message",
            )
    return kwargs


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
        n = choices_of(body, engine.config.max_concurrency)
        runs: list[EngineRun] = []

        def close_all() -> None:
            for run in runs:
                run.close()

        meta = {
            "id": f"chatcmpl-{secrets.token_hex(16)}",
            "created": int(time.time()),
            "model": gw.config.model_name,
        }
        try:
            # n independent samples of one prompt, submitted together (choice i: seed + i)
            for seed in choice_seeds(generation.seed, n):
                choice = dataclasses.replace(generation, seed=seed)
                runs.append(await gw.submit(choice, ENDPOINT, "messages"))
            if body.stream:
                await unless_disconnected(request, all_or_none(r.wait_start() for r in runs))
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return EventStreamResponse(
                    self._chunks(runs, meta, include_usage, bool(body.logprobs)), close_all
                )
            results = await unless_disconnected(request, all_or_none(r.collect() for r in runs))
        except ClientGone:
            close_all()
            return ServeError(499, "client closed the request").response()
        except BaseException:
            close_all()
            raise
        close_all()
        return JSONBody(self._response(results, meta, bool(body.logprobs)))

    # ---- one piece ----
    def _response(
        self, results: list[GenerationResult], meta: dict[str, Any], logprobs: bool
    ) -> dict[str, Any]:
        choices = [self._choice(i, result, logprobs) for i, result in enumerate(results)]
        usage = usage_out(sum_usage(r.usage for r in results))
        return {**meta, "object": "chat.completion", "choices": choices, "usage": usage}

    def _choice(self, index: int, result: GenerationResult, logprobs: bool) -> dict[str, Any]:
        calls = [_tool_call_out(c) for c in result.tool_calls]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": result.text if result.text or not calls else None,
            "reasoning_content": result.reasoning_text or None,
            "tool_calls": calls,
        }
        return {
            "index": index,
            "message": message,
            "logprobs": {"content": [self.tokens.chat_entry(lp) for lp in result.logprobs or ()]}
            if logprobs
            else None,
            "finish_reason": _finish_reason(result),
        }

    # ---- stream ----
    async def _chunks(
        self, runs: list[EngineRun], meta: dict[str, Any], include_usage: bool, logprobs: bool
    ) -> AsyncIterator[bytes]:
        base = {**meta, "object": "chat.completion.chunk"}
        if include_usage:
            base["usage"] = None

        def chunk(
            index: int, delta: dict[str, Any], finish: str | None = None, lps: list[Any] | None = None
        ) -> bytes:
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": {"content": lps} if lps is not None else None,
                "finish_reason": finish,
            }
            return sse({**base, "choices": [choice]})

        for index in range(len(runs)):
            yield chunk(index, {"role": "assistant", "content": ""})
        pending: list[list[Any]] = [[] for _ in runs]  # per choice: logprobs of text still held back
        usages: list[Usage] = []
        async for index, event in merged(runs):
            if isinstance(event, GenerationDelta):
                if logprobs and event.logprobs:
                    pending[index].extend(self.tokens.chat_entry(lp) for lp in event.logprobs)
                delta: dict[str, Any] = {}
                if event.reasoning_text:
                    delta["reasoning_content"] = event.reasoning_text
                if event.text:
                    delta["content"] = event.text
                if event.tool_calls:
                    delta["tool_calls"] = [_tool_call_delta(c) for c in event.tool_calls]
                if delta:
                    yield chunk(index, delta, lps=pending[index] if logprobs else None)
                    pending[index] = []
                continue
            if event.error is not None or event.finish_reason in ("error", "cancelled"):
                yield sse(runs[index].error_of(event).body())
                yield SSE_DONE
                return
            lps = pending[index] if logprobs and pending[index] else None
            yield chunk(index, {}, _finish_reason(event), lps)
            usages.append(event.usage)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage_out(sum_usage(usages))})
        yield SSE_DONE
