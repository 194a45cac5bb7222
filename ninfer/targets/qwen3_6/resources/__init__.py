"""The real Qwen3.6 frontend resources, shipped as package data.

``tokenizer.json`` (the 248,320-token Qwen3.6 vocabulary with the Qwen special tokens) and the chat
templates ``qwen3_6.jinja`` / ``qwen3_8.jinja`` let code that has no artifact build the real Frontend of
the Qwen packages: ``ninfer bench --synthetic`` and the tests. An artifact always carries its own copies
and those are what an Engine opened from it uses; nothing here overrides them. This folder is a Python
package so that setuptools ships its ``*.json``/``*.jinja`` files (package data is per package).
"""

from __future__ import annotations

from pathlib import Path

RESOURCE_DIR = Path(__file__).resolve().parent
TOKENIZER_JSON = RESOURCE_DIR / "tokenizer.json"
CHAT_TEMPLATES = ("qwen3_6", "qwen3_8")


def tokenizer_json() -> bytes:
    """The real Qwen3.6 ``tokenizer.json`` bytes."""
    return TOKENIZER_JSON.read_bytes()


def chat_template(name: str) -> str:
    """The Jinja text of chat template ``name`` (a `Package.chat_template`: ``qwen3_6`` or ``qwen3_8``)."""
    if name not in CHAT_TEMPLATES:
        raise ValueError(f"no bundled chat template {name!r}; bundled: {', '.join(CHAT_TEMPLATES)}")
    return (RESOURCE_DIR / f"{name}.jinja").read_text(encoding="utf-8")
