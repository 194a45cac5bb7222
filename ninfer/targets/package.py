"""What a registered package is: identity, exact dims and storage facts (data only, no algorithms).

The family (``ninfer/targets/qwen3_6``) owns every algorithm; a package names itself, fixes its
`Variant`, and says which storage profiles and frontend defaults it carries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ninfer.targets.qwen3_6.variant import Variant

# storage profile -> torch dtype name of the stored (non-fp32-pinned) tensors
STORAGE_PROFILES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class Package:
    name: str
    variant: Variant
    description: str
    family: str = "qwen3_6"
    # the HF model_type this package's checkpoints carry (Qwen3.8 reuses the 3.6 architecture
    # under its own model_type, so dims alone cannot tell 3.6-27B and 3.8-27B apart)
    hf_model_type: str = "qwen3_5"
    chat_template: str = "qwen3_6"
    test_only: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def identity(self, storage_profile: str) -> dict[str, str]:
        return {"family": self.family, "package": self.name, "storage_profile": storage_profile}

    @property
    def has_vision(self) -> bool:
        """Whether the package binds an image tower (requests may carry images)."""
        return self.variant.vision is not None

    @property
    def has_mtp(self) -> bool:
        """Whether the package binds a multi-token-prediction head (``speculative="mtp:K"`` can draft)."""
        return bool(self.variant.mtp_num_hidden_layers)

    def summary_lines(self) -> list[str]:
        """The package's architecture in words (the family's summary of its dims)."""
        return self.variant.summary_lines()

    @property
    def parameter_count(self) -> int:
        """Parameters in its weight schema (text, MTP and vision)."""
        from ninfer.targets.qwen3_6.weights import weight_schema

        return sum(math.prod(spec.shape) for spec in weight_schema(self.variant))

    def hf_config(self) -> dict[str, Any]:
        cfg = self.variant.hf_config()
        if self.hf_model_type not in ("qwen3_5", "qwen3_5_moe"):
            cfg["model_type"] = self.hf_model_type
            cfg["text_config"]["model_type"] = f"{self.hf_model_type}_text"
        return cfg
