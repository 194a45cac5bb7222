"""Reference RMS norms of Qwen3.6 (plain PyTorch, fp32 math, differentiable).

Two conventions coexist in the model and a `w` vs `1 + w` mix-up is invisible at init, so each has its
own function: `rms_norm` is the zero-centred norm used everywhere except the Gated DeltaNet output,
which uses `gated_rms_norm` with a plain weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "gated_rms_norm", "l2norm"]


def _rms_normalize_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed in fp32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm (HF `Qwen3_5RMSNorm`): y = x / rms(x) * (1 + w), cast to x's dtype.

    The scale is applied in fp32 before the cast (HF's `(x * w).to(dtype)` order).
    """
    return (_rms_normalize_fp32(x, eps) * (1.0 + weight.float())).to(x.dtype)


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
