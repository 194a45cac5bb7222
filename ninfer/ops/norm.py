"""Reference RMS norms of Qwen3.6 (plain PyTorch, fp32 math, differentiable).

Two conventions coexist in the model and a `w` vs `1 + w` mix-up is invisible at init, so each has its
own function: `rms_norm` is the zero-centred norm used everywhere except the Gated DeltaNet output,
which uses `gated_rms_norm` with a plain weight. `add_rms_norm` is the residual add and the norm after it
(a decoder block's end).

The fast forms (`fast_rms_norm`, `fast_add_rms_norm`, `fast_gated_rms_norm`: `ninfer.ops.triton.norm`, one
pass each, the same rounding order) take their programmatic-dependent-launch flags from
`ninfer.ops.pdl_policy`: the norm weight is bound and the residual stream was written by an earlier
block's norm, four launches back in the model's forward, so both load before the PDL wait (``settled``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops.pdl_policy import pdl_policy

__all__ = [
    "rms_norm",
    "add_rms_norm",
    "gated_rms_norm",
    "plain_rms_norm",
    "l2norm",
    "fast_rms_norm",
    "fast_add_rms_norm",
    "fast_gated_rms_norm",
]


def _rms_normalize_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed in fp32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm (HF `Qwen3_5RMSNorm`): y = x / rms(x) * (1 + w), cast to x's dtype.

    The scale is applied in fp32 before the cast (HF's `(x * w).to(dtype)` order).
    """
    return (_rms_normalize_fp32(x, eps) * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the residual add in the model dtype, then the norm."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-weight RMSNorm (HF `Qwen3RMSNorm`, a DFlash drafter's): y = w * (x / rms(x)), the normalised
    value cast to x's dtype before the weight multiplies it (HF's rounding order)."""
    return weight.to(x.dtype) * _rms_normalize_fp32(x, eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of the GDN output (HF `Qwen3_5RMSNormGated`): y = w * (x / rms(x)) * silu(z).

    x may be the recurrence's fp32 output: it is first cast to z's (the model's) dtype, as HF casts the
    kernel output before the norm. Rounding order then matches HF exactly: the normalised value is cast
    to that dtype and multiplied by the plain weight in the model dtype, then multiplied by silu(z) in
    fp32 and cast back.
    """
    x = x.to(z.dtype)
    normed = _rms_normalize_fp32(x, eps).to(x.dtype)
    weighted = weight * normed  # model-dtype multiply, as in HF (promotes if weight is wider)
    return (weighted * F.silu(z.float())).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (HF / FLA `l2norm`), fp32 math, cast to x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


# ---- fast forms (Triton) -----------------------------------------------------------------------------


def fast_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from ninfer.ops.triton.norm import rms_norm as triton_rms_norm

    policy = pdl_policy(x.shape[0])
    return triton_rms_norm(
        x, weight, eps, settled=policy.settled, launch_next_early=policy.launch_next_early
    )


def fast_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm`; the residual and the weight load before the PDL wait (module docstring)."""
    from ninfer.ops.triton.norm import add_rms_norm as triton_add_rms_norm

    policy = pdl_policy(x.shape[0])
    return triton_add_rms_norm(
        x, residual, weight, eps, settled=policy.settled, launch_next_early=policy.launch_next_early
    )


def fast_gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
    from ninfer.ops.triton.norm import gated_rms_norm as triton_gated_rms_norm

    policy = pdl_policy(x.shape[0])
    return triton_gated_rms_norm(x, weight, z, eps, launch_next_early=policy.launch_next_early)
