"""OpenAI-style messages/JSON to the Frontend's owning input shape (media acquired and decoded)."""

from ninfer.product.prompt_input.messages import (
    DEFAULT_MAX_IMAGES,
    PromptInputError,
    acquire_message_media,
    image_part,
)

__all__ = ["DEFAULT_MAX_IMAGES", "PromptInputError", "acquire_message_media", "image_part"]
