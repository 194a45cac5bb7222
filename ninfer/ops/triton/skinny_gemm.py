"""Triton skinny GEMM (decode GEMV): ``out [M, N] = x [M, K] @ w [N, K]^T`` for M = 1..16 rows.

Same result as ``F.linear(x, w)`` in x's dtype (bf16 / fp16 / fp32), with fp32 accumulation. At decode
a projection is a pure weight stream: M <= 8 rows against an [N, K] weight of tens to hundreds of MB, so
the time is the weight bytes over the HBM bandwidth and the kernel is shaped only to keep HBM busy:

- each program owns a BLOCK_N slice of output columns and streams its [BLOCK_N, K] weight strip once,
  in [BLOCK_N, BLOCK_K] tiles of whole 16-byte vectors along the contiguous K (coalesced rows);
- x (a few KB) is re-read per tile and served from L1/L2, so no HBM traffic beyond the weights;
- many programs (small BLOCK_N) or split-K keep enough loads in flight on all SMs.

Two kernels, picked by ``SkinnyConfig.use_dot``:

- ``fma``: elementwise fp32 products accumulated in a [BLOCK_M, BLOCK_N, BLOCK_K] register tile and
  reduced over K once after the loop, so each step is loads + FMAs only (no cross-thread reduction per
  step); ``unroll`` steps per loop trip let the compiler issue their loads together, and many small
  programs per SM keep more in flight. Meant for M = 1 (the accumulator grows with M).
- ``dot``: ``tl.dot(w_tile, x_tile^T)`` with x padded to 16 rows (the smallest MMA side) and the weight
  tile as the MMA's M side (so BLOCK_N >= 64 can use Hopper's wgmma); the loop's loads are software
  pipelined over ``num_stages`` shared-memory buffers. Its cost hardly depends on M <= 16.

Split-K (``split_k > 1``) gives each of ``split_k`` programs per column block a contiguous K range; they
write fp32 partials [split_k, M, N] and a second launch sums them in a fixed order, so results are
deterministic (no atomics). Everything is sized from static shapes: the call is CUDA-graph capturable.

``conv=ConvStep(...)`` applies the Gated DeltaNet's short-conv decode step to the first C output columns
in the epilogue (the GDN input projection's qkv columns; `conv_update` has the same maths as a kernel of
its own): a column's program holds the column's projection of every row, so it can read the column's conv
window from the state pool (issued before the weight stream), convolve, apply SiLU and write the shifted
window back, with no other program touching that state (state_out may equal state_in). That saves the
conv's launch and its dependent wait in every GDN layer of a decode step.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl, schedule

__all__ = [
    "MAX_ROWS",
    "ConvStep",
    "SkinnyConfig",
    "default_config",
    "prefers_skinny",
    "skinny_linear",
    "skinny_linear_partials",
]

MAX_ROWS = 16  # rows the dot kernel's single padded MMA tile covers
_DOT_ROWS = 16
_H200_SMS = 132  # the default of `default_config` (CPU tests); launches pass the device's own count
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Tile choice of one skinny_linear launch.

    block_n: output columns (weight rows) per program; block_k: K elements per step; split_k: programs per
    column block along K (1 = none; capped so that no split is empty); num_warps / num_stages: Triton's
    launch options (num_stages > 1 pipelines the dot kernel's loads through shared memory; Triton leaves
    the elementwise kernel's loads alone, so there ``unroll`` is what puts several steps' loads in flight);
    use_dot: the MMA kernel instead of the elementwise one; unroll: K steps per loop trip in the
    elementwise kernel (ignored by the dot one).
    """

    block_n: int = 8
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    use_dot: bool = False
    unroll: int = 1

    def check(self) -> None:
        for name in ("block_n", "block_k", "unroll"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.use_dot and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"the dot kernel needs block_n, block_k >= 16, got {self}")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"split_k, num_warps and num_stages must be >= 1, got {self}")


# Measured best configs, keyed by (M bucket, N, K) with bucket 1 for M = 1 and 8 for M = 2..8 (M > 8 is
# not tuned: an elementwise config tuned at 8 rows would double its accumulator), from the H200 sweep
# (`python3 -m tools.kernel_bench.skinny_gemm --sweep [--variant 35b-a3b]`). The one-row elementwise entries
# were then re-timed as the decode graph runs them, 16 projections back to back under PDL
# (`tools.kernel_bench.skinny_chain`): 2 rows x 1024 per step won at every shape but (2048, 512). Shapes not
# listed use the heuristic in `default_config`.
# Bucket 8 lists only the shapes where the kernel beat cuBLAS by >= 3 % (`prefers_skinny`); the others
# stay cuBLAS. Loading every program's first weight tile before the PDL wait (into registers or as an L2
# prefetch) measured slower for the multi-wave 27B launches; only the launches below do it.
# A one-row launch of static weights (`static_weight=True`: bound weights, never written) whose programs hold
# at most this many warps per SM (half of Hopper's 64: the one-row tiles' 4-warp programs, 8 to an SM, one
# wave) loads each program's first weight tiles before its PDL wait: in one wave no program holding a tile
# keeps a later program off the SM (35B-A3B's attn_o / gdn_out and stacked MoE input). Up to
# _EARLY_STEPS_MAX tiles: the whole row slice of those projections (16 KB per program, 32 registers a
# thread), which streams while the small kernels before them run when the fast table lets them launch
# early (`pdl`, one row).
# A multi-wave one-row launch whose programs' whole K range is at most _EARLY_STEPS_MAX tiles loads it all
# before the wait too (35B-A3B gdn_in and attn_qkv, K = 2048 in two tiles, held at once where the loop held
# one: the first wave's rows stream while the norm before them runs; later waves start after the wait
# anyway). 27B (K = 5120, five tiles) with its first four early timed within noise for 16 more registers a
# thread, so not taken. Every figure behind these choices: docs/benchmarks.md, "Why the kernels are as they
# are", GEMV.
_EARLY_TILE_WARPS_PER_SM = 32
_EARLY_STEPS_MAX = 4
_FMA = {"split_k": 1, "num_stages": 1, "use_dot": False}
_DOT = {"num_warps": 4, "use_dot": True}
_ONE_ROW = SkinnyConfig(block_n=2, block_k=1024, num_warps=4, unroll=1, **_FMA)  # the chain's one-row pick
_TUNED: dict[tuple[int, int, int], SkinnyConfig] = {
    (1, 14336, 5120): _ONE_ROW,
    (1, 5120, 6144): _ONE_ROW,
    (1, 16480, 5120): _ONE_ROW,
    (1, 34816, 5120): _ONE_ROW,
    (1, 5120, 17408): _ONE_ROW,
    (1, 248320, 5120): SkinnyConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, use_dot=True),
    (8, 16480, 5120): SkinnyConfig(block_n=32, block_k=256, num_warps=4, num_stages=3, use_dot=True),
    (8, 5120, 17408): SkinnyConfig(block_n=32, block_k=256, split_k=2, num_stages=3, **_DOT),
    (8, 248320, 5120): SkinnyConfig(block_n=128, block_k=128, num_warps=8, num_stages=4, use_dot=True),
    # 35B-A3B (hidden 2048): every one-row shape faster than cuBLAS; eight rows attn_o/gdn_out (same
    # shape), router + shared-expert input, shared down and lm_head
    (1, 9216, 2048): _ONE_ROW,
    (1, 2048, 4096): _ONE_ROW,
    (1, 12352, 2048): _ONE_ROW,
    (1, 1280, 2048): _ONE_ROW,
    (1, 2048, 512): SkinnyConfig(block_n=8, block_k=512, num_warps=4, unroll=1, **_FMA),
    (1, 248320, 2048): SkinnyConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, use_dot=True),
    (8, 2048, 4096): SkinnyConfig(block_n=64, block_k=256, split_k=4, num_stages=3, **_DOT),
    (8, 1280, 2048): SkinnyConfig(block_n=64, block_k=128, split_k=4, num_stages=4, **_DOT),
    (8, 2048, 512): SkinnyConfig(block_n=64, block_k=128, num_stages=6, **_DOT),
    (8, 248320, 2048): SkinnyConfig(block_n=64, block_k=128, num_stages=4, **_DOT),
    # 35B-A3B eight-row attn_qkv and gdn_in, timed in a chain of 16 (`skinny_chain --rows 8`; gdn_in runs
    # the kernel anyway, for its conv epilogue), then re-timed inside the whole decode graph at B = 8 with
    # the attn_o / gdn_out split-4 tile above; the router + shared input kept its tile
    (8, 9216, 2048): SkinnyConfig(block_n=64, block_k=128, num_stages=4, **_DOT),
    (8, 12352, 2048): SkinnyConfig(block_n=32, block_k=256, num_stages=3, **_DOT),
}


def prefers_skinny(m: int, n: int, k: int) -> bool:
    """Whether this kernel should replace cuBLAS for an [m, k] x [n, k]^T projection: always for one row
    (faster at every measured shape), for 2..8 rows only where it measured faster (the `_TUNED` bucket 8)."""
    return m == 1 or (2 <= m <= 8 and (8, n, k) in _TUNED)


@dataclasses.dataclass(frozen=True, eq=False)
class ConvStep:
    """The GDN conv decode step over output columns [0, C) of a skinny_linear (C = pool.shape[1]).

    For row m and column c < C: window = [pool[state_in[m], c, :] (zeros when fresh[m] or
    state_in[m] < 0), y[m, c]] in y's dtype, out[m, c] = silu(window . weight[c]) (fp32 math, rounded to
    y's dtype) and pool[state_out[m], c, :] = window[1:] (not written when state_out[m] < 0): what
    `conv_update.causal_conv1d_update_slots` does to the projection's first C columns. pool [S, C, K-1]
    contiguous, weight [C, K], state_in / state_out [M] integer slots, fresh [M] bool, all on x's device.
    As there, slots written by one row must not be read or written by another row (state_out may equal
    the row's own state_in). settled: pool and weight are complete before the GEMV can launch (the
    pool written by an earlier step, a bound weight; `pdl`), so the old windows and the conv weights load
    before the PDL wait (measured faster at eight rows: docs/benchmarks.md, "Why the kernels are as they
    are", GDN).
    """

    pool: torch.Tensor
    weight: torch.Tensor
    state_in: torch.Tensor
    state_out: torch.Tensor
    fresh: torch.Tensor
    settled: bool = False


@triton.jit
def _conv_window_loads(
    conv_pool_ptr, conv_w_ptr, state_in_ptr, fresh_ptr, offs_m, mask_m, offs_n,
    conv_channels, conv_w_stride_c, conv_w_stride_k, CONV_K: tl.constexpr, CONV_BLOCK: tl.constexpr,
):  # fmt: skip
    """The conv step's loads, issued before the weight stream: the old window taps [BM, BN, CONV_BLOCK]
    (tap K-1 and beyond zero) and the conv weights [BN, CONV_BLOCK] in fp32."""
    taps = tl.arange(0, CONV_BLOCK)
    width = CONV_K - 1
    conv_n = offs_n < conv_channels
    slot_in = tl.load(state_in_ptr + offs_m, mask=mask_m, other=-1).to(tl.int64)
    reads = mask_m & (slot_in >= 0) & (tl.load(fresh_ptr + offs_m, mask=mask_m, other=1) == 0)
    state = tl.load(
        conv_pool_ptr
        + slot_in[:, None, None] * conv_channels * width
        + offs_n.to(tl.int64)[None, :, None] * width
        + taps[None, None, :],
        mask=reads[:, None, None] & conv_n[None, :, None] & (taps < width)[None, None, :],
        other=0.0,
    )
    weight = tl.load(
        conv_w_ptr + offs_n[:, None] * conv_w_stride_c + taps[None, :] * conv_w_stride_k,
        mask=conv_n[:, None] & (taps < CONV_K)[None, :],
        other=0.0,
    )
    return state, weight.to(tl.float32)


@triton.jit
def _conv_epilogue(
    y, state, weight, conv_pool_ptr, state_out_ptr, offs_m, mask_m, offs_n, mask_n, conv_channels,
    CONV_K: tl.constexpr, CONV_BLOCK: tl.constexpr,
):  # fmt: skip
    """y [BM, BN] in the output dtype -> the conv step's output in the first C columns (the rest as they
    are), and the shifted windows stored to their state_out slots."""
    taps = tl.arange(0, CONV_BLOCK)
    width = CONV_K - 1
    window = tl.where(taps[None, None, :] == width, y[:, :, None], state.to(y.dtype))
    acc = tl.sum(window.to(tl.float32) * weight[None, :, :], axis=2)
    conv = (acc * tl.sigmoid(acc)).to(y.dtype)
    conv_n = offs_n < conv_channels
    slot_out = tl.load(state_out_ptr + offs_m, mask=mask_m, other=-1).to(tl.int64)
    writes = mask_m & (slot_out >= 0)
    # tap j of the window becomes state position j - 1 (tap 0 falls off)
    tl.store(
        conv_pool_ptr
        + slot_out[:, None, None] * conv_channels * width
        + offs_n.to(tl.int64)[None, :, None] * width
        + taps[None, None, :]
        - 1,
        window.to(conv_pool_ptr.dtype.element_ty),
        mask=writes[:, None, None] & (conv_n & mask_n)[None, :, None] & (taps >= 1)[None, None, :]
        & (taps < CONV_K)[None, None, :],
    )  # fmt: skip
    return tl.where(conv_n[None, :], conv, y)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _H200_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_for(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """Split K until there are ~2 waves of programs, keeping >= 4 steps per split (at most 8 splits)."""
    blocks = triton.cdiv(n, block_n)
    if blocks >= 2 * num_sms:
        return 1
    return max(1, min(triton.cdiv(2 * num_sms, blocks), k // (4 * block_k), 8))


@functools.cache  # called per launch: keep the Python overhead off the decode path
def default_config(m: int, n: int, k: int, num_sms: int = _H200_SMS) -> SkinnyConfig:
    """The tuned config for this shape if there is one, else: fma kernel at M = 1, dot kernel above."""
    if m <= 8:
        tuned = _TUNED.get((1 if m == 1 else 8, n, k))
        if tuned is not None:
            return tuned
    k_pow2 = triton.next_power_of_2(max(k, 16))
    if m == 1:
        base = SkinnyConfig(block_n=8, block_k=min(512, k_pow2), num_warps=4, num_stages=1, unroll=2)
    else:
        base = SkinnyConfig(block_n=64, block_k=min(128, k_pow2), num_warps=4, num_stages=4, use_dot=True)
    return dataclasses.replace(base, split_k=_split_for(n, k, base.block_n, base.block_k, num_sms))


@triton.jit
def _skinny_fma_kernel(
    x_ptr, w_ptr, out_ptr,
    M, N, K, k_per_split, stride_xm, stride_wn, stride_om, stride_os,
    conv_pool_ptr, conv_w_ptr, state_in_ptr, state_out_ptr, fresh_ptr,
    conv_channels, conv_w_stride_c, conv_w_stride_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    HAS_CONV: tl.constexpr, CONV_K: tl.constexpr, CONV_BLOCK: tl.constexpr, CONV_SETTLED: tl.constexpr,
    EARLY_STEPS: tl.constexpr, ROUND_OUT: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    if HAS_CONV and CONV_SETTLED:
        conv_state, conv_weight = _conv_window_loads(
            conv_pool_ptr, conv_w_ptr, state_in_ptr, fresh_ptr, offs_m, mask_m, offs_n,
            conv_channels, conv_w_stride_c, conv_w_stride_k, CONV_K, CONV_BLOCK,
        )  # fmt: skip
    early_tiles = ()  # static weights, one row (the host's rule): the first tiles load before the PDL wait
    for step in tl.static_range(EARLY_STEPS):
        step_mask = (k_begin + step * BLOCK_K + offs_k) < k_end
        early_tiles = early_tiles + (tl.load(
            w_rows + (k_begin + step * BLOCK_K + offs_k)[None, :], mask=mask_n[:, None] & step_mask[None, :],
            other=0.0, eviction_policy="evict_first",
        ),)  # fmt: skip
    pdl.enter(USE_PDL)
    if HAS_CONV and not CONV_SETTLED:
        conv_state, conv_weight = _conv_window_loads(
            conv_pool_ptr, conv_w_ptr, state_in_ptr, fresh_ptr, offs_m, mask_m, offs_n,
            conv_channels, conv_w_stride_c, conv_w_stride_k, CONV_K, CONV_BLOCK,
        )  # fmt: skip
    out_base = out_ptr + pid_k * stride_os  # this split's fp32 partial slab (stride_os = 0 without split)
    if BLOCK_M == 1:
        # one row: a 2-D accumulator, x broadcast along the weight rows
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for step in tl.static_range(EARLY_STEPS):  # the first steps, peeled: the same additions in order
            step_mask = (k_begin + step * BLOCK_K + offs_k) < k_end
            xs = tl.load(x_ptr + k_begin + step * BLOCK_K + offs_k, mask=step_mask, other=0.0)
            acc += early_tiles[step].to(tl.float32) * xs.to(tl.float32)[None, :]
        k_start = k_begin + EARLY_STEPS * BLOCK_K
        for k0 in range(k_start, k_end, BLOCK_K * UNROLL):
            for step in tl.static_range(UNROLL):
                ks = k0 + step * BLOCK_K + offs_k
                mask_k = ks < k_end
                w = tl.load(
                    w_rows + ks[None, :],
                    mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0,
                    eviction_policy="evict_first",  # streamed once: leave L2 to x and the activations
                )
                xs = tl.load(x_ptr + ks, mask=mask_k, other=0.0)
                acc += w.to(tl.float32) * xs.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if ROUND_OUT:  # a wider output holds the x-dtype result (`skinny_linear`'s out)
            y = y.to(x_ptr.dtype.element_ty)
        y = y.to(out_ptr.dtype.element_ty)
        if HAS_CONV:
            y = tl.sum(
                _conv_epilogue(
                    y[None, :], conv_state, conv_weight, conv_pool_ptr, state_out_ptr, offs_m, mask_m, offs_n,
                    mask_n, conv_channels, CONV_K, CONV_BLOCK,
                ),
                axis=0,
            )  # fmt: skip
        tl.store(out_base + offs_n, y, mask=mask_n)
    else:
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K * UNROLL):
            for step in tl.static_range(UNROLL):
                ks = k0 + step * BLOCK_K + offs_k
                mask_k = ks < k_end
                w = tl.load(
                    w_rows + ks[None, :],
                    mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0,
                    eviction_policy="evict_first",  # streamed once: leave L2 to x and the activations
                )
                xs = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                acc3 += w.to(tl.float32)[None, :, :] * xs.to(tl.float32)[:, None, :]
        y2 = tl.sum(acc3, axis=2)
        if ROUND_OUT:
            y2 = y2.to(x_ptr.dtype.element_ty)
        y2 = y2.to(out_ptr.dtype.element_ty)
        if HAS_CONV:
            y2 = _conv_epilogue(
                y2, conv_state, conv_weight, conv_pool_ptr, state_out_ptr, offs_m, mask_m, offs_n, mask_n,
                conv_channels, CONV_K, CONV_BLOCK,
            )  # fmt: skip
        out_ptrs = out_base + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, y2, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _skinny_dot_kernel(
    x_ptr, w_ptr, out_ptr,
    M, N, K, k_per_split, stride_xm, stride_wn, stride_om, stride_os,
    conv_pool_ptr, conv_w_ptr, state_in_ptr, state_out_ptr, fresh_ptr,
    conv_channels, conv_w_stride_c, conv_w_stride_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_CONV: tl.constexpr, CONV_K: tl.constexpr, CONV_BLOCK: tl.constexpr, CONV_SETTLED: tl.constexpr,
    ROUND_OUT: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    if not (HAS_CONV and CONV_SETTLED):
        pdl.enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M  # padding rows load nothing (masked) and are not stored
    if HAS_CONV:
        conv_state, conv_weight = _conv_window_loads(
            conv_pool_ptr, conv_w_ptr, state_in_ptr, fresh_ptr, offs_m, mask_m, offs_n,
            conv_channels, conv_w_stride_c, conv_w_stride_k, CONV_K, CONV_BLOCK,
        )  # fmt: skip
        if CONV_SETTLED:
            pdl.enter(USE_PDL)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    # out^T tile: the weight rows are the MMA's M side, the (padded) x rows its N side
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < k_end
        w = tl.load(
            w_rows + ks[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
            eviction_policy="evict_first",  # streamed once: leave L2 to x and the activations
        )
        xs = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(xs), acc, input_precision=DOT_PRECISION)
    y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if ROUND_OUT:  # a wider output holds the x-dtype result (`skinny_linear`'s out)
        y = y.to(x_ptr.dtype.element_ty)
    y = y.to(out_ptr.dtype.element_ty)
    if HAS_CONV:
        y = _conv_epilogue(
            y, conv_state, conv_weight, conv_pool_ptr, state_out_ptr, offs_m, mask_m, offs_n, mask_n,
            conv_channels, CONV_K, CONV_BLOCK,
        )  # fmt: skip
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _split_k_reduce_kernel(
    partial_ptr,
    out_ptr,
    x_ptr,
    N,
    stride_om,
    stride_os,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_OUT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    total = tl.load(partial_ptr + row * N + offs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLIT_K):  # fixed order from slab 0: the same sum on every run
        total += tl.load(partial_ptr + split * stride_os + row * N + offs, mask=mask, other=0.0)
    if ROUND_OUT:
        total = total.to(x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_om + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def _conv_launch_args(conv: ConvStep | None, x: torch.Tensor, m: int, n: int) -> tuple[tuple, int, bool]:
    """The kernels' conv arguments (pool, weight, state_in, state_out, fresh, C, weight strides), K and
    whether pool and weight are settled; placeholders the kernel never reads without a conv step."""
    if conv is None:
        return (x, x, x, x, x, 0, 0, 0), 1, False
    pool, weight = conv.pool, conv.weight
    channels = pool.shape[1] if pool.dim() == 3 else -1
    kernel = weight.shape[1] if weight.dim() == 2 else -1
    if pool.dim() != 3 or not pool.is_contiguous() or not 0 < channels <= n or pool.shape[2] != kernel - 1:
        raise ValueError(
            f"conv.pool must be contiguous [S, C, K-1] with C <= {n} output columns and K from conv.weight "
            f"{tuple(weight.shape)}, got {tuple(pool.shape)}"
        )
    if weight.shape[0] != channels or kernel < 2:
        raise ValueError(f"conv.weight must be [{channels}, K >= 2], got {tuple(weight.shape)}")
    for name in ("pool", "weight", "state_in", "state_out", "fresh"):
        if getattr(conv, name).device != x.device:
            raise ValueError(f"conv.{name} is on {getattr(conv, name).device}, x on {x.device}")
    if conv.state_in.is_floating_point() or conv.state_out.is_floating_point():
        raise ValueError("conv.state_in and conv.state_out must be integer slot indices")
    for name in ("state_in", "state_out", "fresh"):
        shape = tuple(getattr(conv, name).shape)
        if shape != (m,):
            raise ValueError(f"conv.{name} must be [{m}] (one per row), got {shape}")
    fresh = conv.fresh.view(torch.uint8) if conv.fresh.dtype == torch.bool else conv.fresh
    args = (pool, weight, conv.state_in, conv.state_out, fresh, channels, weight.stride(0), weight.stride(1))
    return args, kernel, conv.settled


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    conv: ConvStep | None = None,
    static_weight: bool = False,
) -> torch.Tensor:
    """``F.linear(x, w)`` for x [M, K] with M <= 16 rows -> [M, N] in x's dtype, fp32 accumulation.

    x and w share a dtype (bf16, fp16 or fp32); w [N, K] must have a unit stride along K (a row block of a
    stacked buffer is fine); x may have any row stride (a column slice is fine). ``out`` may supply the
    [M, N] result buffer (unit stride along N): x's dtype, or float32 to hold the x-dtype result widened
    (`F.linear(x, w).float()` in one launch: the logits). ``config`` overrides `default_config(M, N, K)`.
    ``conv`` applies that GDN conv step to the first C columns (see `ConvStep`); it needs the whole K in one
    program, so a split-K config is run unsplit. ``static_weight``: w is never written (a bound weight, not
    the output of an earlier kernel), so a one-row launch may read it before its PDL wait (see
    `_EARLY_STEPS_MAX`).
    """
    x, out, config, conv_launch = _prepare(x, w, out, config, conv)
    if out.numel() == 0 or x.shape[1] == 0:
        return out
    partials = _project(x, w, out, config, conv_launch, static_weight)
    if partials is not out:
        _reduce_partials(partials, out, x)
    return out


def skinny_linear_partials(
    x: torch.Tensor, w: torch.Tensor, *, config: SkinnyConfig | None = None, static_weight: bool = False
) -> torch.Tensor:
    """`skinny_linear(x, w)` without its split-K reduce launch, for a consumer that sums the slabs itself
    -> [S, M, N]: with S > 1 fp32 partial products over S contiguous K ranges, whose sum in slab order
    (slab 0 first, in fp32) rounded to x's dtype is exactly `skinny_linear(x, w)`; with S == 1 (an unsplit
    config) that result itself, in x's dtype. Saves a dependent launch where the consumer reads the whole
    output row anyway (`norm.add_rms_norm_partials`)."""
    x, out, config, conv_launch = _prepare(x, w, None, config, None)
    if out.numel() == 0 or x.shape[1] == 0:
        return out.unsqueeze(0)
    return _project(x, w, out, config, conv_launch, static_weight).view(-1, *out.shape)


def _prepare(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None,
    config: SkinnyConfig | None,
    conv: ConvStep | None,
) -> tuple[torch.Tensor, torch.Tensor, SkinnyConfig, tuple[tuple, int, bool]]:
    """The checked arguments (x made unit-stride along K), the output buffer, the launch's config and the
    kernels' conv arguments (`_conv_launch_args`)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"need x [M, K] and w [N, K], got x {tuple(x.shape)} w {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got M={m}")
    if x.dtype != w.dtype or x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"x and w must share a dtype in {_SUPPORTED_DTYPES}, got {x.dtype} and {w.dtype}")
    if w.stride(1) != 1:
        raise ValueError("w must have a unit stride along K (row-major)")
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype not in (x.dtype, torch.float32) or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be [{m}, {n}] {x.dtype} or float32 with a unit stride along N")
    if conv is not None and out.dtype != x.dtype:
        raise ValueError(f"the conv step writes its output in x's dtype {x.dtype}, got out {out.dtype}")
    conv_launch = _conv_launch_args(conv, x, m, n)  # its checks too, before anything is launched
    if k == 0 and conv is not None and m and n:
        raise ValueError("the conv step needs K >= 1 (a projection to convolve)")
    if m == 0 or n == 0 or k == 0:  # nothing to launch (the shape heuristic would divide by N)
        return x, out.zero_(), config or SkinnyConfig(), conv_launch
    config = config or default_config(m, n, k, _sm_count(x.device))
    config.check()
    if conv is not None and config.split_k > 1:
        config = dataclasses.replace(config, split_k=1)
    return x, out, config, conv_launch


def _project(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    config: SkinnyConfig,
    conv_launch: tuple[tuple, int, bool],
    static_weight: bool,
) -> torch.Tensor:
    """Launch the GEMV (M, N, K >= 1) -> out, or its fp32 partial slabs [S, M, N] when the config splits."""
    m, k = x.shape
    n = w.shape[0]
    conv_args, conv_kernel, conv_settled = conv_launch
    # K ranges are whole steps; splits that would start past K are dropped (the count stays static)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split_k = triton.cdiv(k, k_per_split)
    if split_k > 1:
        target = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        stride_om, stride_os = n, m * n
    else:
        target, stride_om, stride_os = out, out.stride(0), 0
    grid = (triton.cdiv(n, config.block_n), split_k)
    round_out = split_k == 1 and out.dtype != x.dtype  # a float32 out of a narrower x: x's rounding first
    args = (x, w, target, m, n, k, k_per_split, x.stride(0), w.stride(0), stride_om, stride_os, *conv_args)
    conv_options = {"HAS_CONV": conv_kernel > 1, "CONV_K": conv_kernel,  # conv width 1: no conv step
                    "CONV_BLOCK": triton.next_power_of_2(conv_kernel),
                    "CONV_SETTLED": conv_settled}  # fmt: skip
    early_steps = 0
    if not config.use_dot:
        # one-row programs of a static weight load their first tiles before their PDL wait: in one wave,
        # or where a program's whole K range is that many tiles
        steps = triton.cdiv(k_per_split, config.block_k)
        one_wave = grid[0] * grid[1] * config.num_warps <= _EARLY_TILE_WARPS_PER_SM * _sm_count(x.device)
        early = static_weight and m == 1 and conv_kernel == 1 and (one_wave or steps <= _EARLY_STEPS_MAX)
        early_steps = min(_EARLY_STEPS_MAX, steps) if early else 0
    if schedule.recording:
        _record(config.use_dot, w, target, conv_args if conv_kernel > 1 else None, conv_settled, early_steps)
    if config.use_dot:
        _skinny_dot_kernel[grid](
            *args, BLOCK_M=_DOT_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **conv_options, ROUND_OUT=round_out,
            num_warps=config.num_warps, num_stages=config.num_stages,
            USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
        )  # fmt: skip
    else:
        _skinny_fma_kernel[grid](
            *args, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            UNROLL=config.unroll, **conv_options, EARLY_STEPS=early_steps, ROUND_OUT=round_out,
            num_warps=config.num_warps, num_stages=config.num_stages,
            USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
        )  # fmt: skip
    return target


def _record(
    use_dot: bool, w: torch.Tensor, target: torch.Tensor, conv_args: tuple | None, conv_settled: bool,
    early_steps: int,
) -> None:  # fmt: skip
    """The GEMV launch for `schedule`: before its wait it reads its first weight tiles (early_steps) and,
    with a settled conv step, the windows' slots, fresh flags, old taps and the conv weights."""
    early: dict[str, torch.Tensor] = {"w": w} if early_steps else {}
    writes = {"out": target}
    if conv_args is not None:
        pool, conv_weight, state_in, _, fresh = conv_args[:5]
        if conv_settled:
            early |= {"conv_pool": pool, "conv_weight": conv_weight, "state_in": state_in, "fresh": fresh}
        writes["conv_pool"] = pool
    kernel = "_skinny_dot_kernel" if use_dot else "_skinny_fma_kernel"
    schedule.record(f"skinny_gemm.{kernel}", early_reads=early, writes=writes)


def _reduce_partials(partials: torch.Tensor, out: torch.Tensor, x: torch.Tensor) -> None:
    """out [M, N] <- the slab-order fp32 sum of partials [S, M, N], rounded to x's dtype (then out's)."""
    split_k, m, n = partials.shape
    block = min(1024, triton.next_power_of_2(n))
    if schedule.recording:
        schedule.record("skinny_gemm._split_k_reduce_kernel", writes={"out": out})
    _split_k_reduce_kernel[(m, triton.cdiv(n, block))](
        partials, out, x, n, out.stride(0), m * n, SPLIT_K=split_k, BLOCK=block,
        ROUND_OUT=out.dtype != x.dtype, num_warps=4, USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
