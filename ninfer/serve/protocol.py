"""OpenAI-compatible request and response schemas (pydantic), the single source of the OpenAPI document.

Requests are validated here for shape and ranges; every violation becomes a 400 in the OpenAI error
shape (see ``errors.py``). A request's top-level fields are a closed list: an unknown one is a 400
naming it (``extra="forbid"``), so no field is ever silently ignored, except the few bookkeeping fields
OpenAI clients send that cannot change the answer (``ClientFields``: ``user``, ``metadata``, ``store``,
...), accepted and ignored. Nested objects (messages, tools) ignore unknown keys: clients echo back the
assistant messages they received, with fields such as ``refusal`` and ``annotations``. Semantic checks
that need the model (context length, vocabulary, template) happen in the Engine/Frontend and come back
as ``RequestRejected``.

Response models document the wire format in ``/openapi.json``; handlers build the same dicts directly
(tests validate real responses against these models so the two cannot drift).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

MAX_TOP_LOGPROBS = 20
SEED_LIMIT = 2**63

TokenId = Annotated[int, Field(ge=0)]


class _Model(BaseModel):
    # NaN/inf never reach the Engine; unknown OpenAI fields are ignored rather than refused
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# ---------------------------------------------------------------------------------------------------
# Chat messages
# ---------------------------------------------------------------------------------------------------


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURL(_Model):
    url: str
    detail: str | None = None


class ImagePart(_Model):
    """An image by URL: ``data:``, ``http(s)`` (``--allow-remote-media``) or a path under ``--media-root``;
    or the URL string itself. ``detail`` is accepted and ignored (the preprocessor picks the resolution).
    The chat handler acquires it (``ninfer.serve.images``); other endpoints refuse it."""

    type: Literal["image_url"]
    image_url: ImageURL | str


class MediaPart(_Model):
    """Other media part types (audio, video, files): refused with a 400 naming the part."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_audio", "video_url", "image", "video", "file", "input_image"]


ContentPart = Annotated[TextPart | ImagePart | MediaPart, Field(discriminator="type")]
Content = str | list[ContentPart]


class FunctionCallIn(_Model):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class SystemMessage(_Model):
    role: Literal["system", "developer"]  # developer is OpenAI's newer name for system
    content: Content
    name: str | None = None


class UserMessage(_Model):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Model):
    role: Literal["assistant"]
    content: Content | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # alias some clients use for reasoning_content
    tool_calls: list[ToolCallIn] | None = None
    name: str | None = None


class ToolMessage(_Model):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


# ---------------------------------------------------------------------------------------------------
# Tools and options
# ---------------------------------------------------------------------------------------------------


class FunctionDef(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Model):
    include_usage: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _Request(_Model):
    """A request body: unknown top-level fields are refused (400 naming the field)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


IGNORED = "accepted and ignored (bookkeeping that cannot change the answer)"


class ClientFields(_Request):
    """Fields OpenAI clients send that NInfer accepts and ignores."""

    user: Any = Field(None, description=IGNORED)
    metadata: Any = Field(None, description=IGNORED)
    store: Any = Field(None, description=IGNORED)
    service_tier: Any = Field(None, description=IGNORED)
    safety_identifier: Any = Field(None, description=IGNORED)
    prompt_cache_key: Any = Field(None, description=IGNORED)
    priority: Any = Field(None, description=IGNORED + "; vLLM's scheduling priority, NInfer's queue is FIFO")


# ---------------------------------------------------------------------------------------------------
# Structured outputs (docs/structured-outputs.md): vLLM / SGLang request extensions, in one block
# ---------------------------------------------------------------------------------------------------


class StructuredOutputsIn(_Model):
    """vLLM's ``structured_outputs`` object: give one of its fields."""

    json_value: dict[str, Any] | str | None = Field(None, alias="json")  # a JSON schema (or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF / EBNF (``::=`` rules)
    json_object: bool | None = None
    structural_tag: Any = None  # refused (not supported)
    whitespace_pattern: str | None = None  # refused (not supported)


class StructuredOutputFields(_Request):
    """The guided-decoding fields vLLM and SGLang accept on chat and completions (the older ``guided_*``
    names and the newer ``structured_outputs`` object); each is constrained or refused, never ignored."""

    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # refused (not supported)
    guided_decoding_backend: str | None = None  # accepted for "llguidance" / "auto" only
    structured_outputs: StructuredOutputsIn | None = None
    response_format: ResponseFormat | None = None


class SamplingFields(ClientFields):
    """Sampling fields shared by chat and completions (vLLM conventions for the extensions)."""

    temperature: float | None = Field(None, ge=0, description="0 = greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1 = disabled")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, description="1 = off")
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    n: int | None = Field(
        None, ge=1, description="independent choices of one prompt, up to the server's max_concurrency"
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit"
    )
    min_tokens: int | None = Field(
        None, ge=0, description="end-of-sequence and stop tokens held back until then"
    )
    prompt_logprobs: int | None = Field(
        None, description="refused: prompt log-probs come from causal_scoring"
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    model: str | None = None


class ChatCompletionRequest(SamplingFields, StructuredOutputFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_budget: int | None = Field(None, ge=1, description="cap on reasoning tokens, >= 1 (extension)")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="none: thinking off (enable_thinking false); any other value: thinking on"
    )
    continue_final_message: bool | None = Field(
        None, description="continue the final assistant message instead of starting a new one (vLLM)"
    )
    add_generation_prompt: bool | None = Field(
        None, description="vLLM: default true; false with continue_final_message"
    )
    chat_template: str | None = Field(None, description="refused: the package's own template is used")


PromptInput = str | list[TokenId] | list[str] | list[Annotated[list[TokenId], Field(min_length=1)]]


class CompletionRequest(SamplingFields, StructuredOutputFields):
    prompt: PromptInput
    max_tokens: int | None = Field(None, ge=0, description="default 16; 0 with echo returns the prompt")
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, description="only 1 (n independent samples: use n)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_content_parts(cls, prompt: Any) -> Any:
        """A prompt of chat content parts (images, say) gets a message that says where they go."""
        if isinstance(prompt, list) and any(isinstance(p, dict) for p in prompt):
            raise PydanticCustomError(
                "content_parts",
                "/v1/completions takes text or token ids, which hold no images; send content parts "
                "(text, image_url) as messages to /v1/chat/completions",
            )
        return prompt


class TokenizeRequest(_Request):
    """Either ``prompt`` (raw text) or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = None  # accepted for vLLM compatibility; Qwen adds no BOS/EOS
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------------------------------------------
# Responses (documentation of the wire format; see module docstring)
# ---------------------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    request_id: str | None = None  # the answer's X-Request-Id


class ErrorResponse(BaseModel):
    error: ErrorDetail


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    completion_tokens_details: dict[str, int] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = []


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut


class ToolCallDeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallDeltaFunction


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    """One ``data:`` event of a streamed chat completion (the stream ends with ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageOut | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    reasoning_content: str | None = None


class CompletionResponse(BaseModel):
    """Also the shape of each streamed ``data:`` event (``object`` is ``text_completion`` in both)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None  # None while the Engine loads; the window on a scoring server
    score_window: int | None = None  # causal_scoring servers only: tokens per scoring window
    score_stride: int | None = None  # causal_scoring servers only: tokens a window advances by


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    eos_token: str
    chat_template: str
    model_max_length: int | None
    vocab_size: int


class PrefixCacheReset(BaseModel):
    object: Literal["prefix_cache.reset"] = "prefix_cache.reset"
    dropped: int
    checkpoints: int


class ReadyResponse(BaseModel):
    status: str
    reason: str | None = None


class VersionInfo(BaseModel):
    version: str
