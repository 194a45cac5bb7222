"""The Qwen3.6 family Frontend: prompts in (text, tokens, chat), output sessions out.

Built once per loaded artifact from its frontend resources; shared by every request. ``prepare_*`` are
pure and thread-safe; an OutputSession belongs to one request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ninfer.targets.qwen3_6.frontend.chat_template import ChatTemplate
from ninfer.targets.qwen3_6.frontend.output import OutputSession
from ninfer.targets.qwen3_6.frontend.prompt import make_prepared_prompt
from ninfer.targets.qwen3_6.frontend.tokenizer import TextTokenizer
from ninfer.targets.qwen3_6.frontend.types import FrontendResources, OutputOptions, PreparedPrompt
from ninfer.targets.qwen3_6.variant import SpecialTokens

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


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class Frontend:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        chat_template: ChatTemplate,
        special: SpecialTokens,
        generation_config: Mapping[str, Any],
        preprocessor_config: Mapping[str, Any] | None = None,
    ) -> None:
        tokenizer.check_special(special)
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special = special
        self.preprocessor_config = dict(preprocessor_config) if preprocessor_config is not None else None
        eos = list(special.eos)
        for i in _as_id_list(generation_config.get("eos_token_id")):
            if i not in eos:
                eos.append(i)
        tokenizer.validate_ids(eos)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.generation_defaults: dict[str, Any] = {
            k: generation_config[k] for k in GENERATION_DEFAULT_KEYS if generation_config.get(k) is not None
        }

    @classmethod
    def from_resources(cls, res: FrontendResources, special: SpecialTokens) -> Frontend:
        """Raises ValueError if the tokenizer's special-token ids differ from the package's."""
        return cls(
            TextTokenizer(res.tokenizer_json),
            ChatTemplate(res.chat_template),
            special,
            res.generation_config,
            res.preprocessor_config,
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
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text. ``preserve_thinking=None`` leaves it undefined: the 3.6 template then
        drops past reasoning, the 3.8 template keeps it (their own defaults). Raises ChatTemplateError."""
        if preserve_thinking is not None:
            template_kwargs["preserve_thinking"] = preserve_thinking
        return self.chat_template.render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            **template_kwargs,
        )

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
        """Render (generation prompt on unless told otherwise) and encode. Raises ValueError for media
        content: the vision preprocessor that expands image/video pads is not part of this Frontend yet."""
        template_kwargs.setdefault("add_generation_prompt", True)
        ids = self.encode(self.render_chat(messages, tools=tools, **template_kwargs))
        media = {self.special.image_pad, self.special.video_pad}
        if any(i in media for i in ids):
            raise ValueError(
                "image/video content needs vision preprocessing, which this Frontend does not do yet"
            )
        return make_prepared_prompt(ids, self.special, tools=tools, chat=True)

    # ---- output -------------------------------------------------------------------------------
    def new_output_session(self, prompt: PreparedPrompt, options: OutputOptions) -> OutputSession:
        """A session for one request. Reasoning/tool-call parsing left ``None`` in ``options`` is decided
        from the prompt: reasoning for a chat prompt or one that opens ``<think>``, tool calls when it
        was prepared with tools."""
        return OutputSession(self.tokenizer, self.special, prompt, options, self.eos_token_ids)
