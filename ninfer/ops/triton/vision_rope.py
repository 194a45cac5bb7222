"""Triton 2-D rotary of the vision tower's attention, with its q/k/v relayout: one launch per block.

The reference (`ninfer.targets.qwen3_6.vision._attention`, as transformers) rotates q and k in fp32,
``(x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)``, from the qkv projection's
``[n, 3, heads, head_dim]`` output, and SDPA then copies the strided q, k, v views to ``[heads, n, D]``.
On the GPU those are about ten elementwise and copy kernels a block; here one kernel reads each head's
[tokens, head_dim] tile of q, k and v once and writes all three in SDPA's ``[heads, n, head_dim]``
layout, q and k rotated with the same fp32 products and sum. The rotated half is a second load of the
same tile at the partner columns (``d + D/2`` negated, ``d - D/2``), so a head_dim that is not a power of
two (72) is only a mask. No host sync; CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["vision_qkv_rotary"]


@triton.jit
def _vision_rotary_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, tokens,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    d = tl.arange(0, BLOCK_D)
    half = HEAD_DIM // 2
    mask = (rows < tokens)[:, None] & (d < HEAD_DIM)[None, :]
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    token_base = rows.to(tl.int64)[:, None] * (3 * HEADS * HEAD_DIM) + head * HEAD_DIM
    table = rows.to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
    out = head.to(tl.int64) * tokens * HEAD_DIM + rows.to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
    for which in tl.static_range(2):  # q, then k
        base = qkv_ptr + token_base + which * HEADS * HEAD_DIM
        x = tl.load(base + d[None, :], mask=mask, other=0.0)
        rotated = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32) * sign[None, :]
        y = x.to(tl.float32) * cos + rotated * sin
        dst = q_ptr if which == 0 else k_ptr
        tl.store(dst + out, y.to(dst.dtype.element_ty), mask=mask)
    v = tl.load(qkv_ptr + token_base + 2 * HEADS * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    tl.store(v_ptr + out, v, mask=mask)


def vision_qkv_rotary(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, block_tokens: int = 32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [n, 3, heads, head_dim] contiguous (any float dtype); cos, sin [n, head_dim] fp32 contiguous.
    Returns q, k, v, each [heads, n, head_dim] contiguous in qkv's dtype: q and k rotated as the reference
    does, v copied."""
    if qkv.dim() != 4 or qkv.shape[1] != 3 or not qkv.is_contiguous():
        raise ValueError(f"qkv must be contiguous [n, 3, heads, head_dim], got {tuple(qkv.shape)}")
    n, _, heads, head_dim = qkv.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for the half rotation, got {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (n, head_dim) or table.dtype != torch.float32 or not table.is_contiguous():
            raise ValueError(f"{name} must be contiguous fp32 [{n}, {head_dim}], got {tuple(table.shape)}")
    q, k, v = (torch.empty((heads, n, head_dim), dtype=qkv.dtype, device=qkv.device) for _ in range(3))
    if n == 0:
        return q, k, v
    grid = (triton.cdiv(n, block_tokens), heads)
    _vision_rotary_kernel[grid](
        qkv, cos, sin, q, k, v, n,
        HEADS=heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_TOKENS=block_tokens,
    )  # fmt: skip
    return q, k, v
