"""Qwen3.6 family Frontend: tokenizer, chat template, prompts and output semantics
(detokenization, stop strings/tokens, thinking/content channels, Qwen3-Coder XML tool calls)."""

from ninfer.targets.qwen3_6.frontend.chat_template import ChatTemplate, ChatTemplateError
from ninfer.targets.qwen3_6.frontend.frontend import Frontend
from ninfer.targets.qwen3_6.frontend.output import FORCED_THINK_CLOSE_TEXT, OutputSession
from ninfer.targets.qwen3_6.frontend.prompt import prompt_digest, prompt_opens_thinking
from ninfer.targets.qwen3_6.frontend.tokenizer import TextTokenizer
from ninfer.targets.qwen3_6.frontend.tool_calls import convert_param_value, parse_tool_call
from ninfer.targets.qwen3_6.frontend.types import (
    FrontendResources,
    OutputDelta,
    OutputOptions,
    OutputPreview,
    PreparedPrompt,
    ToolCall,
    ToolCallDelta,
)
from ninfer.targets.qwen3_6.variant import SpecialTokens

__all__ = [
    "FORCED_THINK_CLOSE_TEXT",
    "ChatTemplate",
    "ChatTemplateError",
    "Frontend",
    "FrontendResources",
    "OutputDelta",
    "OutputOptions",
    "OutputPreview",
    "OutputSession",
    "PreparedPrompt",
    "SpecialTokens",
    "TextTokenizer",
    "ToolCall",
    "ToolCallDelta",
    "convert_param_value",
    "parse_tool_call",
    "prompt_digest",
    "prompt_opens_thinking",
]
