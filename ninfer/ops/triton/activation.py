"""Triton SwiGLU activation: ``silu(gate) * up`` in fp32, cast to gate's dtype (the reference
`ninfer.ops.mlp.swiglu`), reading gate and up as strided views of one projection output.

The MLP's stacked gate/up GEMM writes [N, 2I]; its two halves are column slices with a row stride of
2I. The reference path turns each half into fp32 copies before multiplying (several passes over the
largest activation of a prefill chunk); this kernel reads each element once and writes the result once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl, schedule

__all__ = ["swiglu"]


@triton.jit
def _swiglu_kernel(
    gate_ptr, up_ptr, out_ptr, width, gate_stride, up_stride, out_stride,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * out_stride + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate, up [N, I] (any row stride, contiguous last dim, same dtype) -> [N, I] in gate's dtype."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} / up {tuple(up.shape)} {up.dtype}")
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    if up.stride(-1) != 1:
        up = up.contiguous()
    rows, width = gate.shape
    if out is None:
        out = torch.empty(rows, width, dtype=gate.dtype, device=gate.device)
    elif out.shape != gate.shape or out.stride(-1) != 1 or out.dtype != gate.dtype:
        raise ValueError(f"out must be [{rows}, {width}] {gate.dtype} with a contiguous last dim")
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(width))
    if schedule.recording:
        schedule.record("activation._swiglu_kernel", writes={"out": out})
    _swiglu_kernel[(rows, triton.cdiv(width, block))](
        gate,
        up,
        out,
        width,
        gate.stride(0),
        up.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=4,
        USE_PDL=pdl.ENABLED,
        **pdl.LAUNCH,
    )
    return out
