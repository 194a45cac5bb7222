"""Hugging Face Qwen3.5/3.6 checkpoint folder -> one `.ninfer` artifact of a registered package.

A DFlash drafter of the package (z-lab's ``DFlashDraftModel`` checkpoints, a folder of their own) joins
the artifact with ``dflash_dir``: its config must be the package's registered drafter exactly, and its
tensors are stored under ``dflash.``.

A checkpoint without a vision tower or an MTP layer (a text-only export, a quantizer's export without
MTP) converts with that feature off: the artifact's dims are the package's without it, its provenance
says why (``features_off``), and one line on stderr says so.

Everything is checked first (config against the closed registry, every tensor name and shape against
the package's weight schema, tokenizer and chat template); only then is the artifact written, streaming
one schema tensor at a time from the shards (a fused MoE tensor is assembled from one layer's experts),
so peak memory is about the largest tensor, never the model.
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from ninfer.artifact import ArtifactWriter, TensorSpec
from ninfer.targets.package import FEATURE_REFUSES, STORAGE_PROFILES, Package
from ninfer.targets.qwen3_6.variant import DFlashDims, Variant
from ninfer.targets.registry import PackageMismatch, check_dims, get_package, package_for_hf_config

from .plan import Plan, Recipe, build_plan, check_tokenizer
from .source import ConvertError, HFCheckpoint, SourceTensor, read_checkpoint, read_frontend

# Bump when the bytes written for the same input change (mapping, fusion, casting or provenance).
CONVERTER_VERSION = "1"
CONVERTER_NAME = "ninfer_tools.convert.qwen3_6"


def convert(
    hf_dir: str | Path,
    out_path: str | Path,
    *,
    dtype: str | None = None,
    package: str | None = None,
    dflash_dir: str | Path | None = None,
    progress: bool = True,
) -> Path:
    """Convert the checkpoint in ``hf_dir`` into ``out_path``; returns the artifact path.

    ``dtype`` names a storage profile (bf16/fp16/fp32); None keeps the source precision (the majority
    dtype of the text weights). ``package`` forces a registered package; its dims must still match
    config.json exactly. ``dflash_dir``: a DFlash drafter checkpoint to store with it. Raises
    ConvertError (one line, names the file) for any refused input.
    """
    if dtype is not None and dtype not in STORAGE_PROFILES:
        raise ConvertError(f"unknown dtype {dtype!r}; storage profiles: {', '.join(STORAGE_PROFILES)}")
    out = Path(out_path)
    if not out.parent.is_dir():
        raise ConvertError(f"{out}: output directory {out.parent} does not exist")

    ckpt = read_checkpoint(hf_dir)
    pkg = resolve_package(ckpt, package)
    if dflash_dir is not None:
        merge_drafter(ckpt, read_checkpoint(dflash_dir), pkg)
        pkg = pkg.with_drafter()
    frontend = read_frontend(ckpt)
    check_tokenizer(frontend["tokenizer.json"], pkg, str(ckpt.path("tokenizer.json")))
    plan = build_plan(ckpt, pkg, dtype)
    bound = plan.package  # the registered package less the features the checkpoint lacks
    if out.resolve() in {ckpt.path(name).resolve() for name in ckpt.files_read}:
        raise ConvertError(f"{out}: output would overwrite a source file")

    specs = [TensorSpec(r.spec.name, r.dtype, r.spec.shape) for r in plan.recipes]
    with ExitStack() as stack:
        writer = stack.enter_context(
            ArtifactWriter(
                out,
                identity=bound.identity(plan.storage_profile),
                dims=bound.variant.dims(),
                tensors=specs,
                frontend=frontend,
                provenance=provenance(ckpt, plan, dtype=dtype, package=package),
            )
        )
        reader = stack.enter_context(_ShardReader(ckpt, plan))
        bar = stack.enter_context(
            tqdm(
                total=plan.total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=f"convert {pkg.name}",
                file=sys.stderr,
                disable=not progress,
            )
        )
        for recipe in plan.recipes:
            try:
                tensor = _materialize(recipe, reader, plan.storage_profile)
            except ConvertError as e:  # the writer's context drops the partial file
                raise ConvertError(f"{ckpt.root}: {e}") from None
            writer.write_tensor(recipe.spec.name, tensor)
            bar.update(recipe.nbytes)
        writer.close()
    off = plan.features_off
    if off:
        print(f"convert {pkg.name}: {features_off_line(off)}", file=sys.stderr)
    return out


def merge_drafter(ckpt: HFCheckpoint, drafter: HFCheckpoint, package: Package) -> None:
    """Add ``drafter``'s tensors to ``ckpt`` as ``dflash.*`` (read from the drafter's own files), or
    ConvertError naming what differs from the package's registered drafter."""
    config_path = drafter.path("config.json")
    registered = package.drafter
    if registered is None:
        raise ConvertError(f"{config_path}: package {package.name!r} has no registered DFlash drafter")
    try:
        dims = DFlashDims.from_hf_config(drafter.config)
    except (ValueError, KeyError, TypeError) as e:
        raise ConvertError(f"{config_path}: not a DFlash drafter config ({e})") from None
    cfg = drafter.config
    problems = [
        f"{k}: {a!r} != {b!r}" for k, a, b in (
            (k, dims.dims()[k], registered.dims()[k]) for k in sorted(registered.dims())
        ) if a != b
    ]  # fmt: skip
    for key, want in (
        ("hidden_size", package.variant.hidden_size),
        ("num_target_layers", package.variant.num_layers),
        ("vocab_size", package.variant.vocab_size),
    ):
        if key in cfg and cfg[key] != want:
            problems.append(f"{key}: {cfg[key]!r} != {want!r}")
    if problems:
        raise ConvertError(
            f"{config_path}: the drafter does not match package {package.name!r}'s: " + "; ".join(problems)
        )
    for key, src in drafter.tensors.items():
        where = str((drafter.root / src.file).resolve())  # an absolute path: read from the drafter's folder
        ckpt.tensors[f"dflash.{key}"] = SourceTensor(src.key, where, src.dtype, src.shape)
    for name, size in drafter.files_read.items():
        ckpt.files_read[f"dflash/{name}"] = size


def features_off_line(off: dict[str, str]) -> str:
    """One line saying which features the artifact lacks, why, and what that refuses."""
    return "features off: " + "; ".join(f"{why}: {FEATURE_REFUSES[f]}" for f, why in off.items())


def resolve_package(ckpt: HFCheckpoint, name: str | None) -> Package:
    """The registered package of config.json, or the forced one when its dims match exactly (a config
    without vision_config or MTP layer matches a package that has them: those features are then off)."""
    config_path = ckpt.path("config.json")
    try:
        if name is None:
            return package_for_hf_config(ckpt.config)
        pkg = get_package(name)
        variant = _config_variant(ckpt.config)
        dims = variant.dims()
        dims["special"] = pkg.variant.dims()["special"]  # config.json does not carry the engine's ids
        check_dims(pkg, dims, "config.json")
        return pkg
    except PackageMismatch as e:
        detail = str(e).removeprefix("config.json: ")
        raise ConvertError(f"{config_path}: {detail}") from None
    except (AssertionError, TypeError, KeyError) as e:  # fields of the wrong type or inconsistent dims
        raise ConvertError(f"{config_path}: not a Qwen3.5/3.6 config ({type(e).__name__}: {e})") from None


def provenance(ckpt: HFCheckpoint, plan: Plan, *, dtype: str | None, package: str | None) -> dict[str, Any]:
    """What made this artifact: no time, no absolute paths, so the same input gives the same bytes."""
    cfg = ckpt.config
    off = plan.features_off
    features = {"features_off": off} if off else {}
    return {
        **features,  # (absent for a complete checkpoint: its artifact's bytes do not change)
        "converter": CONVERTER_NAME,
        "converter_version": CONVERTER_VERSION,
        "options": {"dtype": dtype, "package": package},
        "source": {
            "architectures": cfg.get("architectures"),
            "model_type": cfg.get("model_type"),
            "dtype": plan.source_profile,
            "expert_layout": plan.expert_layout,
            "files": [{"name": n, "bytes": ckpt.files_read[n]} for n in sorted(ckpt.files_read)],
        },
    }


def _config_variant(cfg: dict[str, Any]) -> Variant:
    """config.json dims, reading Qwen3.8's model_type like the registry does."""
    try:
        if str(cfg.get("model_type", "")).startswith("qwen4_exp"):
            text = dict(cfg.get("text_config", cfg), model_type="qwen3_5_text")
            return Variant.from_hf_config({**cfg, "model_type": "qwen3_5", "text_config": text})
        return Variant.from_hf_config(cfg)
    except (ValueError, TypeError, KeyError, AssertionError) as e:
        raise PackageMismatch(f"config.json: {e}") from None


class _ShardReader:
    """Opens shards on first use and closes each once its last planned tensor has been read."""

    def __init__(self, ckpt: HFCheckpoint, plan: Plan) -> None:
        self._ckpt = ckpt
        self._remaining = Counter(part.file for r in plan.recipes for part in r.parts)
        self._open: dict[str, Any] = {}

    def __enter__(self) -> _ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def get(self, file: str, key: str) -> torch.Tensor:
        handle = self._open.get(file)
        if handle is None:
            handle = safe_open(str(self._ckpt.path(file)), framework="pt")
            handle.__enter__()
            self._open[file] = handle
        tensor = handle.get_tensor(key)
        self._remaining[file] -= 1
        if self._remaining[file] == 0:
            self._open.pop(file).__exit__(None, None, None)
        return tensor


def _materialize(recipe: Recipe, reader: _ShardReader, profile: str) -> torch.Tensor:
    """The stored tensor of one recipe, in its stored dtype."""
    if recipe.kind == "copy":
        (part,) = recipe.parts
        src = reader.get(part.file, part.key)
        out = src.to(recipe.dtype).contiguous()
        _check_cast(out, src, part.key, profile)
        return out
    out = torch.empty(recipe.spec.shape, dtype=recipe.dtype)
    if recipe.kind == "fuse_gate_up":
        inter = recipe.spec.shape[1] // 2
        for e in range(recipe.spec.shape[0]):
            gate, up = recipe.parts[2 * e], recipe.parts[2 * e + 1]
            _copy_into(out[e, :inter], reader.get(gate.file, gate.key), gate.key, profile)
            _copy_into(out[e, inter:], reader.get(up.file, up.key), up.key, profile)
    else:  # stack_down
        for e, down in enumerate(recipe.parts):
            _copy_into(out[e], reader.get(down.file, down.key), down.key, profile)
    return out


def _copy_into(dst: torch.Tensor, src: torch.Tensor, key: str, profile: str) -> None:
    dst.copy_(src)
    _check_cast(dst, src, key, profile)


def _check_cast(dst: torch.Tensor, src: torch.Tensor, key: str, profile: str) -> None:
    """Refuse a narrowing cast that turned finite source values into inf (e.g. fp32/bf16 -> fp16)."""
    if torch.finfo(dst.dtype).max >= torch.finfo(src.dtype).max:
        return  # widening or same range: nothing can overflow
    if not bool(torch.isfinite(dst).all()) and bool(torch.isfinite(src).all()):
        raise ConvertError(
            f"tensor {key}: values overflow the {profile} storage profile (use another --dtype)"
        )
