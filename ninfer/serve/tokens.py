"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (vLLM-compatible shapes; the
last two are what lm-eval-harness's remote tokenizer reads). Served by the Frontend alone, so they work
while the Engine is still loading."""

from __future__ import annotations

from typing import Any

import anyio.to_thread

from ninfer.serve.convert import (
    TokenTexts,
    bad_request,
    chat_messages,
    check_prompt_size,
    template_kwargs,
    tool_dicts,
)
from ninfer.serve.gateway import Gateway
from ninfer.serve.protocol import DetokenizeRequest, TokenizeRequest
from ninfer.types import GenerationRequest


class TokenHandlers:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.frontend = gateway.host.frontend
        self.tokens = TokenTexts(self.frontend)

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.gateway.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt (raw text) or messages (chat)", "prompt")

        def run() -> list[int]:
            max_context = self.gateway.host.max_context
            try:
                if body.prompt is not None:
                    check_prompt_size(
                        self.frontend, GenerationRequest(prompt=body.prompt), max_context, "prompt"
                    )
                    return list(self.frontend.encode(body.prompt))
                kwargs = template_kwargs(body.chat_template_kwargs)
                kwargs.setdefault("add_generation_prompt", bool(body.add_generation_prompt))
                assert body.messages is not None
                messages, tools = chat_messages(body.messages), tool_dicts(body.tools)
                request = GenerationRequest(messages=messages, tools=tools, chat_template_kwargs=kwargs)
                check_prompt_size(self.frontend, request, max_context, "messages")
                prepared = self.frontend.prepare_chat(messages, tools=tools, **kwargs)
                return list(prepared.token_ids)
            except (ValueError, TypeError) as exc:
                raise bad_request(f"the input cannot be tokenized: {exc}", "messages") from None

        ids = await anyio.to_thread.run_sync(run)
        return {
            "count": len(ids),
            "max_model_len": self.gateway.host.max_context,
            "tokens": ids,
            "token_strs": [self.tokens.text(i) for i in ids] if body.return_token_strs else None,
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.gateway.check_model(body.model)
        try:
            self.frontend.prepare_tokens(body.tokens)
        except ValueError as exc:
            raise bad_request(f"tokens: {exc}", "tokens") from None
        text = await anyio.to_thread.run_sync(self.frontend.decode, body.tokens)
        return {"prompt": text}

    def tokenizer_info(self) -> dict[str, Any]:
        fe = self.frontend
        eos = fe.eos_token_ids[0] if fe.eos_token_ids else None
        template = getattr(getattr(fe, "chat_template", None), "source", "")
        return {
            "tokenizer_class": "Qwen2TokenizerFast",
            "eos_token": self.tokens.text(eos) if eos is not None else "",
            "chat_template": template,
            "model_max_length": self.gateway.host.max_context,
            "vocab_size": fe.vocab_size,
        }
