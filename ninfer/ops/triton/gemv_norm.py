"""One-row GEMV with a fused residual-add + RMSNorm epilogue, in ONE launch (decode at B = 1).

Computes, for act [1, K], w [N, K], residual [1, N] and the zero-centred norm weight [N]:

    y = F.linear(act, w)                  fp32 accumulation, rounded to act's dtype
    x = y + residual                      rounded to act's dtype (the torch add)
    h = rms_norm(x, norm_weight, eps)     fp32 math, x / rms(x) * (1 + w), cast to act's dtype

i.e. `skinny_linear` followed by `ninfer.ops.triton.norm.add_rms_norm`, with the same rounding steps. At
decode B = 1 every Qwen3.6 layer ends its mixer and its MLP this way (o_proj / GDN out_proj / down_proj,
then the residual add and the next norm): fusing the two saves one launch and one dependency edge each,
128 of them per 27B step.

Shape of the kernel. The GEMV is the `skinny_linear` M = 1 one (same `SkinnyConfig`, same K split, same
fixed-order split-K sum, so y should have the same bits): a grid of (column blocks, K splits) programs, each
streaming its [BLOCK_N, K range] weight strip once. The norm needs the whole row (its sum of squares),
so it cannot run per column block; instead the LAST program to finish runs it:

1. each program stores its y slice: rounded to the model dtype straight into ``out_h`` (used as scratch:
   the epilogue overwrites it with h) without split-K, or as an fp32 partial [split, N] with split-K;
2. ``tl.debug_barrier()`` (bar.sync), then one thread takes a ticket: an ``atomic_add`` acq_rel at gpu
   scope on a persistent int32 counter;
3. the program that draws ticket == num_programs - 1 knows every other program has stored its slice. It
   sums the partials in split order (as `skinny_linear`'s reduce does), rounds y, adds the residual and
   normalises: a row of up to _EPILOGUE_TILE elements (35B: 2048) in one register tile, all its loads in
   flight at once; a longer one (27B: 5120) in tiles, pass 1 storing x and summing squares, pass 2
   re-reading x and writing h. Then it resets the counter to 0 for the next launch (or graph replay).

Why the ordering is right (PTX memory model, as CUTLASS's split-K semaphores rely on): a program's
stores precede its bar.sync, which synchronises with the ticket thread, whose atomic is a gpu-scope
release; the last program's atomic is a gpu-scope acquire that reads from the release sequence of every
other ticket (the counter's modification order), and Triton hands the ticket to the CTA's other threads
through shared memory behind a second bar.sync; so every y store is causally before every epilogue
load. The epilogue loads use ``.cg`` (cached in L2 only), so no stale L1 line can be read either. The
counter reset is a plain store: the next launch on the stream starts after this grid completed (with
PDL too: `pdl.enter` waits for the previous grid's completion and memory flush before any access).

The tail this adds is the last program's epilogue: the ticket atomic, then a few L2 round trips (one
load per tile and pass, the rows are in L2) and the stores, instead of a second kernel's launch gap plus
its own run. The epilogue tile is capped (see _EPILOGUE_TILE) so that the kernel keeps the GEMV's
register count, hence its occupancy.

Limits: M = 1 only (the caller uses skinny_linear + add_rms_norm for M > 1). One counter per device is
shared by every call, so calls on one device must be stream-ordered (the engine runs one stream; two
streams running this op concurrently would corrupt the tickets). Graph capturable: no host sync, the grid
and every launch option come from static shapes; the counter is allocated (zeroed) on the first call,
which therefore must not be inside a CUDA-graph capture (a warm-up call does it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl
from ninfer.ops.triton.skinny_gemm import SkinnyConfig, _sm_count, default_config

__all__ = ["linear_add_rms_norm"]

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DOT_ROWS = tl.constexpr(16)  # the MMA's smallest N side: act is padded to it in the dot variant
# Epilogue tile: a row up to this long is normalised as one register tile (35B: 2048, all its loads in
# flight at once), a longer one in tiles of this size, two passes (27B: 5120 = 2 tiles). Larger tiles cost
# registers the whole kernel pays for: at 4 warps a 4096 tile keeps the kernel at the GEMV's own ~80
# registers (sm_90 ptxas), a whole-row 8192 tile needs ~170, which would cut the CTAs per SM by half.
_EPILOGUE_TILE = 4096

_TICKET_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _ticket_counter(device: torch.device) -> torch.Tensor:
    """The device's persistent int32 ticket counter ([1], zero between launches), allocated once."""
    counter = _TICKET_COUNTERS.get(device)
    if counter is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a counter allocated (and zeroed) inside a capture would only be zeroed at replay
            raise RuntimeError(
                "linear_add_rms_norm allocates its ticket counter on first use: call it once outside "
                "CUDA-graph capture (a warm-up call) before capturing it"
            )
        counter = torch.zeros(1, dtype=torch.int32, device=device)
        _TICKET_COUNTERS[device] = counter
    return counter


@triton.jit
def _gemv_slice(
    act_ptr,
    w_ptr,
    offs_n,
    mask_n,
    k_begin,
    k_end,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """y[offs_n] over K range [k_begin, k_end) in fp32: the program's share of act @ w^T."""
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    if USE_DOT:
        # act padded to the MMA's 16 rows (row 0 real, the rest masked to 0); weight rows on the M side
        pad_rows = tl.arange(0, _DOT_ROWS)
        is_row0 = pad_rows == 0
        acc = tl.zeros([BLOCK_N, _DOT_ROWS], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            ks = k0 + offs_k
            mask_k = ks < k_end
            w = tl.load(
                w_rows + ks[None, :],
                mask=mask_n[:, None] & mask_k[None, :],
                other=0.0,
                eviction_policy="evict_first",  # streamed once: leave L2 to the activations
            )
            a = tl.load(
                act_ptr + pad_rows[:, None] * 0 + ks[None, :],
                mask=is_row0[:, None] & mask_k[None, :],
                other=0.0,
            )
            acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PRECISION)
        # only column 0 is real (where(), not a plain sum, so a non-finite weight cannot leak via 0 * inf)
        y = tl.sum(tl.where(is_row0[None, :], acc, 0.0), axis=1)
    else:
        # elementwise products in a [BLOCK_N, BLOCK_K] register tile, reduced over K once after the loop
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K * UNROLL):
            for step in tl.static_range(UNROLL):  # several steps' loads in flight per trip
                ks = k0 + step * BLOCK_K + offs_k
                mask_k = ks < k_end
                w = tl.load(
                    w_rows + ks[None, :],
                    mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0,
                    eviction_policy="evict_first",  # streamed once: leave L2 to the activations
                )
                a = tl.load(act_ptr + ks, mask=mask_k, other=0.0)
                acc2 += w.to(tl.float32) * a.to(tl.float32)[None, :]
        y = tl.sum(acc2, axis=1)
    return y


@triton.jit
def _add_rms_norm_row(
    y_ptr,
    stride_ys,
    residual_ptr,
    norm_weight_ptr,
    h_ptr,
    x_ptr,
    N,
    eps,
    SPLIT_K: tl.constexpr,
    EPILOGUE_BLOCK: tl.constexpr,
    ROW_IN_ONE_TILE: tl.constexpr,
):
    """The last program's epilogue over the whole row: x = round(y) + residual, h = rms_norm(x).

    y comes from the other programs: its loads are ``.cg`` (at L2, never a stale L1 line). The split-K
    partials are summed in split order from 0, as skinny_linear's reduce does, then rounded as F.linear's
    output; x = y + residual is the torch add (exact fp32 sum, one rounding); h as `rms_norm` computes it.
    """
    offs = tl.arange(0, EPILOGUE_BLOCK)
    model_dtype = x_ptr.dtype.element_ty
    if ROW_IN_ONE_TILE:
        # every load of the row issued at once (one L2 round trip), x kept in registers for h
        mask = offs < N
        total = tl.zeros([EPILOGUE_BLOCK], dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):
            total += tl.load(y_ptr + split * stride_ys + offs, mask=mask, other=0.0, cache_modifier=".cg").to(
                tl.float32
            )
        residual = tl.load(residual_ptr + offs, mask=mask, other=0.0)
        scale = 1.0 + tl.load(norm_weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        summed = (total.to(model_dtype).to(tl.float32) + residual.to(tl.float32)).to(model_dtype)
        summed32 = summed.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(summed32 * summed32, axis=0) / N + eps)
        # all of y and residual is read (h may hold y, x may be residual) before anything is written
        tl.debug_barrier()
        tl.store(x_ptr + offs, summed, mask=mask)
        tl.store(h_ptr + offs, ((summed32 * inv_rms) * scale).to(h_ptr.dtype.element_ty), mask=mask)
    else:
        # rows longer than one tile: pass 1 stores x and sums squares, pass 2 re-reads x and writes h
        squares = tl.zeros([EPILOGUE_BLOCK], dtype=tl.float32)
        for start in range(0, N, EPILOGUE_BLOCK):
            cols = start + offs
            mask = cols < N
            total = tl.zeros([EPILOGUE_BLOCK], dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                total += tl.load(
                    y_ptr + split * stride_ys + cols, mask=mask, other=0.0, cache_modifier=".cg"
                ).to(tl.float32)
            residual = tl.load(residual_ptr + cols, mask=mask, other=0.0)
            # x may be residual itself: each element is read before it is written, by the same thread
            summed = (total.to(model_dtype).to(tl.float32) + residual.to(tl.float32)).to(model_dtype)
            tl.store(x_ptr + cols, summed, mask=mask)
            summed32 = summed.to(tl.float32)
            squares += summed32 * summed32
        inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / N + eps)
        tl.debug_barrier()  # pass 2 re-reads x, and in h's place y may still be read by another thread
        for start in range(0, N, EPILOGUE_BLOCK):
            cols = start + offs
            mask = cols < N
            summed32 = tl.load(x_ptr + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            scale = 1.0 + tl.load(norm_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(h_ptr + cols, ((summed32 * inv_rms) * scale).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _linear_add_rms_norm_kernel(
    act_ptr, w_ptr, residual_ptr, norm_weight_ptr, y_ptr, h_ptr, x_ptr, counter_ptr,
    N, K, k_per_split, stride_wn, stride_ys, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EPILOGUE_BLOCK: tl.constexpr, ROW_IN_ONE_TILE: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    y = _gemv_slice(
        act_ptr, w_ptr, offs_n, mask_n, k_begin, k_end, stride_wn,
        BLOCK_N, BLOCK_K, UNROLL, USE_DOT, DOT_PRECISION,
    )  # fmt: skip
    # model dtype without split-K (y_ptr is out_h), fp32 partial slab `pid_k` with it
    tl.store(y_ptr + pid_k * stride_ys + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)

    # every thread's y stores are issued before the ticket thread's release (bar.sync, then acq_rel)
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
        # all the other programs have stored their slices: this one does the row's add + norm
        _add_rms_norm_row(
            y_ptr, stride_ys, residual_ptr, norm_weight_ptr, h_ptr, x_ptr, N, eps,
            SPLIT_K, EPILOGUE_BLOCK, ROW_IN_ONE_TILE,
        )  # fmt: skip
        tl.store(counter_ptr, 0)  # every ticket is taken: ready for the next launch / graph replay


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of a and b intersect (same device assumed)."""
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + a.numel() * a.element_size()
    b_end = b_start + b.numel() * b.element_size()
    return a_start < b_end and b_start < a_end


def _output(out: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if out.shape != like.shape or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {tuple(like.shape)} {like.dtype} tensor")
    return out


def linear_add_rms_norm(
    act: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    *,
    out_h: torch.Tensor | None = None,
    out_x: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, x) = add_rms_norm(F.linear(act, w), residual, norm_weight, eps) for ONE row, in one launch.

    act [1, K] and w [N, K] share a dtype (bf16, fp16 or fp32); w needs a unit stride along K (a row block
    of a stacked buffer is fine). residual [1, N] in act's dtype, contiguous; norm_weight [N] contiguous,
    any float dtype, zero-centred (the scale is 1 + w). Returns x = F.linear(act, w) + residual and
    h = rms_norm(x), both [1, N] contiguous in act's dtype, with the rounding steps of `skinny_linear`
    then `ninfer.ops.triton.norm.add_rms_norm`. ``out_x`` may be ``residual`` itself (updates the residual
    stream in place); ``out_h`` must not overlap act, residual or out_x (it is scratch for y until the
    end). ``config`` overrides the GEMV tiling (default: `default_config(1, N, K)`, as skinny_linear).
    Raises ValueError for more than one row (use skinny_linear + add_rms_norm there) or bad inputs.
    """
    if act.dim() != 2 or w.dim() != 2 or act.shape[1] != w.shape[1]:
        raise ValueError(f"need act [1, K] and w [N, K], got act {tuple(act.shape)} w {tuple(w.shape)}")
    if act.shape[0] != 1:
        raise ValueError(f"linear_add_rms_norm takes exactly one row (M = 1), got M={act.shape[0]}")
    n, k = w.shape
    if n == 0 or k == 0:
        raise ValueError(f"need N > 0 and K > 0, got N={n} K={k}")
    if act.dtype != w.dtype or act.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"act and w must share a dtype in {_SUPPORTED_DTYPES}, got {act.dtype} and {w.dtype}"
        )
    if w.stride(1) != 1:
        raise ValueError("w must have a unit stride along K (row-major)")
    if residual.shape != (1, n) or residual.dtype != act.dtype or not residual.is_contiguous():
        raise ValueError(
            f"residual must be a contiguous [1, {n}] {act.dtype} tensor, got {tuple(residual.shape)} "
            f"{residual.dtype}"
        )
    if norm_weight.shape != (n,) or not norm_weight.is_contiguous() or not norm_weight.is_floating_point():
        raise ValueError(
            f"norm_weight must be a contiguous float [{n}] vector, got {tuple(norm_weight.shape)}"
        )
    if act.stride(1) != 1:
        act = act.contiguous()
    h = _output(out_h, residual, "out_h")
    x = _output(out_x, residual, "out_x")
    if x.data_ptr() != residual.data_ptr() and _overlaps(x, residual):
        raise ValueError("out_x must be residual itself or not overlap it")
    for other, name in ((act, "act"), (residual, "residual"), (x, "out_x")):
        if _overlaps(h, other):
            raise ValueError(f"out_h must not overlap {name} (it holds y until the epilogue)")
    config = config or default_config(1, n, k, _sm_count(act.device))
    config.check()

    # K ranges are whole steps; splits that would start past K are dropped (the count stays static)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split_k = triton.cdiv(k, k_per_split)
    # without split-K, y goes straight into h's buffer in the model dtype (the epilogue overwrites it)
    y_scratch = torch.empty((split_k, n), dtype=torch.float32, device=act.device) if split_k > 1 else h
    epilogue_block = min(_EPILOGUE_TILE, triton.next_power_of_2(n))
    grid = (triton.cdiv(n, config.block_n), split_k)
    _linear_add_rms_norm_kernel[grid](
        act, w, residual, norm_weight, y_scratch, h, x, _ticket_counter(act.device),
        n, k, k_per_split, w.stride(0), n, eps,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, UNROLL=config.unroll, SPLIT_K=split_k,
        USE_DOT=config.use_dot, DOT_PRECISION="ieee" if act.dtype == torch.float32 else "tf32",
        EPILOGUE_BLOCK=epilogue_block, ROW_IN_ONE_TILE=epilogue_block >= n,
        num_warps=config.num_warps, num_stages=config.num_stages,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    return h, x
