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

With T > 1 tokens per row (a speculative verify, a forced-control span) output t convolves the inputs
[K-1 pool taps, x_0 .. x_{T-1}] at t .. t+K-1; the program gathers all T windows as one tile before any
store (the positions do not wait on each other), and the window after token t goes to the row's slot for
position t (per-position state_out [B, T], selected when the accepted prefix is committed) or, with
state_out [B], only the last window persists.

As in `gdn_decode`: a row with state_in < 0 starts from a zero window (like a fresh row) and a row with
state_out < 0 is computed but not persisted (padding rows of a captured graph). Slots written by one row
must not be read or written by another row of the same call (rows run in no particular order).
No host sync and a grid from static shapes only: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl, schedule

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
    BLOCK_T: tl.constexpr,
    TOKENS: tl.constexpr,
    PER_POSITION: tl.constexpr,
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

    # the pool row is [C, K-1] contiguous, so the [BLOCK_C, K-1] taps of a channel block are one span
    pool_tile = offs_c[:, None] * state_width + taps[None, :]
    slot_in = tl.load(state_in_ptr + row).to(tl.int64)
    if TOKENS == 1:
        slot_out = tl.load(state_out_ptr + row).to(tl.int64)
        reads_state = (tl.load(fresh_ptr + row) == 0) & (slot_in >= 0)
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
    else:
        # T tokens: the inputs z = [the K-1 pool taps, x_0 .. x_{T-1}]; output t convolves z[t .. t+K-1]
        # and the window after it is z[t+1 .. t+K-1]. Every position's window is one [BLOCK_T, BLOCK_C,
        # BLOCK_K] tile gathered by a single pair of loads issued before any store (the pool taps only
        # where t + tap < K-1), so the T positions cost one memory round trip, not T dependent ones
        reads_state = (tl.load(fresh_ptr + row) == 0) & (slot_in >= 0)
        weight = tl.load(
            weight_ptr + offs_c[:, None] * weight_stride_c + taps[None, :] * weight_stride_k,
            mask=mask_c[:, None] & (taps[None, :] < KERNEL),
            other=0.0,
        ).to(tl.float32)
        if SETTLED:
            pdl.enter_after(LAUNCH_NEXT_EARLY, USE_PDL)
        steps = tl.arange(0, BLOCK_T)
        live_t = steps < TOKENS
        z = steps[:, None, None] + taps[None, None, :]  # [BLOCK_T, 1, BLOCK_K]: index into z
        from_pool = z < state_width
        in_window = (taps < KERNEL)[None, None, :] & live_t[:, None, None]
        c3 = offs_c[None, :, None]
        m3 = mask_c[None, :, None] & in_window
        pool_row = pool_ptr + slot_in * channels * state_width
        x_rows = x_ptr + (row.to(tl.int64) * TOKENS) * x_stride_b
        old = tl.load(pool_row + c3 * state_width + z, mask=m3 & from_pool & reads_state, other=0.0)
        new = tl.load(x_rows + (z - state_width) * x_stride_b + c3, mask=m3 & ~from_pool, other=0.0)
        window = tl.where(from_pool, old.to(new.dtype), new)  # [BLOCK_T, BLOCK_C, BLOCK_K]
        acc = tl.sum(window.to(tl.float32) * weight[None, :, :], axis=2)  # [BLOCK_T, BLOCK_C]
        y = acc * tl.sigmoid(acc)
        y_rows = y_ptr + (row.to(tl.int64) * TOKENS + steps[:, None]) * y_stride_b + offs_c[None, :]
        tl.store(y_rows, y.to(y_ptr.dtype.element_ty), mask=live_t[:, None] & mask_c[None, :])
        keep = m3 & (taps >= 1)[None, None, :]
        if PER_POSITION:  # the window after position t goes to that position's slot
            slot_t = tl.load(state_out_ptr + row * TOKENS + steps, mask=live_t, other=-1).to(tl.int64)
            tl.store(
                pool_ptr + slot_t[:, None, None] * channels * state_width + c3 * state_width + taps - 1,
                window.to(pool_ptr.dtype.element_ty),
                mask=keep & (slot_t >= 0)[:, None, None],
            )
        else:  # only the last window persists, maybe into the slot read above
            slot_out = tl.load(state_out_ptr + row).to(tl.int64)
            tl.debug_barrier()  # every thread's pool reads come before any thread's store
            tl.store(
                pool_ptr + slot_out * channels * state_width + c3 * state_width + taps - 1
                + steps[:, None, None] * 0,  # broadcast to the window's shape; only the last position stores
                window.to(pool_ptr.dtype.element_ty),
                mask=keep & (steps == TOKENS - 1)[:, None, None] & (slot_out >= 0),
            )


def causal_conv1d_update_slots(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    state_in: torch.Tensor,
    state_out: torch.Tensor,
    fresh: torch.Tensor,
    *,
    tokens_per_row: int = 1,
    out: torch.Tensor | None = None,
    block_c: int | None = None,
    num_warps: int = 4,
    settled: bool = False,
    launch_next_early: bool = False,
) -> torch.Tensor:
    """``tokens_per_row`` (T) tokens per row through the depthwise causal conv + SiLU, the conv state kept
    in a slot pool.

    x [B*T, C] in the model dtype, row r's tokens at rows r*T .. r*T+T-1 (a strided view is fine if its
    last dim is contiguous, e.g. a column slice of a wider projection output); conv_pool [S, C, K-1]
    contiguous (updated in place); weight [C, K]; state_in [B] integer slots, fresh [B] bool (the row
    starts from a zero window instead of reading state_in); state_out [B] (the window after the row's last
    token) or, for T > 1, [B, T] (the window after each token, a speculative verify's per-position states;
    those slots must differ from the state_in slots). Negative slots: see the module docstring. Returns
    y [B*T, C] in x's dtype, equal to T steps of the reference `causal_conv1d_update` from
    `where(fresh, 0, conv_pool[state_in])`, and leaves the windows in conv_pool. `out` may supply y's
    buffer ([B*T, C], x's dtype, last dim contiguous). `settled=True`: conv_pool and weight are complete
    before this kernel can launch (the pool written by an earlier step, a bound weight; `pdl`), so they
    load before the programmatic-launch wait (at T = 1 the old window; at T > 1 only the weights).
    `launch_next_early`: see `pdl`.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [B*T, C] with a contiguous last dim, got {tuple(x.shape)} {x.stride()}")
    tokens = tokens_per_row
    if tokens < 1 or x.shape[0] % tokens:
        raise ValueError(f"x has {x.shape[0]} rows, not a multiple of tokens_per_row={tokens}")
    total, channels = x.shape
    batch = total // tokens
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"weight must be [{channels}, K], got {tuple(weight.shape)}")
    kernel = weight.shape[1]
    if conv_pool.dim() != 3 or conv_pool.shape[1:] != (channels, kernel - 1) or not conv_pool.is_contiguous():
        raise ValueError(
            f"conv_pool must be contiguous [S, {channels}, {kernel - 1}], got {tuple(conv_pool.shape)}"
        )
    per_position = state_out.dim() == 2
    out_shape = (batch, tokens) if per_position else (batch,)
    if state_in.shape != (batch,) or state_out.shape != out_shape or fresh.shape != (batch,):
        raise ValueError(
            f"state_in {tuple(state_in.shape)} and fresh {tuple(fresh.shape)} must be [{batch}], state_out "
            f"{tuple(state_out.shape)} [{batch}] or [{batch}, {tokens}]"
        )
    if per_position and tokens == 1:
        state_out = state_out.view(batch)  # one position: the same as the final window
        per_position = False
    if per_position and not state_out.is_contiguous():
        state_out = state_out.contiguous()
    if out is None:
        y = torch.empty((total, channels), dtype=x.dtype, device=x.device)
    else:
        if out.shape != (total, channels) or out.dtype != x.dtype or out.stride(-1) != 1:
            raise ValueError(f"out must be [{total}, {channels}] {x.dtype} with a contiguous last dim")
        y = out
    if batch == 0 or channels == 0:
        return y
    if fresh.dtype == torch.bool:
        fresh = fresh.view(torch.uint8)  # same bytes, a plain integer load in the kernel

    if block_c is None:  # T > 1 holds T windows a channel: narrower blocks, more programs
        block_c = 256 if tokens == 1 else 64
    grid = (batch, triton.cdiv(channels, block_c))
    if schedule.recording:
        early = {"state_in": state_in, "fresh": fresh, "weight": weight}  # before the wait when settled
        if tokens == 1:  # and the output slot and the old window
            early |= {"state_out": state_out, "conv_pool": conv_pool}
        schedule.record(
            "conv_update._conv_update_kernel", launch_next_early=launch_next_early,
            early_reads=early if settled else {}, writes={"y": y, "conv_pool": conv_pool},
        )  # fmt: skip
    _conv_update_kernel[grid](
        x, conv_pool, weight, state_in, state_out, fresh, y,
        channels, x.stride(0), y.stride(0), weight.stride(0), weight.stride(1),
        KERNEL=kernel, BLOCK_K=triton.next_power_of_2(kernel), BLOCK_C=block_c,
        BLOCK_T=triton.next_power_of_2(tokens), TOKENS=tokens,
        PER_POSITION=per_position, SETTLED=settled, LAUNCH_NEXT_EARLY=launch_next_early,
        num_warps=num_warps, USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    return y
