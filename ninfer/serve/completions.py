"""``POST /v1/completions``: raw prompts (text or token ids, one or a batch) -> text completions.

On a ``generation`` server each choice is one Engine request: ``n`` per prompt (choice ``i * n + j`` is
prompt i's j-th sample, with ``seed + j``). ``echo`` prepends the prompt
text. Prompt log-probs (``echo`` with ``logprobs``, ``max_tokens`` 0, or 1 to append the greedy next
token) are answered by a ``causal_scoring`` server through ``Engine.score`` -- the request shape
lm-eval-harness ``local-completions`` uses for log-likelihoods.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import Response

from ninfer.runtime.contract.constraint import OutputConstraint
from ninfer.runtime.engine.engine import Engine
from ninfer.serve.convert import (
    TextOffsets,
    TokenTexts,
    bad_request,
    check_common,
    check_token_ids,
    choice_seeds,
    choices_of,
    sampling_kwargs,
    usage_dict,
)
from ninfer.serve.errors import ServeError
from ninfer.serve.gateway import EngineRun, Gateway
from ninfer.serve.protocol import CompletionRequest
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
from ninfer.types import (
    GenerationDelta,
    GenerationRequest,
    NInferError,
    ScoreResult,
    TokenLogprob,
    Usage,
    resolve_sampling,
)

ENDPOINT = "/v1/completions"
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
MAX_BATCH_PROMPTS = 256

Prompt = str | list[int]


def prompts_of(body: CompletionRequest) -> list[Prompt]:
    """The batch as a list of prompts: a string, a token list, or a list of either."""
    raw = body.prompt
    if isinstance(raw, str):
        prompts: list[Prompt] = [raw]
    elif raw and all(isinstance(p, int) for p in raw):
        prompts = [list(raw)]  # type: ignore[arg-type]
    else:
        prompts = [p if isinstance(p, str) else list(p) for p in raw]  # type: ignore[union-attr]
    if not prompts:
        raise bad_request("prompt is empty; give text, token ids, or a list of either", "prompt")
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise bad_request(f"at most {MAX_BATCH_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise bad_request(
                f"prompt[{i}] is empty; give some text or at least one token id", prompt_param(prompts, i)
            )
    return prompts


def prompt_param(prompts: Sequence[Prompt], index: int) -> str:
    """How errors name one prompt: ``prompt``, or ``prompt[i]`` in a batch."""
    return f"prompt[{index}]" if len(prompts) > 1 else "prompt"


class CompletionsHandler:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.frontend = gateway.host.frontend
        self.tokens = TokenTexts(self.frontend)

    async def __call__(self, body: CompletionRequest, request: Request) -> Response:
        gw = self.gateway
        gw.check_model(body.model)
        check_common(body, self.frontend.vocab_size)
        if body.suffix is not None:
            raise bad_request(
                "suffix (fill-in-the-middle) is not supported; put the text in the prompt", "suffix"
            )
        if body.best_of not in (None, 1):
            raise bad_request(f"best_of={body.best_of} is not supported; send best_of 1", "best_of")
        prompts = prompts_of(body)
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                check_token_ids(prompt, self.frontend.vocab_size, prompt_param(prompts, i))
        engine = gw.host.engine()
        meta = {
            "id": f"cmpl-{secrets.token_hex(16)}",
            "created": int(time.time()),
            "model": gw.config.model_name,
        }
        max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        constraint = output_constraint(body)  # structured outputs (guided_*, response_format, ...)
        if constraint is not None and (engine.config.purpose == "causal_scoring" or max_tokens == 0):
            raise bad_request(
                f"{constraint.field_name} constrains generated text; this request generates none "
                "(max_tokens 0, or a causal_scoring server)",
                constraint.field_name,
            )
        if engine.config.purpose == "causal_scoring":
            return await self._score(engine, body, prompts, max_tokens, meta)
        if body.echo and body.logprobs is not None:
            raise bad_request(
                "prompt log-probs (echo with logprobs) come from the scoring purpose; start a server with "
                "--purpose causal_scoring for them, or drop echo/logprobs",
                "echo",
                code="wrong_purpose",
            )
        if max_tokens == 0:
            return await self._prompt_only(body, prompts, meta)
        return await self._generate(body, prompts, max_tokens, meta, request, constraint)

    # ---- generation purpose ----
    async def _generate(
        self,
        body: CompletionRequest,
        prompts: list[Prompt],
        max_tokens: int,
        meta: dict[str, Any],
        request: Request,
        constraint: OutputConstraint | None,
    ) -> Response:
        engine = self.gateway.host.engine()
        n = choices_of(body, engine.config.max_concurrency)
        capacity = engine.config.max_concurrency + engine.config.queue_capacity
        if len(prompts) * n > capacity:  # the Engine could never hold them all at once: retrying cannot help
            raise bad_request(
                f"{len(prompts)} prompts x n={n} in one request exceed this server's capacity of {capacity} "
                "requests (max_concurrency + queue_capacity); send at most that many choices per request",
                "prompt",
            )
        sampling = sampling_kwargs(body)
        reuse = reuse_fields(request)  # one session key for every prompt of a batch
        top = body.logprobs or 0
        runs: list[EngineRun] = []

        def close_all() -> None:
            for run in runs:
                run.close()

        try:
            # choice i * n + j: prompt i's j-th independent sample (seed + j)
            for i, prompt in enumerate(prompts):
                for seed in choice_seeds(sampling["seed"], n):
                    req = GenerationRequest(
                        prompt=prompt,
                        max_tokens=max_tokens,
                        logprobs=body.logprobs is not None,
                        top_logprobs=top,
                        constraint=constraint,
                        **{**sampling, "seed": seed},
                        **reuse,
                    )
                    runs.append(await self.gateway.submit(req, ENDPOINT, prompt_param(prompts, i)))
            texts = await self._echo_texts(prompts) if body.echo else [""] * len(prompts)
            echoes = [text for text in texts for _ in range(n)]
            if body.stream:
                await unless_disconnected(request, all_or_none(r.wait_start() for r in runs))
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                skip_special = sampling["skip_special_tokens"]
                offsets = (
                    [TextOffsets(self.tokens, len(e), skip_special) for e in echoes]
                    if body.logprobs is not None
                    else None
                )
                events = self._chunks(runs, echoes, meta, include_usage, offsets)
                return EventStreamResponse(events, close_all)
            results = await unless_disconnected(request, all_or_none(r.collect() for r in runs))
        except ClientGone:
            close_all()
            return ServeError(499, "client closed the request").response()
        except BaseException:
            close_all()
            raise
        close_all()
        skip_special = sampling["skip_special_tokens"]
        choices = [
            self._choice(
                i,
                echoes[i],
                r.text,
                r.reasoning_text,
                r.logprobs if body.logprobs is not None else None,
                r.finish_reason,
                skip_special,
            )
            for i, r in enumerate(results)
        ]
        return JSONBody(self._body(meta, choices, usage_out(sum_usage(r.usage for r in results))))

    def _choice(
        self,
        index: int,
        echo: str,
        text: str,
        reasoning: str,
        logprobs: Sequence[TokenLogprob] | None,
        finish: str | None,
        skip_special_tokens: bool = True,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "text": echo + text,
            "logprobs": None,
            "finish_reason": finish,
        }
        if logprobs is not None:
            tokens = [self.tokens.text(lp.token_id) for lp in logprobs]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [self.tokens.top_dict(lp) for lp in logprobs],
                "text_offset": TextOffsets(self.tokens, len(echo), skip_special_tokens).feed(
                    [lp.token_id for lp in logprobs]
                ),
            }
        if reasoning:
            choice["reasoning_content"] = reasoning
        return choice

    @staticmethod
    def _body(meta: dict[str, Any], choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return {**meta, "object": "text_completion", "choices": choices, "usage": usage}

    async def _echo_texts(self, prompts: list[Prompt]) -> list[str]:
        return [
            p if isinstance(p, str) else await anyio.to_thread.run_sync(self.frontend.decode, p)
            for p in prompts
        ]

    async def _prompt_ids(self, prompts: list[Prompt]) -> list[tuple[int, ...]]:
        def ids() -> list[tuple[int, ...]]:
            out = []
            for i, p in enumerate(prompts):
                try:
                    out.append(
                        tuple(self.frontend.encode(p))
                        if isinstance(p, str)
                        else tuple(self.frontend.prepare_tokens(p).token_ids)
                    )
                except ValueError as exc:
                    raise bad_request(f"prompt[{i}]: {exc}", prompt_param(prompts, i)) from None
            return out

        return await anyio.to_thread.run_sync(ids)

    async def _prompt_only(
        self, body: CompletionRequest, prompts: list[Prompt], meta: dict[str, Any]
    ) -> Response:
        """``max_tokens`` 0: nothing to generate, so no Engine request; the prompt is echoed (or not)."""
        if body.stream:
            raise bad_request("max_tokens 0 generates nothing to stream; send stream: false", "stream")
        ids = await self._prompt_ids(prompts)
        echoes = await self._echo_texts(prompts) if body.echo else [""] * len(prompts)
        n = body.n or 1  # n identical empty choices per prompt
        choices = [
            self._choice(i * n + j, echoes[i], "", "", None, "length")
            for i in range(len(prompts))
            for j in range(n)
        ]
        self.gateway.count(ENDPOINT, "length")
        usage = usage_dict(n * sum(len(i) for i in ids), 0)
        return JSONBody(self._body(meta, choices, usage))

    async def _chunks(
        self,
        runs: list[EngineRun],
        echoes: list[str],
        meta: dict[str, Any],
        include_usage: bool,
        offsets: list[TextOffsets] | None,
    ) -> AsyncIterator[bytes]:
        """The stream; ``offsets`` (one per choice, when logprobs were asked for) place each chunk's
        tokens in the choice's whole text, whatever part of it a stop-string check still holds back."""
        base = {**meta, "object": "text_completion"}
        if include_usage:
            base["usage"] = None
        logprobs = offsets is not None

        def chunk(
            index: int,
            text: str,
            finish: str | None = None,
            lps: Sequence[TokenLogprob] | None = None,
            reasoning: str = "",
        ) -> bytes:
            choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            if reasoning:
                choice["reasoning_content"] = reasoning
            if lps is not None:
                assert offsets is not None
                choice["logprobs"] = {
                    "tokens": [self.tokens.text(lp.token_id) for lp in lps],
                    "token_logprobs": [lp.logprob for lp in lps],
                    "top_logprobs": [self.tokens.top_dict(lp) for lp in lps],
                    "text_offset": offsets[index].feed([lp.token_id for lp in lps]),
                }
            return sse({**base, "choices": [choice]})

        for i, echo in enumerate(echoes):
            if echo:
                yield chunk(i, echo)
        usages: list[Usage] = []
        async for index, event in merged(runs):
            if isinstance(event, GenerationDelta):
                if event.text or event.reasoning_text or (logprobs and event.logprobs):
                    lps = event.logprobs if logprobs else None
                    yield chunk(index, event.text, lps=lps, reasoning=event.reasoning_text)
                continue
            if event.error is not None or event.finish_reason in ("error", "cancelled"):
                yield sse(runs[index].error_of(event).body())
                yield SSE_DONE
                return
            yield chunk(index, "", event.finish_reason)
            usages.append(event.usage)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage_out(sum_usage(usages))})
        yield SSE_DONE

    # ---- causal_scoring purpose ----
    async def _score(
        self,
        engine: Engine,
        body: CompletionRequest,
        prompts: list[Prompt],
        max_tokens: int,
        meta: dict[str, Any],
    ) -> Response:
        """Prompt log-probs (``echo`` + ``logprobs``, ``max_tokens`` 0) from ``Engine.score``; with
        ``max_tokens`` 1 the model's greedy next token is appended as the one completion token, which is
        the shape lm-eval-harness ``local-completions`` sends for log-likelihoods (it drops that entry)."""
        if not body.echo or body.logprobs is None or max_tokens not in (0, 1):
            raise bad_request(
                "this server was started with --purpose causal_scoring: it answers prompt log-prob requests "
                "only (echo: true, logprobs: N, max_tokens: 0, or max_tokens: 1 with temperature: 0 to "
                "append the greedy next token) and generates nothing else; start it with --purpose "
                "generation to generate",
                "max_tokens" if body.echo and body.logprobs is not None else "echo",
                code="wrong_purpose",
            )
        if body.stream:
            raise bad_request("scoring answers in one piece; send stream: false", "stream")
        if body.n not in (None, 1):
            raise bad_request("scoring has one answer per prompt; send n: 1", "n")
        if max_tokens == 1:
            self._check_greedy_token(body)
        score = functools.partial(engine.score, top_n=body.logprobs, next_token=max_tokens == 1)
        try:
            scores: list[ScoreResult] = await anyio.to_thread.run_sync(score, prompts)
        except NInferError as exc:
            error = self.gateway.engine_error(exc, "prompt")
            self.gateway.count(ENDPOINT, error.outcome)
            error.counted = True
            raise error from None
        echoes = await self._echo_texts(prompts)
        choices = [self._scored_choice(i, echoes[i], s, body) for i, s in enumerate(scores)]
        n_tokens = sum(len(s.token_ids) for s in scores)
        generated = sum(s.next_token is not None for s in scores)
        self.gateway.metrics.scored_tokens.inc(n_tokens)
        self.gateway.count(ENDPOINT, "length")
        return JSONBody(self._body(meta, choices, usage_dict(n_tokens, generated)))

    def _check_greedy_token(self, body: CompletionRequest) -> None:
        """The appended token is the argmax of the model's distribution: refuse requests that ask for
        something else rather than answer them differently from a generation server."""
        # a scoring Engine plans no generation, so resolve the temperature here by the Engine's own rule
        defaults = self.frontend.generation_defaults
        temperature = resolve_sampling(defaults, temperature=body.temperature)["temperature"]
        if temperature != 0:
            raise bad_request(
                "max_tokens: 1 on a causal_scoring server appends the model's greedy next token; send "
                f"temperature: 0 (this request would sample at temperature {temperature})",
                "temperature",
            )
        if body.stop or body.stop_token_ids:
            raise bad_request(
                "a causal_scoring server applies no stop sequences to the greedy token it appends; remove "
                "stop and stop_token_ids",
                "stop",
            )

    def _scored_choice(
        self, index: int, echo: str, score: ScoreResult, body: CompletionRequest
    ) -> dict[str, Any]:
        """Prompt tokens with their log-probs and ``top_logprobs`` (the alternatives plus the token
        itself); the first token has no context (null), as in OpenAI's API. A predicted next token is
        appended as the one completion token (its text too, unless it is a skipped special token)."""
        entries: list[TokenLogprob | None] = [
            None if lp is None else TokenLogprob(tid, lp, score.top_logprobs[i] if score.top_logprobs else ())
            for i, (tid, lp) in enumerate(zip(score.token_ids, score.logprobs))
        ]
        text, finish = echo, "length"
        if score.next_token is not None:
            entries.append(score.next_token)
            token_id = score.next_token.token_id
            skip_special = True if body.skip_special_tokens is None else body.skip_special_tokens
            text += self.frontend.decode([token_id], skip_special_tokens=skip_special)
            if token_id in self.frontend.eos_token_ids and not body.ignore_eos:
                finish = "stop"
        ids = [*score.token_ids, *([] if score.next_token is None else [score.next_token.token_id])]
        tokens = [self.tokens.text(t) for t in ids]
        # the echo is the prompt decoded with its special tokens; the appended token starts where it ends
        offsets = TextOffsets(self.tokens, 0, skip_special_tokens=False).feed(score.token_ids)
        if score.next_token is not None:
            offsets.append(len(echo))
        return {
            "index": index,
            "text": text,
            "logprobs": {
                "tokens": tokens,
                "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else self.tokens.top_dict(e) for e in entries],
                "text_offset": offsets,
            },
            "finish_reason": finish,
        }
