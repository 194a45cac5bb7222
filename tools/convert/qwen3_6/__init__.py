"""Qwen3.5/3.6-family converter: a Hugging Face checkpoint folder -> one `.ninfer` artifact.

``convert(hf_dir, out_path, dtype=..., package=...)`` is the API behind ``ninfer convert``.
"""

from .convert import CONVERTER_VERSION, convert
from .plan import canonical_name
from .source import ConvertError

__all__ = ["CONVERTER_VERSION", "ConvertError", "canonical_name", "convert"]
