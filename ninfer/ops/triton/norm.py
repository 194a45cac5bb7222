"""Triton RMS norms of Qwen3.6 (fast paths of `ninfer.ops.norm`), bit-for-bit rounding order.

- `rms_norm(x, w)`: the zero-centred norm, y = (x / rms(x)) * (1 + w) in fp32, cast to x's dtype.
- `add_rms_norm(x, residual, w)`: summed = x + residual rounded to x's dtype (as the torch add), and
  normed = rms_norm(summed, w): the decoder layer's `x = x + mixed; rms_norm(x)` with one read of each
  input and one write of each output.
- `add_rms_norm_partials(partials, residual, w)`: the same with x given as a split-K GEMV's unreduced
  fp32 slabs (`skinny_gemm.skinny_linear_partials`), summed here in the reduce kernel's order and rounded
  to the residual's dtype: the projection's reduce launch and its dependent wait are saved. summed is bit
  for bit the reduce + `add_rms_norm` result; normed up to its fp32 sum of squares, whose order follows
  the launch's warps (more here, for the slabs' loads).
- `gated_rms_norm(x, w, z)`: the GDN output norm, ((x / rms(x)) cast, times the plain w in the model
  dtype) times silu(z) in fp32, cast. x is first cast to z's dtype, which fuses the `o.to(z.dtype)` of
  the model's `gdn_gated_norm` (x may be the fp32 recurrence output); the result is in z's dtype.

Every row is reduced whole in registers (N <= 8192 here: 5120 / 2048 hidden, 256 q/k heads, 128 GDN
value heads), so each element is read from memory once and written once: the norms are pure bandwidth
at prefill sizes. Short rows are packed several to a program ([ROWS, BLOCK_N] tiles of a few thousand
elements) so that programs stay big enough to stream well, but never so many that a small batch leaves
the GPU's SMs idle. Rows may be strided (e.g. q [T, heads, 256] sliced out of the interleaved q/gate
projection): a row's address is outer * stride_outer + inner * stride_inner over a [outer, inner, N]
view, the last dim contiguous. The launch shape depends only on static shapes: CUDA-graph capturable.

Two launch options change when the kernel reads, never what it computes (`pdl`; both off by default):
- `settled=True`: the norm weight is a bound weight and the residual's writer finished before this
  kernel can launch (`pdl`: the residual stream of an earlier block, four launches back in the model's
  forward), so both load before the programmatic-launch wait, while the previous kernel still runs:
  measured faster in the decode graph at one and eight rows, the residual's share small, it having left
  L2 by then (docs/benchmarks.md, "Why the kernels are as they are", norms).
- `launch_next_early=True`: the next kernel may launch before this one waits (what it may read before its
  own wait: `pdl`); the fast table asks for it at one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl, schedule

__all__ = ["rms_norm", "add_rms_norm", "add_rms_norm_partials", "gated_rms_norm"]

_TILE_ELEMENTS = 4096  # elements per program for short rows: enough in flight per SM to stream
_TARGET_PROGRAMS = 132  # H200 SM count: short-row batches are split at least this wide when they can be

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _row_offsets(rows, inner, stride_outer, stride_inner):
    """Element offset of each row's start in a [outer, inner, N] strided view (int64)."""
    rows = rows.to(tl.int64)
    return (rows // inner) * stride_outer + (rows % inner) * stride_inner


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    num_rows,
    n,
    x_inner,
    x_stride_outer,
    x_stride_inner,
    x_stride_split,
    r_inner,
    r_stride_outer,
    r_stride_inner,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    SPLITS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SETTLED: tl.constexpr,
    LAUNCH_NEXT_EARLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.launch_next(LAUNCH_NEXT_EARLY, USE_PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask_n = cols < n
    mask = (rows < num_rows)[:, None] & mask_n[None, :]
    x_tile = _row_offsets(rows, x_inner, x_stride_outer, x_stride_inner)[:, None] + cols[None, :]
    out_tile = rows.to(tl.int64)[:, None] * n + cols[None, :]  # outputs are contiguous rows
    r_tile = _row_offsets(rows, r_inner, r_stride_outer, r_stride_inner)[:, None] + cols[None, :]
    if SETTLED:  # the weight and the residual stream from DRAM while the previous kernel runs
        weight = tl.load(weight_ptr + cols, mask=mask_n, other=0.0)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + r_tile, mask=mask, other=0.0)
    pdl.enter_after(LAUNCH_NEXT_EARLY, USE_PDL)
    x = tl.load(x_ptr + x_tile, mask=mask, other=0.0)
    if not SETTLED:
        weight = tl.load(weight_ptr + cols, mask=mask_n, other=0.0)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + r_tile, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        if SPLITS > 1:
            # x is split-K partial slabs: the skinny GEMV's reduce, in its order, rounded to its dtype
            x = x.to(tl.float32)
            for split in tl.static_range(1, SPLITS):
                x += tl.load(x_ptr + split * x_stride_split + x_tile, mask=mask, other=0.0)
            x = x.to(residual.dtype)
        # the torch add in x's dtype: exact fp32 sum of the two inputs, one rounding to x's dtype
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(summed_ptr + out_tile, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=1) / n + eps)
    scale = 1.0 + weight.to(tl.float32)
    y = (x32 * inv_rms[:, None]) * scale[None, :]
    tl.store(out_ptr + out_tile, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    z_ptr,
    weight_ptr,
    out_ptr,
    num_rows,
    n,
    x_inner,
    x_stride_outer,
    x_stride_inner,
    z_inner,
    z_stride_outer,
    z_stride_inner,
    eps,
    NORMED_DTYPE: tl.constexpr,
    WEIGHTED_DTYPE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LAUNCH_NEXT_EARLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter_launching_next(LAUNCH_NEXT_EARLY, USE_PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask_n = cols < n
    mask = (rows < num_rows)[:, None] & mask_n[None, :]
    x_tile = _row_offsets(rows, x_inner, x_stride_outer, x_stride_inner)[:, None] + cols[None, :]
    z_tile = _row_offsets(rows, z_inner, z_stride_outer, z_stride_inner)[:, None] + cols[None, :]
    # x is cast to the model (z's) dtype first, as gdn_gated_norm does before the norm
    x32 = tl.load(x_ptr + x_tile, mask=mask, other=0.0).to(NORMED_DTYPE).to(tl.float32)
    z32 = tl.load(z_ptr + z_tile, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=1) / n + eps)
    # rounding steps of the reference: normed -> model dtype, w * normed -> promoted dtype, then fp32
    normed = (x32 * inv_rms[:, None]).to(NORMED_DTYPE).to(tl.float32)
    weighted = (weight[None, :] * normed).to(WEIGHTED_DTYPE).to(tl.float32)
    y = weighted * (z32 * tl.sigmoid(z32))
    out_tile = rows.to(tl.int64)[:, None] * n + cols[None, :]
    tl.store(out_ptr + out_tile, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x [..., N] -> (x, inner, stride_outer, stride_inner): row r starts at (r // inner, r % inner).

    Works without a copy for any x whose last dim is contiguous and whose leading dims but the last one
    collapse (e.g. a [T, heads, D] head slice of a wider projection output); otherwise copies.
    """
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x, 1, 0, 0
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    try:
        view = x.view(-1, x.shape[-2], x.shape[-1])
    except RuntimeError:  # leading dims do not collapse into one stride
        view = x.contiguous().view(-1, x.shape[-2], x.shape[-1])
    return view, view.shape[1], view.stride(0), view.stride(1)


def _launch(num_rows: int, n: int) -> tuple[int, int, int, int]:
    """(ROWS per program, BLOCK_N, grid size, num_warps) from static shapes only."""
    block_n = triton.next_power_of_2(n)
    rows_per_program = max(1, _TILE_ELEMENTS // block_n)
    # a small batch of short rows: fewer rows per program, so more SMs share the latency-bound work
    while rows_per_program > 1 and triton.cdiv(num_rows, rows_per_program) < _TARGET_PROGRAMS:
        rows_per_program //= 2
    tile = rows_per_program * block_n
    num_warps = min(8, max(1, tile // 512))
    return rows_per_program, block_n, triton.cdiv(num_rows, rows_per_program), num_warps


def _output(x: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    if out.shape != x.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {tuple(x.shape)} {dtype} tensor")
    return out


def _check_weight(weight: torch.Tensor, n: int) -> None:
    if weight.shape != (n,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{n}] vector, got {tuple(weight.shape)}")


def _rms_norm_launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    summed: torch.Tensor | None,
    splits: int = 1,
    split_stride: int = 0,
    *,
    settled: bool,
    launch_next_early: bool,
) -> None:
    """splits > 1: x is the first of that many slabs, split_stride elements apart, summed into x."""
    n = x.shape[-1]
    _check_weight(weight, n)
    num_rows = x.numel() // n if n else 0
    if num_rows == 0:
        return
    x_rows, x_inner, x_stride_outer, x_stride_inner = _as_rows(x)
    if residual is None:
        r_rows, r_inner, r_stride_outer, r_stride_inner = x_rows, x_inner, x_stride_outer, x_stride_inner
    else:
        r_rows, r_inner, r_stride_outer, r_stride_inner = _as_rows(residual)
    rows_per_program, block_n, grid, num_warps = _launch(num_rows, n)
    if splits > 1:  # warps for every slab's loads (35B-A3B's four: 8 warps; docs/benchmarks.md, norms)
        num_warps = min(8, max(num_warps, rows_per_program * block_n * splits // 512))
    if schedule.recording:
        schedule.record(
            "norm._rms_norm_kernel", launch_next_early=launch_next_early,
            early_reads={"weight": weight, "residual": residual} if settled else {},
            writes={"out": out, "summed": summed},
        )  # fmt: skip
    _rms_norm_kernel[(grid,)](
        x_rows, r_rows, weight, out, out if summed is None else summed,
        num_rows, n, x_inner, x_stride_outer, x_stride_inner, split_stride, r_inner, r_stride_outer,
        r_stride_inner, eps, HAS_RESIDUAL=residual is not None, SPLITS=splits, ROWS=rows_per_program,
        BLOCK_N=block_n, SETTLED=settled, LAUNCH_NEXT_EARLY=launch_next_early,
        num_warps=num_warps,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    settled: bool = False,
    launch_next_early: bool = False,
) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim, = `ninfer.ops.norm.rms_norm`: x [..., N] -> y in x's dtype.

    weight [N] (any float dtype). x may be strided (last dim contiguous). The result is contiguous;
    `out` may supply it (contiguous, x's shape and dtype). `settled` and `launch_next_early`: see the
    module docstring (programmatic dependent launch only; the result is the same).
    """
    y = _output(x, x.dtype, out, "out")
    _rms_norm_launch(x, None, weight, eps, y, None, settled=settled, launch_next_early=launch_next_early)
    return y


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    summed_out: torch.Tensor | None = None,
    settled: bool = False,
    launch_next_early: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed): summed = x + residual in x's dtype, normed = rms_norm(summed, weight, eps).

    x and residual [..., N] of one dtype and shape. Both results are contiguous in x's shape and dtype;
    `out` / `summed_out` may supply them, and `summed_out` may be x or residual itself (each element is
    read before it is written, by the same program), which updates the residual stream in place.
    `settled` and `launch_next_early`: see the module docstring.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
        )
    normed = _output(x, x.dtype, out, "out")
    summed = _output(x, x.dtype, summed_out, "summed_out")
    _rms_norm_launch(
        x, residual, weight, eps, normed, summed, settled=settled, launch_next_early=launch_next_early
    )
    return normed, summed


def add_rms_norm_partials(
    partials: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    summed_out: torch.Tensor | None = None,
    settled: bool = False,
    launch_next_early: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm(x, residual, ...)` with x given unreduced: partials [S, *residual.shape] contiguous,
    as `skinny_gemm.skinny_linear_partials` returns them, and x their slab-order fp32 sum (slab 0 first)
    rounded to residual's dtype, which is what the GEMV's own reduce writes (so summed is bit-equal to the
    reduce + `add_rms_norm`; normed reduces its squares with more warps here). S == 1: x = partials[0], in
    residual's dtype. Results and `out` / `summed_out` as in `add_rms_norm` (residual's shape and dtype)."""
    if partials.dim() != residual.dim() + 1 or partials.shape[1:] != residual.shape:
        raise ValueError(f"partials must be [S, *{tuple(residual.shape)}], got {tuple(partials.shape)}")
    if not partials.is_contiguous():
        raise ValueError("partials must be contiguous slabs")
    splits = partials.shape[0]
    flags = {"settled": settled, "launch_next_early": launch_next_early}
    if splits == 1:
        return add_rms_norm(partials[0], residual, weight, eps, out=out, summed_out=summed_out, **flags)
    if partials.dtype != torch.float32:
        raise ValueError(f"split partials must be fp32, got {partials.dtype}")
    normed = _output(residual, residual.dtype, out, "out")
    summed = _output(residual, residual.dtype, summed_out, "summed_out")
    _rms_norm_launch(partials[0], residual, weight, eps, normed, summed, splits, partials.stride(0), **flags)
    return normed, summed


def gated_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    launch_next_early: bool = False,
) -> torch.Tensor:
    """Gated RMSNorm of the GDN output = `ninfer.ops.norm.gated_rms_norm(x.to(z.dtype), weight, z, eps)`.

    x, z [..., N] of one shape (x in any float dtype, e.g. the fp32 recurrence output; both may be
    strided with a contiguous last dim), weight [N] plain (not zero-centred). The result is in z's dtype,
    contiguous; `out` may supply it. With x already in z's dtype this is exactly the reference.
    `launch_next_early`: see the module docstring.
    """
    if z.shape != x.shape:
        raise ValueError(f"z {tuple(z.shape)} must match x {tuple(x.shape)}")
    if z.dtype not in _TL_DTYPES or weight.dtype not in _TL_DTYPES:
        raise ValueError(f"unsupported dtypes: z {z.dtype}, weight {weight.dtype}")
    n = x.shape[-1]
    _check_weight(weight, n)
    y = _output(x, z.dtype, out, "out")
    num_rows = x.numel() // n if n else 0
    if num_rows == 0:
        return y
    x_rows, x_inner, x_stride_outer, x_stride_inner = _as_rows(x)
    z_rows, z_inner, z_stride_outer, z_stride_inner = _as_rows(z)
    rows_per_program, block_n, grid, num_warps = _launch(num_rows, n)
    if schedule.recording:
        schedule.record("norm._gated_rms_norm_kernel", launch_next_early=launch_next_early, writes={"out": y})
    _gated_rms_norm_kernel[(grid,)](
        x_rows, z_rows, weight, y,
        num_rows, n, x_inner, x_stride_outer, x_stride_inner, z_inner, z_stride_outer, z_stride_inner, eps,
        NORMED_DTYPE=_TL_DTYPES[z.dtype],
        WEIGHTED_DTYPE=_TL_DTYPES[torch.promote_types(weight.dtype, z.dtype)],
        ROWS=rows_per_program, BLOCK_N=block_n, LAUNCH_NEXT_EARLY=launch_next_early, num_warps=num_warps,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    return y
