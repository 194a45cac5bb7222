"""Mapping a checkpoint's tensors onto the family weight schema, checked completely before writing.

Checkpoint names:  ``model.language_model.X`` -> ``X``; ``model.visual.X`` -> ``visual.X``;
``lm_head.weight`` and ``mtp.X`` kept; ``model.X`` -> ``X`` for checkpoints saved with the text-only
naming (``*ForCausalLM``). The vision tower and the MTP layer are optional features: a checkpoint
with none of a feature's tensors (or whose config.json declares none: no ``vision_config``,
``mtp_num_hidden_layers`` 0) converts with that feature off (`features_off`; the artifact binds
``Package.without`` it). A checkpoint with some but not all of them is refused, naming the missing
ones: a damaged checkpoint never silently loses a feature.
MoE experts come fused (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) or per
expert (``experts.{e}.gate_proj/up_proj/down_proj.weight``), which the plan fuses: gate rows then up
rows per expert, the layout the schema stores.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch

from ninfer.targets.package import FEATURE_WEIGHTS, STORAGE_PROFILES, Package
from ninfer.targets.qwen3_6.weights import WeightSpec, weight_schema

from .source import ConvertError, HFCheckpoint, SourceTensor

# safetensors dtype string -> torch dtype, for the float formats a checkpoint may be stored in
SOURCE_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
}
_PROFILE_OF_DTYPE: dict[str, str] = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}

_PER_EXPERT = re.compile(
    r"^(?P<prefix>(?:mtp\.)?layers\.\d+\.mlp\.experts\.)(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)

RecipeKind = Literal["copy", "fuse_gate_up", "stack_down"]


@dataclass(frozen=True)
class Recipe:
    """How to produce one schema tensor: copy one source tensor, or assemble the per-expert ones.

    ``fuse_gate_up`` parts are (gate_0, up_0, gate_1, up_1, ...); ``stack_down`` parts are (down_0, ...).
    """

    spec: WeightSpec
    kind: RecipeKind
    parts: tuple[SourceTensor, ...]
    dtype: torch.dtype  # stored dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.spec.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Plan:
    package: Package
    storage_profile: str
    source_profile: str  # the majority dtype of the source's text weights
    expert_layout: str  # "fused", "per_expert", "mixed" or "none" (dense)
    recipes: tuple[Recipe, ...]
    # optional features the checkpoint lacks -> why; ``package`` is the registered one without them
    features_off: dict[str, str] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.recipes)


def canonical_name(key: str) -> str | None:
    """The schema name of a checkpoint key, or None for keys of no known section."""
    if key.startswith("model.language_model."):
        return key.removeprefix("model.language_model.")
    if key.startswith("model.visual."):
        return "visual." + key.removeprefix("model.visual.")
    if key.startswith(("lm_head.", "mtp.", "dflash.")):  # dflash.: a drafter's (`merge_drafter`)
        return key
    if key.startswith("model."):  # text-only checkpoint (Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM)
        return key.removeprefix("model.")
    return None


# canonical-name prefix of each optional feature's tensors
_FEATURE_PREFIX: dict[str, str] = {"vision": "visual.", "mtp": "mtp."}


def features_off(ckpt: HFCheckpoint, package: Package) -> dict[str, str]:
    """The optional features of ``package`` this checkpoint converts without, each with why: its
    config.json declares none, or it holds none of the feature's tensors. A feature with some of its
    tensors stays on, so the plan lists the missing ones."""
    cfg = ckpt.config
    text = cfg.get("text_config", cfg)
    names = [name for name in map(canonical_name, ckpt.tensors) if name is not None]
    present = {f: any(n.startswith(prefix) for n in names) for f, prefix in _FEATURE_PREFIX.items()}
    declared = {
        "vision": bool(cfg.get("vision_config")),
        "mtp": isinstance(text, dict) and bool(text.get("mtp_num_hidden_layers")),
    }
    config_says = {
        "vision": "no vision tower (config.json has no vision_config)",
        "mtp": "no MTP layer (config.json: mtp_num_hidden_layers is 0 or absent)",
    }
    off: dict[str, str] = {}
    for feature, has in (("vision", package.has_vision), ("mtp", package.has_mtp)):
        if not has:
            continue
        if not declared[feature]:  # its tensors, if any, are then unexpected ones
            off[feature] = config_says[feature]
        elif not present[feature]:
            off[feature] = f"no {FEATURE_WEIGHTS[feature]}"
    return off


def build_plan(ckpt: HFCheckpoint, package: Package, dtype: str | None) -> Plan:
    """Every schema tensor's recipe, or one ConvertError listing every problem of the checkpoint.

    ``package`` is the registered package; the plan's is that package without the features the
    checkpoint lacks (`features_off`), and its schema is what the artifact stores."""
    off = features_off(ckpt, package)
    package = package.without(off)
    v = package.variant
    schema = weight_schema(v)
    problems = _Problems()
    for feature, why in off.items():  # off by its config, yet there are its tensors (unexpected below)
        prefix = _FEATURE_PREFIX[feature]
        if any((canonical_name(key) or "").startswith(prefix) for key in ckpt.tensors):
            problems.other.append(f"{why}, yet the checkpoint holds {FEATURE_WEIGHTS[feature]}")

    # canonical name -> source; per-expert sources grouped by (experts prefix, expert index, projection)
    direct: dict[str, SourceTensor] = {}
    per_expert: dict[str, dict[tuple[int, str], SourceTensor]] = defaultdict(dict)
    for key in sorted(ckpt.tensors):
        src = ckpt.tensors[key]
        name = canonical_name(key)
        if name is None:
            problems.unexpected.append(key)
            continue
        if src.dtype not in SOURCE_DTYPES:
            problems.other.append(f"{key} has dtype {src.dtype} (only BF16/F16/F32/F64 checkpoints convert)")
        m = _PER_EXPERT.match(name)
        if m:
            slot = (int(m["expert"]), m["proj"])
            group = per_expert[m["prefix"]]
            if slot in group:
                problems.other.append(f"{key} and {group[slot].key} are the same tensor")
            group[slot] = src
        elif name in direct:
            problems.other.append(f"{key} and {direct[name].key} are the same tensor")
        else:
            direct[name] = src

    layouts: set[str] = set()
    planned: list[tuple[WeightSpec, RecipeKind, tuple[SourceTensor, ...]]] = []
    used_experts: set[tuple[str, int, str]] = set()
    for spec in schema:
        src = direct.pop(spec.name, None)
        if src is not None:
            problems.check_shape(src, spec.shape)
            planned.append((spec, "copy", (src,)))
            if spec.name.endswith(".experts.gate_up_proj"):
                layouts.add("fused")
            continue
        prefix, _, tail = spec.name.rpartition("experts.")
        if tail in ("gate_up_proj", "down_proj") and per_expert.get(prefix + "experts."):
            group = per_expert[prefix + "experts."]
            E, I, H = v.num_experts, v.moe_intermediate_size, v.hidden_size
            projs = ("gate_proj", "up_proj") if tail == "gate_up_proj" else ("down_proj",)
            shape = (I, H) if tail == "gate_up_proj" else (H, I)
            parts: list[SourceTensor] = []
            for e in range(E):
                for proj in projs:
                    part = group.get((e, proj))
                    if part is None:
                        problems.missing.append(f"{prefix}experts.{e}.{proj}.weight")
                        continue
                    used_experts.add((prefix + "experts.", e, proj))
                    problems.check_shape(part, shape)
                    parts.append(part)
            planned.append((spec, "fuse_gate_up" if tail == "gate_up_proj" else "stack_down", tuple(parts)))
            layouts.add("per_expert")
            continue
        problems.missing.append(spec.name)

    for prefix, group in per_expert.items():
        for (e, proj), src in sorted(group.items()):
            if (prefix, e, proj) not in used_experts:
                problems.unexpected.append(src.key)
    for name, src in direct.items():
        if name == "lm_head.weight" and v.tie_word_embeddings:
            problems.other.append(
                f"checkpoint has {src.key} but package {package.name!r} ties the output head to the "
                "embeddings (tie_word_embeddings); refusing to drop a possibly untied head"
            )
        else:
            problems.unexpected.append(src.key)
    problems.raise_if_any(ckpt, package)

    source_dtype = _majority_dtype(
        [src for spec, _, parts in planned if spec.group == "text" for src in parts]
    )
    source_profile = _PROFILE_OF_DTYPE.get(source_dtype, source_dtype.lower())
    profile = source_profile if dtype is None else dtype
    if profile not in STORAGE_PROFILES:
        raise ConvertError(
            f"{ckpt.root}: most text weights are {source_dtype}, which is no storage profile; "
            f"pass --dtype ({'/'.join(STORAGE_PROFILES)})"
        )
    stored = getattr(torch, STORAGE_PROFILES[profile])
    recipes = tuple(
        Recipe(spec, kind, parts, torch.float32 if spec.keep_fp32 else stored)
        for spec, kind, parts in planned
    )
    layout = "none" if not layouts else "mixed" if len(layouts) > 1 else layouts.pop()
    return Plan(package, profile, source_profile, layout, recipes, off)


def check_tokenizer(tokenizer_json: bytes, package: Package, source: str) -> None:
    """Refuse a tokenizer.json whose special-token ids are not the ones the package's engine knows."""
    try:
        doc = json.loads(tokenizer_json)
        ids = {t["content"]: int(t["id"]) for t in doc.get("added_tokens", [])}
        vocab = doc.get("model", {}).get("vocab", {})
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ConvertError(f"{source}: not a Hugging Face tokenizers file ({e})") from None
    if isinstance(vocab, dict):
        ids = {**vocab, **ids}
    s = package.variant.special
    expected = {
        "<|endoftext|>": s.endoftext,
        "<|im_start|>": s.im_start,
        "<|im_end|>": s.im_end,
        "<|vision_start|>": s.vision_start,
        "<|vision_end|>": s.vision_end,
        "<|image_pad|>": s.image_pad,
        "<|video_pad|>": s.video_pad,
        "<think>": s.think_open,
        "</think>": s.think_close,
    }
    wrong = [
        f"{tok} is {ids.get(tok)} (expected {want})" for tok, want in expected.items() if ids.get(tok) != want
    ]
    too_big = max((i for i in ids.values() if isinstance(i, int)), default=-1)
    if too_big >= package.variant.vocab_size:
        wrong.append(f"token id {too_big} >= vocab_size {package.variant.vocab_size}")
    if wrong:
        raise ConvertError(f"{source}: tokenizer does not fit package {package.name!r}: " + "; ".join(wrong))


def _majority_dtype(sources: list[SourceTensor]) -> str:
    """The dtype holding most text-weight elements: a mixed checkpoint keeps its main precision."""
    count: dict[str, int] = defaultdict(int)
    for src in sources:
        count[src.dtype] += src.numel
    if not count:
        raise ConvertError("checkpoint has no text weights")
    return max(sorted(count), key=lambda d: count[d])


class _Problems:
    """Collects every mismatch so one error lists them all."""

    def __init__(self) -> None:
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.wrong_shape: list[str] = []
        self.other: list[str] = []

    def check_shape(self, src: SourceTensor, shape: tuple[int, ...]) -> None:
        if src.shape != shape:
            self.wrong_shape.append(f"{src.key} {list(src.shape)} (expected {list(shape)})")

    def raise_if_any(self, ckpt: HFCheckpoint, package: Package) -> None:
        parts = []
        if self.missing:
            parts.append(
                f"{len(self.missing)} missing (names without checkpoint prefix): {', '.join(self.missing)}"
            )
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected: {', '.join(self.unexpected)}")
        if self.wrong_shape:
            parts.append(f"{len(self.wrong_shape)} wrong shape: {', '.join(self.wrong_shape)}")
        parts += self.other
        if parts:
            raise ConvertError(
                f"{ckpt.root}: checkpoint tensors do not match package {package.name!r}: " + "; ".join(parts)
            )
