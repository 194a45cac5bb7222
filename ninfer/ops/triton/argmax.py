"""Triton row argmax over a vocabulary (the greedy draw at the end of every decode graph): two launches.

`torch.argmax` over [B, 248320] fp32 logits runs one block per row, which leaves most of the H200 idle in the
last kernel of every decode step (docs/benchmarks.md, "Why the kernels are as they are", small kernels). Here
the first launch reduces BLOCK columns per program (B x V / BLOCK programs over all SMs) to a (value, index)
pair, the second reduces each row's pairs. Same result as torch.argmax: the first index of the row's maximum,
and a NaN counts as larger than any number (the first NaN wins).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl, schedule

__all__ = ["argmax_rows"]

_BLOCK = 2048  # columns per first-launch program: 122 programs per 248,320-wide row


@triton.jit
def _first_max(values, index, valid, sentinel):
    """(the max of values over valid lanes, a NaN if any, and the lowest index holding it)."""
    nan = valid & (values != values)
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    best = tl.max(tl.where(valid & ~nan, values, float("-inf")), axis=0)
    holds = tl.where(any_nan, nan, valid & (values == best))
    first = tl.min(tl.where(holds, index, sentinel), axis=0)
    return tl.where(any_nan, float("nan"), best), first


@triton.jit
def _argmax_blocks_kernel(
    x_ptr, values_ptr, index_ptr, num_cols, stride_row, NUM_BLOCKS: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    row = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    valid = cols < num_cols
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
    best, first = _first_max(x, cols, valid, num_cols)
    tl.store(values_ptr + row * NUM_BLOCKS + block, best)
    tl.store(index_ptr + row * NUM_BLOCKS + block, first)


@triton.jit
def _argmax_rows_kernel(
    values_ptr, index_ptr, out_ptr, num_cols, NUM_BLOCKS: tl.constexpr, BLOCK_BLOCKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    row = tl.program_id(0)
    blocks = tl.arange(0, BLOCK_BLOCKS)
    valid = blocks < NUM_BLOCKS
    values = tl.load(values_ptr + row * NUM_BLOCKS + blocks, mask=valid, other=float("-inf"))
    index = tl.load(index_ptr + row * NUM_BLOCKS + blocks, mask=valid, other=num_cols)
    # the blocks cover ascending column ranges, so the lowest index among the blocks holding the row's
    # max (or a NaN) is the row's first
    _, first = _first_max(values, index, valid, num_cols)
    tl.store(out_ptr + row, first.to(tl.int64))


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # compared in fp32: exact for these


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` for x [B, V] (fp32, bf16 or fp16; unit stride along V) -> [B] int64,
    written into ``out`` where given (contiguous [B] int64 on x's device)."""
    if x.dim() != 2 or x.dtype not in _DTYPES or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(
            f"x must be [B, V] in {_DTYPES} with a unit stride along V, got {tuple(x.shape)} {x.dtype}"
        )
    rows, cols = x.shape
    if cols == 0:
        raise ValueError("argmax of an empty row")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
    elif out.shape != (rows,) or out.dtype != torch.int64 or out.device != x.device or out.stride(0) != 1:
        raise ValueError(
            f"out must be contiguous [{rows}] int64 on {x.device}, got {tuple(out.shape)} {out.dtype}"
        )
    if rows == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(cols))
    num_blocks = triton.cdiv(cols, block)
    values = torch.empty((rows, num_blocks), dtype=torch.float32, device=x.device)
    index = torch.empty((rows, num_blocks), dtype=torch.int32, device=x.device)
    if schedule.recording:
        schedule.record("argmax._argmax_blocks_kernel", writes={"values": values, "index": index})
        schedule.record("argmax._argmax_rows_kernel", writes={"out": out})
    _argmax_blocks_kernel[(rows, num_blocks)](
        x, values, index, cols, x.stride(0), NUM_BLOCKS=num_blocks, BLOCK=block, num_warps=4,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    _argmax_rows_kernel[(rows,)](
        values, index, out, cols, NUM_BLOCKS=num_blocks, BLOCK_BLOCKS=triton.next_power_of_2(num_blocks),
        num_warps=4, USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    return out
