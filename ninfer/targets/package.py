"""What a registered package is: identity, exact dims and storage facts (data only, no algorithms).

The family (``ninfer/targets/qwen3_6``) owns every algorithm; a package names itself, fixes its
`Variant`, and says which storage profiles and frontend defaults it carries.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal

from ninfer.targets.qwen3_6.variant import DFlashDims, Variant

# storage profile -> torch dtype name of the stored (non-fp32-pinned) tensors
STORAGE_PROFILES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# Features a checkpoint of a package may lack (a text-only export, a quantizer's export without MTP):
# its artifact then binds the package with the feature off. The text model is never optional. A DFlash
# drafter is not one of them: it is a checkpoint of its own, which an artifact carries only when it was
# converted with one (`Package.drafter`, `with_drafter`).
OptionalFeature = Literal["vision", "mtp"]
OPTIONAL_FEATURES: tuple[OptionalFeature, ...] = ("vision", "mtp")
# what each feature's weights are called in a Hugging Face checkpoint, and what turning it off refuses
FEATURE_WEIGHTS: dict[str, str] = {
    "vision": "vision tower weights (model.visual.*)",
    "mtp": "MTP weights (mtp.*)",
}
FEATURE_REFUSES: dict[str, str] = {
    "vision": "images are refused",
    "mtp": "--speculative mtp:K is refused",
}


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
    # optional features the registered package has but this artifact lacks the weights of (`without`)
    features_off: tuple[OptionalFeature, ...] = ()
    # the DFlash drafter registered for this package (its own checkpoint, `ninfer convert --dflash`); the
    # variant carries it only where an artifact holds its weights (`with_drafter`)
    drafter: DFlashDims | None = None

    def __post_init__(self) -> None:
        if self.drafter is not None:  # the Variant checks the drafter's taps and heads against the target
            dataclasses.replace(self.variant, dflash=self.drafter)

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

    @property
    def has_dflash(self) -> bool:
        """Whether this artifact binds a DFlash block drafter (``speculative="dflash:K"`` can draft)."""
        return self.variant.dflash is not None

    def with_drafter(self) -> Package:
        """This package as an artifact that also holds its registered drafter's weights binds it."""
        if self.drafter is None:
            raise ValueError(f"package {self.name!r} has no registered DFlash drafter")
        return dataclasses.replace(self, variant=dataclasses.replace(self.variant, dflash=self.drafter))

    def without(self, features: Collection[str]) -> Package:
        """This package as an artifact without ``features``' weights binds it: the variant drops the
        vision tower and/or the MTP layer, so the schema, the memory plan and the Program never expect
        them. Same name: it is still this package's checkpoint, with fewer features."""
        unknown = set(features) - set(OPTIONAL_FEATURES)
        if unknown:
            raise ValueError(
                f"unknown optional feature(s) {sorted(unknown)}; known: {list(OPTIONAL_FEATURES)}"
            )
        variant = self.variant
        if "vision" in features:
            variant = dataclasses.replace(variant, vision=None)
        if "mtp" in features:
            variant = dataclasses.replace(variant, mtp_num_hidden_layers=0)
        off = tuple(f for f in OPTIONAL_FEATURES if f in features or f in self.features_off)
        return dataclasses.replace(self, variant=variant, features_off=off)

    def bound_by(self, variant: Variant) -> Package | None:
        """The package that stored dims ``variant`` bind: this one, less the optional features ``variant``
        lacks, with the registered drafter where ``variant`` carries one; None when it differs in
        anything else."""
        if variant.dflash is not None and self.drafter is None:
            return None
        base = self.with_drafter() if variant.dflash is not None else self
        off = tuple(
            f
            for f, has, registered in (
                ("vision", variant.vision is not None, self.has_vision),
                ("mtp", bool(variant.mtp_num_hidden_layers), self.has_mtp),
            )
            if registered and not has
        )
        bound = base.without(off) if off else base
        return None if bound.variant.diff(variant) else bound

    def missing_feature(self, feature: OptionalFeature | Literal["dflash"]) -> str:
        """Why ``feature`` is unavailable, in words for a refusal: the package has none, or this artifact
        was converted from a checkpoint without its weights."""
        if feature in self.features_off:
            return (
                f"the artifact of package {self.name!r} has no {FEATURE_WEIGHTS[feature]}: it was converted "
                "from a checkpoint without them"
            )
        if feature == "dflash":
            if self.drafter is not None:
                return (
                    f"the artifact of package {self.name!r} has no DFlash drafter weights: convert it with "
                    "--dflash DRAFTER_DIR"
                )
            return f"package {self.name!r} has no registered DFlash drafter"
        what = {"vision": "vision tower", "mtp": "MTP layer"}[feature]
        return f"package {self.name!r} has no {what}"

    def summary_lines(self) -> list[str]:
        """The package's architecture in words (the family's summary of its dims)."""
        return self.variant.summary_lines()

    @property
    def parameter_count(self) -> int:
        """Parameters in its weight schema (text, MTP and vision; the drafter's where it holds one)."""
        from ninfer.targets.qwen3_6.weights import weight_schema

        return sum(math.prod(spec.shape) for spec in weight_schema(self.variant))

    def hf_config(self) -> dict[str, Any]:
        cfg = self.variant.hf_config()
        if self.hf_model_type not in ("qwen3_5", "qwen3_5_moe"):
            cfg["model_type"] = self.hf_model_type
            cfg["text_config"]["model_type"] = f"{self.hf_model_type}_text"
        return cfg
