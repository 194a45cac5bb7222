"""Dense projections: ``x @ w.T`` (every projection of the model), the logits, a block's output
projection with the residual add and the next norm, and the vision MLP's first projection with its bias
and tanh GELU. Reference forms (cuBLAS through `F.linear`) and fast forms side by side.

The fast forms stream the weight with our GEMV (`ninfer.ops.triton.skinny_gemm`) where it reads it
faster than cuBLAS on the H200 (`takes_skinny`: every one-row shape, and the 2..8-row shapes its sweep
found faster, `skinny_gemm.prefers_skinny`), and call cuBLAS otherwise. Weights are bound, never written,
so a one-row GEMV may load its first tiles before its PDL wait (``static_weight``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops.norm import add_rms_norm, fast_add_rms_norm
from ninfer.ops.pdl_policy import pdl_policy
from ninfer.ops.triton import schedule

__all__ = [
    "fast_linear",
    "fast_linear_add_rms_norm",
    "fast_linear_gelu_tanh",
    "fast_logits",
    "linear_add_rms_norm",
    "linear_gelu_tanh",
    "logits",
    "takes_skinny",
]

Tensor = torch.Tensor


def logits(x: Tensor, lm_head: Tensor) -> Tensor:
    """(x @ lm_head.T in x's dtype).float(): the fp32 logits of the rows x."""
    return F.linear(x, lm_head).float()


def linear_add_rms_norm(
    act: Tensor, w: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """add_rms_norm(act @ w.T, residual, weight, eps) -> (normed, summed)."""
    return add_rms_norm(F.linear(act, w), residual, weight, eps)


def linear_gelu_tanh(x: Tensor, w: Tensor, bias: Tensor) -> Tensor:
    """gelu(x @ w.T + bias, approximate="tanh"): the vision blocks' fc1 and activation."""
    return F.gelu(F.linear(x, w, bias), approximate="tanh")


def fast_linear_gelu_tanh(x: Tensor, w: Tensor, bias: Tensor) -> Tensor:
    """`linear_gelu_tanh` on CUDA as one cuBLASLt GEMM whose epilogue adds the bias and applies the tanh
    GELU to the fp32 sum before its one rounding (``torch._addmm_activation``; its CUDA GELU is the tanh
    form, checked on the device by tests/gpu/test_vision_graphs_cuda.py), so the [M, N] activation is
    written once instead of written, read and written again. Elsewhere (its CPU GELU is the exact form)
    the reference."""
    if x.is_cuda and x.dim() == 2:
        return torch._addmm_activation(bias, x, w.t(), use_gelu=True)
    return linear_gelu_tanh(x, w, bias)


def takes_skinny(x: Tensor, w: Tensor) -> bool:
    """Whether a decode projection streams the weight with our GEMV kernel: where it reads it faster than
    cuBLAS on the H200 (every one-row shape, some 2..8-row ones: `skinny_gemm.prefers_skinny`)."""
    if x.dim() != 2 or x.dtype != w.dtype or w.stride(-1) != 1:
        return False
    from ninfer.ops.triton.skinny_gemm import prefers_skinny

    return prefers_skinny(x.shape[0], w.shape[0], w.shape[1])


def _cublas_linear(x: Tensor, w: Tensor) -> Tensor:
    out = F.linear(x, w)
    if schedule.recording:
        schedule.record_plain("F.linear", writes={"out": out})
    return out


def fast_linear(x: Tensor, w: Tensor, *, static_weight: bool = True) -> Tensor:
    """Our GEMV where `takes_skinny`, cuBLAS otherwise. static_weight: w is a bound weight, never written
    (the GEMV may read it before its PDL wait); False for a tensor an earlier kernel computes."""
    if takes_skinny(x, w):
        from ninfer.ops.triton.skinny_gemm import skinny_linear

        return skinny_linear(x, w, static_weight=static_weight)
    return _cublas_linear(x, w)


def fast_logits(x: Tensor, lm_head: Tensor) -> Tensor:
    """The logits in one launch where our GEMV takes the projection (it writes the x-dtype result widened
    to fp32, where the reference's `.float()` is a launch of its own at the end of every decode step),
    cuBLAS and the cast otherwise."""
    if takes_skinny(x, lm_head):
        from ninfer.ops.triton.skinny_gemm import skinny_linear

        out = torch.empty((x.shape[0], lm_head.shape[0]), dtype=torch.float32, device=x.device)
        return skinny_linear(x, lm_head, out=out, static_weight=True)
    out = _cublas_linear(x, lm_head).float()
    if schedule.recording:
        schedule.record_plain("Tensor.float", writes={"out": out})
    return out


def fast_linear_add_rms_norm(
    act: Tensor, w: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """The projection, then the fused add + norm: two launches. A split-K GEMV (35B-A3B's eight-row
    attn_o / gdn_out, 27B's eight-row mlp_down) leaves its fp32 partials to the norm kernel, which sums
    them in the reduce launch's order: the same residual stream, one dependent launch fewer (measured
    faster in the decode graph; docs/benchmarks.md, "Why the kernels are as they are", GEMV). The
    one-launch form for one row (the GEMV's last program doing the add and the norm) measured slower than
    these two launches under programmatic dependent launch."""
    if takes_skinny(act, w):
        from ninfer.ops.triton.norm import add_rms_norm_partials
        from ninfer.ops.triton.skinny_gemm import skinny_linear_partials

        policy = pdl_policy(act.shape[0])
        return add_rms_norm_partials(
            skinny_linear_partials(act, w, static_weight=True), residual, weight, eps,
            settled=policy.settled, launch_next_early=policy.launch_next_early,
        )  # fmt: skip
    return fast_add_rms_norm(_cublas_linear(act, w), residual, weight, eps)  # `takes_skinny` said cuBLAS
