"""Triton M-RoPE cos/sin tables (fast path of `ninfer.ops.rope.mrope_cos_sin`): one launch.

The reference builds the tables from a dozen small torch ops (casts, a gather, a cat, cos and sin), each a
kernel of its own at the head of every decode graph, where nothing overlaps them; here one kernel computes
angle[n, j] = float(positions[axis(j), n]) * inv_freq[j] and writes cos / sin of it to both halves of the
row. The frequencies are the reference's own tensor (`mrope_inv_freq`, cached), the int-to-float cast and
the product are the same fp32 operations, and cos / sin are the CUDA math library's (libdevice), which
torch's CUDA kernels call too: the same bits. Under TRITON_INTERPRET=1 (CPU tests) Triton's own cos / sin
stand in (numpy's), equal to torch's to fp32 rounding.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ninfer.ops.rope import mrope_inv_freq
from ninfer.ops.triton import pdl, schedule

__all__ = ["mrope_cos_sin"]

# libdevice has no interpreter implementation; compiled kernels always take it
_LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _mrope_cos_sin_kernel(
    positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, num_tokens, stride_axis, stride_token,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, SECTION_H: tl.constexpr, SECTION_W: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    tokens = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    j = tl.arange(0, BLOCK_HALF)
    # interleaved M-RoPE: frequency j takes its angle from row T, H or W (`rope._axis_of_frequency`)
    axis = tl.where((j % 3 == 1) & (j < 3 * SECTION_H), 1, tl.where((j % 3 == 2) & (j < 3 * SECTION_W), 2, 0))
    mask = (tokens < num_tokens)[:, None] & (j < HALF)[None, :]
    offsets = axis[None, :].to(tl.int64) * stride_axis + tokens.to(tl.int64)[:, None] * stride_token
    positions = tl.load(positions_ptr + offsets, mask=mask, other=0)
    inv_freq = tl.load(inv_freq_ptr + j, mask=j < HALF, other=0.0)
    angle = positions.to(tl.float32) * inv_freq[None, :]
    if LIBDEVICE:
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    else:
        cos, sin = tl.cos(angle), tl.sin(angle)
    row = tokens.to(tl.int64)[:, None] * (2 * HALF) + j[None, :]
    tl.store(cos_ptr + row, cos, mask=mask)
    tl.store(cos_ptr + row + HALF, cos, mask=mask)
    tl.store(sin_ptr + row, sin, mask=mask)
    tl.store(sin_ptr + row + HALF, sin, mask=mask)


def mrope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, mrope_section: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ninfer.ops.rope.mrope_cos_sin` in one launch: cos / sin [N, rotary_dim] fp32 for integer
    positions [3, N] (rows T, H, W; any strides, an expanded row view included)."""
    if positions.dim() != 2 or positions.shape[0] != 3 or positions.is_floating_point():
        raise ValueError(f"positions must be integer [3, N], got {tuple(positions.shape)} {positions.dtype}")
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and >= 2, got {rotary_dim}")
    num_tokens, half = positions.shape[1], rotary_dim // 2
    cos = torch.empty((num_tokens, rotary_dim), dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if num_tokens == 0:
        return cos, sin
    inv_freq = mrope_inv_freq(rotary_dim, theta, positions.device)
    block_half = triton.next_power_of_2(half)
    block_tokens = max(1, min(64, 4096 // block_half, triton.next_power_of_2(num_tokens)))
    if schedule.recording:
        schedule.record("rope._mrope_cos_sin_kernel", writes={"cos": cos, "sin": sin})
    _mrope_cos_sin_kernel[(triton.cdiv(num_tokens, block_tokens),)](
        positions, inv_freq, cos, sin, num_tokens, positions.stride(0), positions.stride(1),
        HALF=half, BLOCK_HALF=block_half, SECTION_H=mrope_section[1], SECTION_W=mrope_section[2],
        BLOCK_TOKENS=block_tokens, LIBDEVICE=_LIBDEVICE, num_warps=4,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    return cos, sin
