"""Triton GDN short-conv decode step over the conv state pool (fast path of the decode conv).

Same maths as the reference decode path of `ninfer.targets.qwen3_6.model.gdn_mixer`, in one launch:

    window_in = where(fresh, 0, conv_pool[state_in])                  # [B, C, K-1]
    y, new = ninfer.ops.conv.causal_conv1d_update(x, window_in, weight)  # silu(depthwise conv), fp32 math
    conv_pool[state_out] = new                                        # in place

instead of a gather, a where, the concatenation, the conv, the SiLU, the casts and an index_copy_.

One program owns one (row, channel block): it loads the row's [BLOCK_C, K] window (K-1 pool taps plus the
new input as the last tap) as one tile, reduces it against the weights for y, and stores the window's
last K-1 taps back to the output slot. A row reads exactly the channels it later writes, inside the same
program, so state_out may equal state_in. The work is tiny (a few hundred KB at B = 8); the grid is
(B, C / BLOCK_C) so that even B = 1 spreads the C = 10240 channels over tens of programs.

As in `gdn_decode`: a row with state_in < 0 starts from a zero window (like a fresh row) and a row with
state_out < 0 is computed but not persisted (padding rows of a captured graph). Slots written by one row
must not be read or written by another row of the same call (rows run in no particular order).
No host sync and a grid from static shapes only: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl

__all__ = ["causal_conv1d_update_slots"]


@triton.jit
def _conv_update_kernel(
    x_ptr,
    pool_ptr,
    weight_ptr,
    state_in_ptr,
    state_out_ptr,
    fresh_ptr,
    y_ptr,
    channels,
    x_stride_b,
    y_stride_b,
    weight_stride_c,
    weight_stride_k,
    KERNEL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SETTLED: tl.constexpr,
    LAUNCH_NEXT_EARLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.launch_next(LAUNCH_NEXT_EARLY, USE_PDL)
    if not SETTLED:
        pdl.enter_after(LAUNCH_NEXT_EARLY, USE_PDL)
    row = tl.program_id(0)
    c_block = tl.program_id(1)
    offs_c = c_block * BLOCK_C + tl.arange(0, BLOCK_C)
    taps = tl.arange(0, BLOCK_K)  # window position: 0..K-2 from the pool, K-1 is the new input
    mask_c = offs_c < channels
    state_width = KERNEL - 1

    slot_in = tl.load(state_in_ptr + row).to(tl.int64)
    slot_out = tl.load(state_out_ptr + row).to(tl.int64)
    reads_state = (tl.load(fresh_ptr + row) == 0) & (slot_in >= 0)

    # the pool row is [C, K-1] contiguous, so the [BLOCK_C, K-1] taps of a channel block are one span
    pool_tile = offs_c[:, None] * state_width + taps[None, :]
    state = tl.load(
        pool_ptr + slot_in * channels * state_width + pool_tile,
        mask=mask_c[:, None] & (taps[None, :] < state_width) & reads_state,
        other=0.0,
    )
    weight = tl.load(
        weight_ptr + offs_c[:, None] * weight_stride_c + taps[None, :] * weight_stride_k,
        mask=mask_c[:, None] & (taps[None, :] < KERNEL),
        other=0.0,
    ).to(tl.float32)
    if SETTLED:  # the window's old taps and the weights loaded before the wait, x after it
        pdl.enter_after(LAUNCH_NEXT_EARLY, USE_PDL)
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride_b + offs_c, mask=mask_c, other=0.0)
    # the reference concatenates the state cast to x's dtype: the window holds x-dtype values
    window = tl.where(taps[None, :] == state_width, x[:, None], state.to(x.dtype))
    acc = tl.sum(window.to(tl.float32) * weight, axis=1)
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + row.to(tl.int64) * y_stride_b + offs_c, y.to(y_ptr.dtype.element_ty), mask=mask_c)

    # new state = window taps 1..K-1, i.e. tap j goes to state position j - 1 (tap 0 falls off)
    store_mask = mask_c[:, None] & (taps[None, :] >= 1) & (taps[None, :] < KERNEL) & (slot_out >= 0)
    tl.store(
        pool_ptr + slot_out * channels * state_width + pool_tile - 1,
        window.to(pool_ptr.dtype.element_ty),
        mask=store_mask,
    )


def causal_conv1d_update_slots(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    state_in: torch.Tensor,
    state_out: torch.Tensor,
    fresh: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_c: int = 256,
    num_warps: int = 4,
    settled: bool = False,
    launch_next_early: bool = False,
) -> torch.Tensor:
    """One decode token per row through the depthwise causal conv + SiLU, conv state kept in a slot pool.

    x [B, C] in the model dtype (a strided view is fine if its last dim is contiguous, e.g. a column slice
    of a wider projection output); conv_pool [S, C, K-1] contiguous (updated in place); weight [C, K];
    state_in, state_out [B] integer slots (negative: see the module docstring); fresh [B] bool (the row
    starts from a zero window instead of reading state_in). Returns y [B, C] in x's dtype, equal to the
    reference `causal_conv1d_update(x, where(fresh, 0, conv_pool[state_in]), weight)[0]`, and leaves
    that call's new state in conv_pool[state_out]. `out` may supply y's buffer ([B, C], x's dtype, last
    dim contiguous). `settled=True`: conv_pool and weight are complete before this kernel can launch
    (the pool written by an earlier step, a bound weight; `pdl`), so the old window and the weights load
    before the programmatic-launch wait. `launch_next_early`: see `pdl`.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [B, C] with a contiguous last dim, got {tuple(x.shape)} {x.stride()}")
    batch, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"weight must be [{channels}, K], got {tuple(weight.shape)}")
    kernel = weight.shape[1]
    if conv_pool.dim() != 3 or conv_pool.shape[1:] != (channels, kernel - 1) or not conv_pool.is_contiguous():
        raise ValueError(
            f"conv_pool must be contiguous [S, {channels}, {kernel - 1}], got {tuple(conv_pool.shape)}"
        )
    if state_in.shape != (batch,) or state_out.shape != (batch,) or fresh.shape != (batch,):
        raise ValueError(
            f"state_in {tuple(state_in.shape)}, state_out {tuple(state_out.shape)} and fresh "
            f"{tuple(fresh.shape)} must all be [{batch}]"
        )
    if out is None:
        y = torch.empty((batch, channels), dtype=x.dtype, device=x.device)
    else:
        if out.shape != (batch, channels) or out.dtype != x.dtype or out.stride(-1) != 1:
            raise ValueError(f"out must be [{batch}, {channels}] {x.dtype} with a contiguous last dim")
        y = out
    if batch == 0 or channels == 0:
        return y
    if fresh.dtype == torch.bool:
        fresh = fresh.view(torch.uint8)  # same bytes, a plain integer load in the kernel

    grid = (batch, triton.cdiv(channels, block_c))
    _conv_update_kernel[grid](
        x, conv_pool, weight, state_in, state_out, fresh, y,
        channels, x.stride(0), y.stride(0), weight.stride(0), weight.stride(1),
        KERNEL=kernel, BLOCK_K=triton.next_power_of_2(kernel), BLOCK_C=block_c,
        SETTLED=settled, LAUNCH_NEXT_EARLY=launch_next_early, num_warps=num_warps,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    return y
