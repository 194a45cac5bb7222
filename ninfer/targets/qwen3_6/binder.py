"""Binds weights to a `ModelView`: from a `.ninfer` artifact, from random numbers, and back to HF names.

- `load_model` / `load_model_view`: the artifact names its package; the registry resolves it, the stored
  dims must equal the package's exactly, then every text tensor streams to the device through
  `ninfer.artifact.loader` (pinned double-buffered staging on CUDA; fp32-pinned tensors stay fp32, the
  others optionally cast on the device). `load_model` also returns the `LoadReport` (bytes, s, GB/s).
- `random_model_view`: random weights of a package's exact dims with scales that keep activations O(1),
  every norm weight randomised (a ``w`` vs ``1 + w`` mix-up must show) and realistic GDN decay
  parameters. Used by the tests and by ``bench --synthetic``; generated tensor by tensor on the target
  device, so real-size packages never pass through host memory.
- `hf_state_dict`: the view under transformers' ``Qwen3_5(Moe)ForConditionalGeneration`` (or
  ``ForCausalLM``) names, so tests can load the very same weights into the oracle.

Layout: whenever the binder allocates the text weights itself (every load to a GPU, a CPU load with a
cast, every random view), each `fused_row_groups` group is one freshly allocated buffer whose
consecutive row blocks are the members, in the group's order; the members stay bound under their own
names as row-slice views of it, and `ModelView.from_tensors` finds the stacked matrix (``qkv_proj``,
``in_proj``, ``gate_up_proj``, ``input_proj``) through `stacked_rows`. Members are copied straight into
their slots, so the device never holds a second copy. A group whose members do not share one dtype and
one row width (not the case in real packages) is placed member by member instead. A CPU load without a
cast binds the mapped bytes zero-copy, with no stacking: that is the reference path.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ninfer.artifact.loader import DEFAULT_STAGING_BYTES, LoadReport
from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.variant import Variant
from ninfer.targets.qwen3_6.view import ModelView, place_tensor, target_dtype
from ninfer.targets.qwen3_6.weights import WeightGroup, WeightSpec, fused_row_groups, weight_schema

__all__ = [
    "LoadedModel",
    "LoadReport",
    "allocate_text_weights",
    "hf_state_dict",
    "load_model",
    "load_model_view",
    "random_model_view",
    "random_weight",
]


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A bound artifact: its package, the view, and how the weights got to the device."""

    package: Package
    view: ModelView
    report: LoadReport


def load_model(
    artifact_path: str | Path,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    *,
    progress: bool = False,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    groups: Collection[WeightGroup] = ("text",),
) -> LoadedModel:
    """Open a `.ninfer` artifact, resolve and check its package, and bind its tensors on ``device``.

    Raises `IdentityMismatchError` (a `PackageMismatch`) when the identity names no registered package
    or the stored dims differ from the package's, and `ModelViewError` when the stored tensors do not
    follow the schema. Text tensors land in buffers laid out as the module docstring says, streamed in
    file order through staging buffers of ``staging_bytes`` (``progress``: a progress line on stderr).
    On CPU without a cast the view's tensors stay zero-copy views of the mapping.
    Weights of the other ``groups`` (``mtp``, ``vision``) go to ``device`` in ``dtype`` too, one tensor
    at a time; the rest stay in host memory, zero-copy and as stored (the MTP layer takes ~1.6 GiB on
    the 27B, which a Engine without MTP decoding never reads).
    """
    from ninfer.artifact import Artifact  # imported here: the model does not need it
    from ninfer.artifact.loader import load_artifact_tensors
    from ninfer.targets.identity import check_identity

    device = torch.device(device)
    with Artifact.open(artifact_path, verify=False) as artifact:
        package = check_identity(artifact)  # registry lookup + family, profile and exact dims
        names = set(artifact.tensor_names())
        present = [spec for spec in weight_schema(package.variant) if spec.name in names]
        # absent names are reported, all at once, by from_tensors
        text = {spec.name: artifact.descriptor(spec.name) for spec in present if spec.group == "text"}
        targets = {
            spec.name: target_dtype(spec, text[spec.name].dtype, dtype)
            for spec in present
            if spec.name in text
        }
        if device.type == "cpu" and all(targets[name] == desc.dtype for name, desc in text.items()):
            started = time.perf_counter()
            tensors = {name: artifact.tensor(name) for name in text}
            report = LoadReport(0, time.perf_counter() - started, len(text), 0, str(device), zero_copy=True)
        else:
            shapes = {name: desc.shape for name, desc in text.items()}
            tensors = allocate_text_weights(package.variant, shapes, targets, device)
            report = load_artifact_tensors(artifact, tensors, staging_bytes=staging_bytes, progress=progress)
        others = {spec.name: spec for spec in present if spec.group != "text" and spec.group in groups}
        for name, spec in others.items():
            stored = artifact.tensor(name)
            tensors[name] = stored.to(device=device, dtype=target_dtype(spec, stored.dtype, dtype))
        for name in names - tensors.keys():  # the other groups, and names outside the schema (reported)
            tensors[name] = artifact.tensor(name)
    return LoadedModel(package, ModelView.from_tensors(package.variant, tensors), report)


def load_model_view(
    artifact_path: str | Path,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    *,
    progress: bool = False,
) -> tuple[Package, ModelView]:
    """`load_model` without the report: ``(package, view)``."""
    loaded = load_model(artifact_path, device, dtype, progress=progress)
    return loaded.package, loaded.view


def allocate_text_weights(
    variant: Variant,
    shapes: Mapping[str, tuple[int, ...]],
    dtypes: Mapping[str, torch.dtype],
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """Uninitialised tensors for ``shapes`` (name -> shape) on ``device``, each group stacked.

    Every `fused_row_groups` group whose members are all present, 2-D, of one width and one dtype gets
    one ``[sum of rows, width]`` buffer, and each member is its row block (a contiguous view); every
    other name gets its own allocation.
    """
    out: dict[str, torch.Tensor] = {}
    for group in fused_row_groups(variant):
        if not all(name in shapes for name in group):
            continue
        member_shapes = [shapes[name] for name in group]
        member_dtypes = {dtypes[name] for name in group}
        if len(member_dtypes) != 1 or any(len(s) != 2 for s in member_shapes):
            continue
        if len({cols for _, cols in member_shapes}) != 1:
            continue
        rows = [r for r, _ in member_shapes]
        buffer = torch.empty((sum(rows), member_shapes[0][1]), dtype=member_dtypes.pop(), device=device)
        for name, block in zip(group, buffer.split(rows)):
            out[name] = block
    for name, shape in shapes.items():
        if name not in out:
            out[name] = torch.empty(shape, dtype=dtypes[name], device=device)
    return out


def random_model_view(
    variant: Variant, *, seed: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> ModelView:
    """Random weights of ``variant``'s exact dims on ``device`` (fp32-pinned tensors stay fp32).

    Each tensor draws from its own generator seeded by (seed, name), in fp32 on ``device``, then casts:
    values do not depend on the order of the schema, and equal (seed, device) give equal weights.
    Fused row groups are stacked (module docstring): members are generated one at a time and cast
    straight into their slot.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device)
    schema = weight_schema(variant)
    grouped = {name for group in fused_row_groups(variant) for name in group}
    stacked = {spec.name: spec for spec in schema if spec.name in grouped}
    slots = allocate_text_weights(
        variant,
        {name: spec.shape for name, spec in stacked.items()},
        {name: target_dtype(spec, torch.float32, dtype) for name, spec in stacked.items()},
        device,
    )
    tensors = {}
    for spec in schema:
        tensor = random_weight(spec, variant, seed, generator)
        if spec.name in slots:
            tensors[spec.name] = slots[spec.name].copy_(tensor)  # same rounding as place_tensor's .to
        else:
            tensors[spec.name] = place_tensor(tensor, spec, device, dtype)
    return ModelView.from_tensors(variant, tensors)


def random_weight(spec: WeightSpec, variant: Variant, seed: int, generator: torch.Generator) -> torch.Tensor:
    """One tensor of `random_model_view`, in fp32 on the generator's device: drawn from the (seed, name)
    stream, so it does not depend on which other tensors were drawn before (a file writer draws one at a
    time)."""
    generator.manual_seed(_tensor_seed(seed, spec.name))
    return _random_tensor(spec, variant, generator, generator.device)


def hf_state_dict(view: ModelView, *, text_only: bool = False) -> dict[str, torch.Tensor]:
    """The view's tensors under transformers' names.

    Default: the checkpoint names of ``Qwen3_5(Moe)ForConditionalGeneration``
    (``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``, and ``mtp.*``, which real
    checkpoints carry and transformers ignores). ``text_only``: the names of ``Qwen3_5(Moe)ForCausalLM``
    (``model.*``, ``lm_head.weight``), without vision and MTP. A tied package has no ``lm_head.weight``.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in view.tensors.items():
        if name == "lm_head.weight":
            out[name] = tensor
        elif name.startswith("visual."):
            if not text_only:
                out[f"model.{name}"] = tensor
        elif name.startswith("mtp."):
            if not text_only:
                out[name] = tensor
        elif name.startswith("dflash."):  # a separate checkpoint's (`dflash_state_dict`)
            continue
        else:
            out[("model." if text_only else "model.language_model.") + name] = tensor
    return out


def dflash_state_dict(view: ModelView) -> dict[str, torch.Tensor]:
    """The DFlash drafter's tensors under its own checkpoint's names (``DFlashDraftModel``: no prefix)."""
    return {name.removeprefix("dflash."): t for name, t in view.tensors.items() if name.startswith("dflash.")}


# ---- random initialisation ----------------------------------------------------------------------


_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
# projections that write into the residual stream
_RESIDUAL_OUTPUTS = (
    "self_attn.o_proj.weight",
    "linear_attn.out_proj.weight",
    "down_proj.weight",  # dense MLP and shared expert
    "experts.down_proj",
)


def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)


def _is_zero_centred_norm(name: str) -> bool:
    """RMSNorm weights applied as ``1 + w`` (every text/MTP RMSNorm except the GDN gated norm)."""
    return name.endswith(("norm.weight", "layernorm.weight")) and not (
        name.startswith(("visual.", "dflash.")) or name.endswith("linear_attn.norm.weight")
    )


def _is_plain_norm(name: str) -> bool:
    """Norm weights applied as plain ``w`` (the GDN gated norm, the vision LayerNorms, the DFlash
    drafter's Qwen3 RMSNorms)."""
    return name.endswith("linear_attn.norm.weight") or (
        name.startswith(("visual.", "dflash.")) and "norm" in name and name.endswith(".weight")
    )


def _random_tensor(
    spec: WeightSpec, variant: Variant, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    name, shape = spec.name, spec.shape

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device).mul_(std)

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=generator, device=device).mul_(high - low).add_(low)

    if name.endswith("A_log"):
        # A in [1, 16] (HF draws from [0.01, 16]; the tail near 0 would make heads that never decay)
        return uniform(1.0, 16.0).log_()
    if name.endswith("dt_bias"):
        # Mamba's dt init: dt log-uniform in [1e-3, 1e-1], stored as softplus^-1(dt)
        dt = uniform(math.log(1e-3), math.log(1e-1)).exp_()
        return dt + torch.log(-torch.expm1(-dt))
    if _is_zero_centred_norm(name):
        return uniform(-0.5, 0.5)
    if _is_plain_norm(name):
        return uniform(0.5, 1.5)
    if name.endswith(".bias"):
        return normal(0.02)
    if name == "embed_tokens.weight":
        return normal(1.0)
    if name == "visual.pos_embed.weight":
        return normal(0.02)
    if name.endswith("conv1d.weight"):  # [C, 1, K] depthwise: fan-in is the kernel
        return normal(shape[-1] ** -0.5)
    fan_in = shape[-1] if name.endswith(_EXPERTS) else math.prod(shape[1:])  # [E, out, in] / [out, in...]
    std = fan_in**-0.5
    if name.endswith(_RESIDUAL_OUTPUTS):
        # scaled residual branches (GPT-2 / Megatron init): the stream stays dominated by earlier layers
        # as in trained models, instead of every layer rewriting it, which would amplify rounding noise
        std /= math.sqrt(2 * variant.num_layers)
    return normal(std)
