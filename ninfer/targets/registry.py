"""The closed registry of exact packages. Nothing outside this table loads."""

from __future__ import annotations

from typing import Any

from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.variant import Variant
from ninfer.targets.qwen3_6_27b import PACKAGE as QWEN3_6_27B
from ninfer.targets.qwen3_6_35b_a3b import PACKAGE as QWEN3_6_35B_A3B
from ninfer.targets.qwen3_6_demo import PACKAGE as QWEN3_6_DEMO
from ninfer.targets.qwen3_6_tiny import PACKAGE as QWEN3_6_TINY
from ninfer.targets.qwen3_6_tiny_moe import PACKAGE as QWEN3_6_TINY_MOE
from ninfer.targets.qwen3_8_27b import PACKAGE as QWEN3_8_27B

PACKAGES: dict[str, Package] = {
    p.name: p
    for p in (QWEN3_6_27B, QWEN3_6_35B_A3B, QWEN3_8_27B, QWEN3_6_DEMO, QWEN3_6_TINY, QWEN3_6_TINY_MOE)
}


# the family modules that open packages (`ninfer.targets.open`): a closed table, as the packages are
FAMILY_MODULES: dict[str, str] = {"qwen3_6": "ninfer.targets.qwen3_6.open"}


def family_module(package: Package) -> Any:
    """The module that opens ``package``'s family (imported on first use)."""
    import importlib

    return importlib.import_module(FAMILY_MODULES[package.family])


class PackageMismatch(ValueError):
    """An artifact or checkpoint does not match any registered package exactly."""


def get_package(name: str) -> Package:
    try:
        return PACKAGES[name]
    except KeyError:
        raise PackageMismatch(
            f"unknown package {name!r}; registered packages: {', '.join(PACKAGES)}"
        ) from None


def package_for_hf_config(cfg: dict[str, Any]) -> Package:
    """The one package whose checkpoints carry this config.json, or PackageMismatch naming why."""
    model_type = cfg.get("model_type", "")
    base_type = model_type.removesuffix("_text")
    try:
        if base_type.startswith("qwen4_exp"):  # Qwen3.8 reuses the qwen3_5 config fields
            text = dict(cfg.get("text_config", cfg), model_type="qwen3_5_text")
            variant = Variant.from_hf_config({**cfg, "model_type": "qwen3_5", "text_config": text})
        else:
            variant = Variant.from_hf_config(cfg)
    except ValueError as e:
        raise PackageMismatch(f"config.json: {e}") from None
    candidates = [p for p in PACKAGES.values() if p.hf_model_type.startswith(base_type.split("_moe")[0])]
    for p in candidates:  # a text-only config (no vision_config, or no MTP layer) still names its package
        if p.bound_by(_with_defaults(variant, p)) is not None:
            return p

    def diffs_to(p: Package) -> list[str]:  # ignoring the features the config leaves out
        off = [
            f
            for f, absent in (("vision", variant.vision is None), ("mtp", not variant.mtp_num_hidden_layers))
            if absent
        ]
        return p.without(off).variant.diff(_with_defaults(variant, p))

    best = min(PACKAGES.values(), key=lambda p: len(diffs_to(p)))
    diffs = diffs_to(best)
    raise PackageMismatch(
        f"config.json (model_type {model_type!r}) matches no registered package; closest is "
        f"{best.name!r}, which differs in: " + "; ".join(diffs or [f"model_type != {best.hf_model_type!r}"])
    )


def check_dims(package: Package, dims: dict[str, Any], source: str) -> Package:
    """The package that stored dims bind: ``package`` itself when they are exactly its dims, or
    ``package.without(...)`` when they are its dims less optional features (no vision tower, no MTP
    layer: an artifact converted from a checkpoint without those weights), with the registered drafter
    where they carry one. Refuses anything else."""
    try:
        stored = Variant.from_dims(dims)
    except (TypeError, ValueError, KeyError) as e:
        raise PackageMismatch(f"{source}: dims are not readable as {package.name!r} dims: {e}") from None
    bound = package.bound_by(stored)
    if bound is None:
        full = package.with_drafter() if stored.dflash and package.drafter else package
        diffs = full.variant.diff(stored)
        raise PackageMismatch(f"{source}: dims do not match package {package.name!r}: " + "; ".join(diffs))
    return bound


def _with_defaults(v: Variant, p: Package) -> Variant:
    """Fields a config.json does not carry (special ids) come from the package."""
    d = v.dims()
    d["special"] = p.variant.dims()["special"]
    return Variant.from_dims(d)


def describe_dims(dims: dict[str, Any]) -> list[str] | None:
    """An artifact's stored dims in words, when they parse as the family's dims; else None."""
    try:
        return Variant.from_dims(dims).summary_lines()
    except (TypeError, ValueError, KeyError, AssertionError):
        return None
