"""The Qwen3.6 family Frontend: prompts in (text, tokens, chat), output sessions out.

Built once per loaded artifact from its frontend resources; shared by every request. ``prepare_*`` are
pure and thread-safe; an OutputSession belongs to one request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ninfer.media.decode import DecodedImage
from ninfer.targets.qwen3_6.frontend.chat_template import ChatTemplate, ChatTemplateError
from ninfer.targets.qwen3_6.frontend.constraint import ConstraintCompiler, GrammarConstraint
from ninfer.targets.qwen3_6.frontend.mrope import mrope_positions
from ninfer.targets.qwen3_6.frontend.output import OutputSession
from ninfer.targets.qwen3_6.frontend.prompt import TurnMarkers, chat_boundaries, make_prepared_prompt
from ninfer.targets.qwen3_6.frontend.tokenizer import TextTokenizer
from ninfer.targets.qwen3_6.frontend.types import (
    FrontendResources,
    OutputOptions,
    PreparedImage,
    PreparedPrompt,
)
from ninfer.targets.qwen3_6.frontend.vision import ImageProcessorConfig, preprocess_image
from ninfer.targets.qwen3_6.variant import SpecialTokens, VisionDims

# generation_config.json keys that are sampling defaults a request may inherit
GENERATION_DEFAULT_KEYS = (
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_new_tokens",
)


_ASSISTANT_HEADER = "<|im_start|>assistant\n"
_TURN_END = "<|im_end|>"


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


END_OF_TURN = "<|im_end|>"  # how the chat template ends every message


class Frontend:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        chat_template: ChatTemplate,
        special: SpecialTokens,
        generation_config: Mapping[str, Any],
        preprocessor_config: Mapping[str, Any] | None = None,
        vision: VisionDims | None = None,
    ) -> None:
        """``preprocessor_config`` None: the family's published image preprocessing (`FAMILY_DEFAULTS`).
        ``vision``: the package's tower dims, checked against the preprocessor's patch/merge sizes."""
        tokenizer.check_special(special)
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special = special
        self.preprocessor_config = dict(preprocessor_config) if preprocessor_config is not None else None
        self.image_config = ImageProcessorConfig.from_json(self.preprocessor_config, vision)
        eos = list(special.eos)
        for i in _as_id_list(generation_config.get("eos_token_id")):
            if i not in eos:
                eos.append(i)
        tokenizer.validate_ids(eos)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.generation_defaults: dict[str, Any] = {
            k: generation_config[k] for k in GENERATION_DEFAULT_KEYS if generation_config.get(k) is not None
        }
        self.turn_markers = TurnMarkers.encoded(tokenizer.encode)
        # structured outputs: the grammar engine's tokenizer is built on the first constrained request
        self.constraints = ConstraintCompiler(tokenizer.json_text, self.eos_token_ids)

    @classmethod
    def from_resources(
        cls, res: FrontendResources, special: SpecialTokens, vision: VisionDims | None = None
    ) -> Frontend:
        """Raises ValueError if the tokenizer's special-token ids differ from the package's, or the
        preprocessor config is unusable (or disagrees with ``vision``)."""
        return cls(
            TextTokenizer(res.tokenizer_json),
            ChatTemplate(res.chat_template),
            special,
            res.generation_config,
            res.preprocessor_config,
            vision,
        )

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows (the model's embedding may have padding rows beyond these)."""
        return self.tokenizer.vocab_size

    # ---- text -----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Raw text to ids: no special tokens added; special-token strings in the text become those tokens."""
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def min_tokens(self, n_bytes: int) -> int:
        """Fewest tokens a text of ``n_bytes`` UTF-8 bytes encodes to (a bound gateways check before
        tokenizing an absurdly long input)."""
        return self.tokenizer.min_tokens(n_bytes)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        preserve_thinking: bool | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text. ``preserve_thinking=None`` leaves it undefined: the 3.6 template then
        drops past reasoning, the 3.8 template keeps it (their own defaults). ``continue_final_message``
        (vLLM's meaning): the final message, an assistant one, is left open (its end of turn cut) for
        the model to continue; there is no generation prompt then. Raises ChatTemplateError, or
        ValueError for a continuation the conversation cannot have."""
        if preserve_thinking is not None:
            template_kwargs["preserve_thinking"] = preserve_thinking
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message cannot be used with add_generation_prompt")
            if not messages or messages[-1].get("role") != "assistant":
                raise ValueError("continue_final_message needs an assistant message last, to continue it")
        text = self.chat_template.render(
            _split_images(messages, strict=False)[0],  # a decoded image renders as its vision tokens
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            **template_kwargs,
        )
        if continue_final_message:
            end = text.rstrip("\n")
            if not end.endswith(END_OF_TURN):
                raise ValueError(f"the chat template does not end the final message with {END_OF_TURN}")
            text = end[: -len(END_OF_TURN)]
        return text

    # ---- prompts ------------------------------------------------------------------------------
    def prepare_text(self, text: str) -> PreparedPrompt:
        return make_prepared_prompt(self.encode(text), self.special)

    def prepare_tokens(self, ids: Sequence[int]) -> PreparedPrompt:
        """Raises ValueError naming the first id outside the vocabulary."""
        return make_prepared_prompt(self.tokenizer.validate_ids(ids), self.special)

    def prepare_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> PreparedPrompt:
        """Render (generation prompt on unless told otherwise), encode, and expand images.

        Image content parts are ``{"type": "image", "image": DecodedImage}`` (what
        ``ninfer.product.prompt_input.acquire_message_media`` makes of OpenAI ``image_url`` parts). The
        template renders ``<|vision_start|><|image_pad|><|vision_end|>`` for each; the one pad becomes
        t*h*w/merge^2 pads, and the prompt carries each image's pixel values, its pad span, the M-RoPE
        positions and their decode delta. Raises ValueError for an unacquired image, video content, a
        prompt whose text holds image/video pad tokens itself, or an image the preprocessor refuses.
        """
        template_kwargs.setdefault("add_generation_prompt", True)
        render, decoded = _split_images(messages)
        ids = self.encode(self.render_chat(render, tools=tools, **template_kwargs))
        pad = self.special.image_pad
        if self.special.video_pad in ids:
            raise ValueError("video input is not supported (the prompt holds a <|video_pad|> token)")
        pads = [pos for pos, i in enumerate(ids) if i == pad]
        if len(pads) != len(decoded):
            raise ValueError(
                f"the rendered prompt has {len(pads)} <|image_pad|> tokens for {len(decoded)} images: "
                "text content must not contain vision tokens"
            )
        if not decoded:
            return make_prepared_prompt(
                ids,
                self.special,
                tools=tools,
                chat=True,
                boundaries=chat_boundaries(tuple(ids), self.turn_markers),
                template_kwargs=template_kwargs,
            )
        merge = self.image_config.merge_size
        expanded: list[int] = []
        images: list[PreparedImage] = []
        cursor = 0
        for pos, image in zip(pads, decoded):
            processed = preprocess_image(image, self.image_config)
            n = processed.num_tokens(merge)
            expanded += ids[cursor:pos]
            images.append(
                PreparedImage(processed.digest, processed.pixel_values, processed.grid_thw, len(expanded), n)
            )
            expanded += [pad] * n
            cursor = pos + 1
        expanded += ids[cursor:]
        spans = [(image.token_offset, image.grid_thw) for image in images]
        mrope = mrope_positions(len(expanded), spans, merge)
        return make_prepared_prompt(
            expanded,
            self.special,
            tools=tools,
            chat=True,
            images=images,
            mrope=mrope,
            boundaries=chat_boundaries(tuple(expanded), self.turn_markers, images),
            template_kwargs=template_kwargs,
        )

    # ---- output -------------------------------------------------------------------------------
    def new_output_session(self, prompt: PreparedPrompt, options: OutputOptions) -> OutputSession:
        """A session for one request. Reasoning/tool-call parsing left ``None`` in ``options`` is decided
        from the prompt: reasoning for a chat prompt or one that opens ``<think>``, tool calls when it
        was prepared with tools. A chat prompt with a generation prompt also gets the history renderer,
        which decides the output's reuse boundary (`OutputPreview.boundaries`)."""
        kwargs = getattr(prompt, "template_kwargs", None)
        history = None
        if getattr(prompt, "chat", False) and kwargs is not None and kwargs.get("add_generation_prompt"):

            def history(message: Mapping[str, Any], tool_results_follow: bool) -> str:
                return self.history_turn_text(message, tool_results_follow, kwargs)

        session = OutputSession(self.tokenizer, self.special, prompt, options, self.eos_token_ids, history)
        requested = getattr(options, "constraint", None)
        if requested is not None:  # compiled (or taken from the cache) once; ConstraintInvalid if bad
            matcher = self.constraints.matcher(requested, getattr(prompt, "tools", None))
            stops = set(getattr(options, "stop_token_ids", ()))
            if not getattr(options, "ignore_eos", False):
                stops.update(self.eos_token_ids)
            session.constraint = GrammarConstraint(
                matcher,
                self.constraints.mask_words,
                stops,
                in_reasoning=prompt.opens_thinking,
                think_close=self.special.think_close,
                eos_ids=self.eos_token_ids,
            )
        return session

    def history_turn_text(
        self, message: Mapping[str, Any], tool_results_follow: bool, template_kwargs: Mapping[str, Any]
    ) -> str:
        """The text a later prompt renders for assistant ``message`` in the place of this turn, from its
        ``<|im_start|>`` through its ``<|im_end|>``; "" if the template refuses it.

        How the Qwen templates render an assistant message depends only on the message, the template
        variables and its place relative to the last user query (reasoning is kept after it, or always
        with ``preserve_thinking``; the tool definitions only shape the system preamble), so a probe
        conversation stands for the real history: a user query, the message, then what follows it next
        turn (tool results after tool calls, else the next user query)."""
        follow = {"role": "tool" if tool_results_follow else "user", "content": "."}
        kwargs = {k: v for k, v in template_kwargs.items() if k != "add_generation_prompt"}
        try:  # through render_chat: the variables get the same treatment as the prompt's
            text = self.render_chat(
                [{"role": "user", "content": "."}, message, follow], add_generation_prompt=False, **kwargs
            )
        except ChatTemplateError:
            return ""
        start = text.find(_ASSISTANT_HEADER)
        end = text.find(_TURN_END, start) if start >= 0 else -1
        return text[start : end + len(_TURN_END)] if end >= 0 else ""


def _split_images(
    messages: Sequence[Mapping[str, Any]], strict: bool = True
) -> tuple[list[Any], list[DecodedImage]]:
    """Messages for the template (each decoded image part replaced by ``{"type": "image"}``, which the
    template renders as vision tokens) and the images in rendering order (message order, part order).
    ``strict``: refuse video parts and image parts that are not decoded (for prompts, not renders)."""
    render: list[Any] = []
    images: list[DecodedImage] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            render.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, Mapping):
                kind = part.get("type")
                image = part.get("image")
                if isinstance(image, DecodedImage) and kind in (None, "image"):
                    images.append(image)
                    parts.append({"type": "image"})
                    continue
                if strict:
                    _refuse_unusable_media(part, f"messages[{i}].content[{j}]")
            parts.append(part)
        render.append({**message, "content": parts})
    return render, images


def _refuse_unusable_media(part: Mapping[str, Any], where: str) -> None:
    kind = part.get("type")
    if kind in ("video", "video_url") or "video" in part or "video_url" in part:
        raise ValueError(f"{where}: video input is not supported")
    if kind in ("image", "image_url") or "image" in part or "image_url" in part:
        raise ValueError(
            f"{where}: the image must be acquired and decoded first "
            "(ninfer.product.prompt_input.acquire_message_media gives a DecodedImage)"
        )
