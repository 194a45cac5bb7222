"""Binds weights to a `ModelView`: from a `.ninfer` artifact, from random numbers, and back to HF names.

- `load_model_view`: the artifact names its package; the registry resolves it, the stored dims must
  equal the package's exactly, then every schema tensor moves to the device (fp32-pinned tensors stay
  fp32, the others optionally cast).
- `random_model_view`: random weights of a package's exact dims with scales that keep activations O(1),
  every norm weight randomised (a ``w`` vs ``1 + w`` mix-up must show) and realistic GDN decay
  parameters. Used by the tests and by ``bench --synthetic``; generated tensor by tensor on the target
  device, so real-size packages never pass through host memory.
- `hf_state_dict`: the view under transformers' ``Qwen3_5(Moe)ForConditionalGeneration`` (or
  ``ForCausalLM``) names, so tests can load the very same weights into the oracle.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import torch

from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.variant import Variant
from ninfer.targets.qwen3_6.view import ModelView, place_tensor
from ninfer.targets.qwen3_6.weights import WeightSpec, weight_schema

__all__ = ["load_model_view", "random_model_view", "hf_state_dict"]


def load_model_view(
    artifact_path: str | Path, device: torch.device | str, dtype: torch.dtype | None = None
) -> tuple[Package, ModelView]:
    """Open a `.ninfer` artifact, resolve and check its package, and bind its tensors on ``device``.

    Raises `IdentityMismatchError` (a `PackageMismatch`) when the identity names no registered package
    or the stored dims differ from the package's, and `ModelViewError` when the stored tensors do not
    follow the schema. On CPU without a cast the view's tensors stay zero-copy views of the mapping.
    MTP and vision weights stay in host memory, zero-copy and as stored: no forward reads them yet, and
    on a GPU they would take ~1.6 GiB (27B) to 2.4 GiB (35B-A3B) of device memory for nothing.
    """
    from ninfer.artifact import Artifact, check_identity  # imported here: the model does not need it

    with Artifact.open(artifact_path, verify=False) as artifact:
        package = check_identity(artifact)  # registry lookup + family, profile and exact dims
        names = set(artifact.tensor_names())
        tensors = {
            spec.name: (
                place_tensor(artifact.tensor(spec.name), spec, device, dtype)
                if spec.group == "text"
                else artifact.tensor(spec.name)
            )
            for spec in weight_schema(package.variant)
            if spec.name in names  # absent names are reported, all at once, by from_tensors
        }
        for extra in names - tensors.keys():
            tensors[extra] = artifact.tensor(extra)
    return package, ModelView.from_tensors(package.variant, tensors)


def random_model_view(
    variant: Variant, *, seed: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> ModelView:
    """Random weights of ``variant``'s exact dims on ``device`` (fp32-pinned tensors stay fp32).

    Each tensor draws from its own generator seeded by (seed, name), in fp32 on ``device``, then casts:
    values do not depend on the order of the schema, and equal (seed, device) give equal weights.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device)
    tensors = {}
    for spec in weight_schema(variant):
        generator.manual_seed(_tensor_seed(seed, spec.name))
        tensor = _random_tensor(spec, variant, generator, device)
        tensors[spec.name] = place_tensor(tensor, spec, device, dtype)
    return ModelView.from_tensors(variant, tensors)


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
        else:
            out[("model." if text_only else "model.language_model.") + name] = tensor
    return out


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
        name.startswith("visual.") or name.endswith("linear_attn.norm.weight")
    )


def _is_plain_norm(name: str) -> bool:
    """Norm weights applied as plain ``w`` (the GDN gated norm, the vision LayerNorms)."""
    return name.endswith("linear_attn.norm.weight") or (
        name.startswith("visual.") and "norm" in name and name.endswith(".weight")
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
