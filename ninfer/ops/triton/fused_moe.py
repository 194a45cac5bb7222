"""Triton fused MoE: the routed experts of Qwen3.6-35B-A3B as two grouped GEMMs (fast path of
`ninfer.ops.moe.moe_experts`, same maths).

    out[t] = sum_k weights[t, k] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),  e = expert_ids[t, k]

with gate_up [E, 2I, H] (rows [0:I] gate, [I:2I] up) and down [E, H, I]. The router stays outside
(`moe_routing` after the router GEMM gives the fp32 weights, int32 ids and the shared-expert weight).
With `shared=SharedExpert(gate_up [2I_s, H], down [H, I_s], weight [T])` the always-on shared expert
joins the same fp32 sum, out[t] += weight[t] * shared(x[t]), rounded once at the end as
`REFERENCE.moe_block` does. The model's decode MoE block is `moe_decode`, which reuses this module's
gate/up rows (`gate_up_rows`) and down + combine (`decode_down_combine`) with the routing moved into the
gate/up launch.
Two paths, both fully on the device (no host sync, every shape and grid from the static T and K, so either
can be captured in the decode CUDA graph):

Decode path (T*K <= DECODE_MAX_PAIRS, two launches, no sort). With a few (token, expert) pairs the call is
bound by reading the selected experts' weights (3*H*I*2 bytes each, ~50 MB at T=1) and by launch count, so
it skips the expert sort and runs one GEMV per pair on the CUDA cores (no `tl.dot`: one row of x per
expert gives nothing for the tensor cores to reuse):

1. gate_up: program (pair p, BLOCK_N intermediate columns) streams the gate and up rows of expert
   expert_ids[p // K, p % K] over H in BLOCK_K chunks (16-byte loads along H), multiplies by x[p // K]
   elementwise into fp32 [BLOCK_N, BLOCK_K] accumulators that are reduced once at the end, and writes
   silu(gate) * up to the intermediate [T*K, I] (pair order).
2. down + combine: program (token t, BLOCK_H hidden rows) reads the [BLOCK_H, I] down rows of its K experts,
   DOWN_EXPERTS experts per step as one [DOWN_EXPERTS, BLOCK_H, BLOCK_I] tile (a large independent load, so
   many bytes are in flight per program), reduces over I, rounds each expert output to the model dtype and
   adds weight * output in fp32, in a fixed order (deterministic, no atomics, no separate sum kernel).

The shared expert rides in the same two launches as slot K of every token (needs I_s == I): the gate_up
grid covers T*(K+1) pairs and a scalar branch points slot K's program at the shared rows instead of an
expert's; the down program loads the shared down rows first (independent loads, in flight with the
experts') and adds weight[t] * (its rounded output) after the routed sum.

A pair whose expert is shared with another token re-reads that expert's rows; the pairs of one n block run
side by side (pair is the fastest launch index), so the repeat mostly hits L2. That waste grows with the
pairs per distinct expert, hence the DECODE_MAX_PAIRS bound: up to B=8 decode rows at K=8 (64 pairs, ~57
distinct experts under uniform routing) the path reads little more than the sorted one and saves two of
its four launches.

Sorted path (larger T*K: prefill, where each expert's weights are reused across many rows):

1. Align: a stable counting sort of the P = T*K (token, k) pairs by expert. `sorted_pairs` holds the pair
   indices grouped by expert (ascending pair index within an expert), and a block table cuts every expert's
   run of rows into tiles of BLOCK_M rows: block b is (expert, first sorted row, end of that expert's rows).
   At most cdiv(P, BLOCK_M) + min(E, P) blocks exist; the real count is written on the device, and GEMM
   programs for blocks beyond it exit at once. Small P takes one single-program kernel; large P takes three
   (per-chunk histograms, prefix over chunks + layout, per-chunk scatter). No atomics: the order is
   deterministic.
2. gate_up GEMM: one program per (block, BLOCK_N intermediate columns) gathers the block's token rows of x
   and multiplies them by the expert's gate and up tiles (two accumulators), then applies SiLU(gate) * up in
   its epilogue and writes the intermediate [P, I] (model dtype, sorted order so the next GEMM reads
   contiguous rows).
3. down GEMM: one program per (block, BLOCK_N hidden columns) writes each pair's expert output [P, H]
   (model dtype, pair order t*K + k); a last small kernel forms sum_k weights[t, k] * y[t*K + k] in fp32 in
   a fixed k order (deterministic, no float atomics) and casts to x's dtype. A shared expert is computed
   with torch ops (two GEMMs and the SwiGLU, each rounded as the reference rounds) and only its weighted
   add joins this sum: prefill is GEMM-bound, so the fused form would save little there.

Roundings follow the reference on both paths: gate and up projections, the SiLU product and each expert
output are rounded to the model dtype; the routing weight multiplies the rounded expert output in fp32.

Tiles: `default_decode_config(T*K)` for the decode path, `default_config(T*K)` for the sorted path (decode
sized tiers stay in its table for when the sorted path is asked for explicitly). Pass `config=` to choose:
a `FusedMoeDecodeConfig` runs the decode path, a `FusedMoeConfig` the sorted path, at any T (the timing
script does, for tuning).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.ops.mlp import swiglu
from ninfer.ops.triton import pdl, schedule

__all__ = [
    "DECODE_MAX_PAIRS",
    "check_powers_of_two",
    "decode_down_combine",
    "gate_up_rows",
    "ExpertBlocks",
    "FusedMoeConfig",
    "FusedMoeDecodeConfig",
    "SharedExpert",
    "align_pairs_by_expert",
    "default_config",
    "default_decode_config",
    "fused_moe",
]

_ALIGN_SUB = 32  # pairs per step of the align loops: a [32, next_pow2(E)] compare tile
_MAX_ALIGN_CHUNKS = 64  # the prefix over chunks is one [chunks, next_pow2(E)] tile in one program
_SUM_BLOCK_H = 1024

# Largest T*K that `fused_moe` sends to the decode path by default: decode batches B <= 8 at K = 8.
DECODE_MAX_PAIRS = 64


@dataclass(frozen=True)
class FusedMoeConfig:
    """Tile sizes of one fused_moe call. `block_m` is shared by both GEMMs (they use one block layout)."""

    block_m: int
    gate_up_block_n: int  # intermediate columns per program (one gate and one up tile of this width)
    gate_up_block_k: int
    gate_up_warps: int
    gate_up_stages: int
    down_block_n: int  # hidden columns per program
    down_block_k: int
    down_warps: int
    down_stages: int
    group_m: int = 8  # blocks per program group in the launch order (weight tiles reused through L2)
    align_chunk: int = 256  # pairs per align program (power of two); one program when P <= align_chunk


# (largest T*K, config). Decode at K=8: T=1-2 -> 8-16 pairs, T=8 -> 64. At H=2048, I=512 the first tier
# gives 8 experts x 32 gate_up programs (128 KiB of weights each) and 8 x 64 down programs (32 KiB each).
# Prefill tiers use 64/128-row tiles so the experts' weights are reused across rows (T=8192: ~256 rows per
# expert). Starting points for tuning on the H200 with tools/kernel_bench/fused_moe.py.
_CONFIGS: tuple[tuple[int, FusedMoeConfig], ...] = (
    (16, FusedMoeConfig(16, 16, 128, 4, 4, 32, 128, 4, 4, group_m=1)),
    (64, FusedMoeConfig(16, 32, 128, 4, 4, 64, 128, 4, 4, group_m=1)),
    (1024, FusedMoeConfig(16, 64, 128, 4, 4, 64, 128, 4, 4, group_m=4)),
    (8192, FusedMoeConfig(64, 64, 64, 4, 4, 64, 64, 4, 4, group_m=8)),
    (1 << 62, FusedMoeConfig(128, 64, 64, 8, 3, 128, 64, 8, 3, group_m=8, align_chunk=1024)),
)


def default_config(num_pairs: int) -> FusedMoeConfig:
    """The table's config for P = T*K (token, expert) pairs."""
    for max_pairs, config in _CONFIGS:
        if num_pairs <= max_pairs:
            return config
    return _CONFIGS[-1][1]


@dataclass(frozen=True)
class FusedMoeDecodeConfig:
    """Tile sizes of the decode path (all powers of two).

    gate_up: a program owns `gate_up_block_n` intermediate columns of one pair (a gate and an up tile of
    [block_n, block_k] per step over H). down: a program owns `down_block_h` hidden rows of one token and
    loads `down_experts` of its K experts per step as one [down_experts, block_h, block_i] tile.
    """

    gate_up_block_n: int = 8
    gate_up_block_k: int = 512
    gate_up_warps: int = 4
    down_block_h: int = 4
    down_block_i: int = 512
    down_experts: int = 4
    down_warps: int = 4

    def __post_init__(self) -> None:
        check_powers_of_two(self)


def check_powers_of_two(config: object) -> None:
    """ValueError naming the first size field (not bool) of the dataclass ``config`` that is not a power
    of two."""
    for name, value in dataclasses.asdict(config).items():  # type: ignore[call-overload]
        if isinstance(value, bool):  # a switch, not a size
            continue
        if value < 1 or value & (value - 1):
            raise ValueError(f"{type(config).__name__}.{name} must be a power of two, got {value}")


# (largest T*K, config). The class defaults, at H=2048, I=512 and T=1 (8 pairs): gate_up runs 8 x 64 programs,
# each streaming 2 x [8, 512] bf16 (16 KiB) per step over 4 steps; down runs 512 programs, each loading 2 x 16
# KiB tiles (4 experts x [4, 512]); the table below overrides them at every T. Every thread issues 16-byte
# loads (8 bf16 along H or I); if ~4 programs fit on an SM (<= 128 registers per thread), all of them run in
# one wave with ~64 KiB per SM in flight. The H200 sweep of both launches preferred one whole-H step per
# gate_up program and one hidden row per down program over all 8 experts at T = 1 and 2 (keyed by T*K <= 16,
# i.e. T <= 2 at Qwen3.6's K = 8); from T = 4 the default led or tied. Re-timed inside the whole 35B-A3B
# decode graph, T = 8 takes the down launch's 4 hidden rows x 4 experts over 256 of I per step instead of
# 512 (two steps, half the registers), and T = 1 (the early down launch, `moe_decode`) 4 hidden rows a
# program over 4 warps instead of 1 over 2 (a quarter of the programs, each with all 8 experts' rows before
# its wait); the alternatives timed are in docs/benchmarks.md, "Why the kernels are as they are", MoE. The
# T = 1 entry also sets the two-launch `fused_moe` decode path's tiles there (not timed), and block_i 256
# applies from T = 3 (timed at T = 8).
_DECODE_CONFIGS: tuple[tuple[int, FusedMoeDecodeConfig], ...] = (
    (
        8,
        FusedMoeDecodeConfig(
            gate_up_block_n=2, gate_up_block_k=2048, gate_up_warps=4,
            down_block_h=4, down_block_i=512, down_experts=8, down_warps=4,
        ),
    ),  # fmt: skip
    (
        16,
        FusedMoeDecodeConfig(
            gate_up_block_n=2, gate_up_block_k=2048, gate_up_warps=4,
            down_block_h=1, down_block_i=512, down_experts=8, down_warps=2,
        ),
    ),  # fmt: skip
    (1 << 62, FusedMoeDecodeConfig(down_block_i=256)),
)


def default_decode_config(num_pairs: int) -> FusedMoeDecodeConfig:
    """The decode table's config for P = T*K pairs."""
    for max_pairs, config in _DECODE_CONFIGS:
        if num_pairs <= max_pairs:
            return config
    return _DECODE_CONFIGS[-1][1]


@dataclass(frozen=True, eq=False)
class SharedExpert:
    """The always-on shared expert of a MoE block, added to the routed sum with a per-token weight.

    gate_up [2I_s, H]: rows [0:I_s] gate, [I_s:2I_s] up (any row stride, contiguous last dim: it may be a
    row slice of a bigger stacked projection); down [H, I_s]; weight [T] (fp32 from `moe_route_topk`).
    Contributes weight[t] * round(down @ round(silu(round(gate @ x[t])) * round(up @ x[t]))), each round
    to x's dtype, as `ninfer.ops.mlp.swiglu_mlp` computes it.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    weight: torch.Tensor


@dataclass(frozen=True)
class ExpertBlocks:
    """The device-side layout of the pairs by expert (all int32, sizes from static bounds only).

    sorted_pairs [P]: pair indices t*K + k grouped by ascending expert, ascending within an expert.
    block_expert, block_row_start, block_row_end [max_blocks]: block b covers sorted rows
    [block_row_start[b], min(block_row_start[b] + block_m, block_row_end[b])) of expert block_expert[b];
    entries at b >= num_blocks[0] are not written.
    """

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_row_start: torch.Tensor
    block_row_end: torch.Tensor
    num_blocks: torch.Tensor


# ---- align ---------------------------------------------------------------------------------------------


@triton.jit
def _load_expert_ids(ids_ptr, pairs, valid, ids_stride_t, ids_stride_k, TOP_K: tl.constexpr):
    tokens = pairs // TOP_K
    slots = pairs - tokens * TOP_K
    ids = tl.load(ids_ptr + tokens.to(tl.int64) * ids_stride_t + slots * ids_stride_k, mask=valid, other=-1)
    return ids.to(tl.int32)


@triton.jit
def _chunk_histogram(
    ids_ptr, ids_stride_t, ids_stride_k, begin, end, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
    SUB: tl.constexpr,
):  # fmt: skip
    """Pairs per expert among pairs [begin, end): [BLOCK_E] int32."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(begin, end, SUB):
        pairs = start + tl.arange(0, SUB)
        ids = _load_expert_ids(ids_ptr, pairs, pairs < end, ids_stride_t, ids_stride_k, TOP_K)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    return counts


@triton.jit
def _scatter_chunk(
    ids_ptr, ids_stride_t, ids_stride_k, sorted_pairs_ptr, next_row, begin, end, TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr, SUB: tl.constexpr,
):  # fmt: skip
    """Write pairs [begin, end) to their sorted rows; next_row [BLOCK_E] is each expert's first free row.

    A pair's row is its expert's next free row plus the number of earlier pairs of the same expert in the
    same step, so the order within an expert is the pair order (stable).
    """
    experts = tl.arange(0, BLOCK_E)
    lane = tl.arange(0, SUB)
    earlier = lane[None, :] < lane[:, None]  # [i, j]: pair j comes before pair i
    for start in range(begin, end, SUB):
        pairs = start + lane
        valid = pairs < end
        ids = _load_expert_ids(ids_ptr, pairs, valid, ids_stride_t, ids_stride_k, TOP_K)
        hit = ids[:, None] == experts[None, :]
        row = tl.sum(tl.where(hit, next_row[None, :], 0), axis=1)
        row += tl.sum(((ids[:, None] == ids[None, :]) & earlier).to(tl.int32), axis=1)
        tl.store(sorted_pairs_ptr + row, pairs, mask=valid)
        next_row += tl.sum(hit.to(tl.int32), axis=0)


@triton.jit
def _write_block_layout(
    counts, block_expert_ptr, block_row_start_ptr, block_row_end_ptr, num_blocks_ptr,
    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Block table from the pairs per expert; returns each expert's first sorted row [BLOCK_E]."""
    experts = tl.arange(0, BLOCK_E)
    expert_blocks = (counts + BLOCK_M - 1) // BLOCK_M
    first_block = tl.cumsum(expert_blocks, axis=0) - expert_blocks
    first_row = tl.cumsum(counts, axis=0) - counts
    end_row = first_row + counts
    tl.store(num_blocks_ptr, tl.sum(expert_blocks, axis=0))
    for j in range(0, tl.max(expert_blocks, axis=0)):
        has_block = j < expert_blocks
        tl.store(block_expert_ptr + first_block + j, experts, mask=has_block)
        tl.store(block_row_start_ptr + first_block + j, first_row + j * BLOCK_M, mask=has_block)
        tl.store(block_row_end_ptr + first_block + j, end_row, mask=has_block)
    return first_row


@triton.jit
def _align_single_kernel(
    ids_ptr, sorted_pairs_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr, num_blocks_ptr,
    num_pairs, ids_stride_t, ids_stride_k,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, SUB: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    counts = _chunk_histogram(ids_ptr, ids_stride_t, ids_stride_k, 0, num_pairs, TOP_K, BLOCK_E, SUB)
    first_row = _write_block_layout(
        counts, block_expert_ptr, block_row_start_ptr, block_row_end_ptr, num_blocks_ptr, BLOCK_E, BLOCK_M
    )
    _scatter_chunk(
        ids_ptr, ids_stride_t, ids_stride_k, sorted_pairs_ptr, first_row, 0, num_pairs, TOP_K, BLOCK_E, SUB
    )


@triton.jit
def _align_count_kernel(
    ids_ptr, chunk_counts_ptr, num_pairs, ids_stride_t, ids_stride_k,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    chunk = tl.program_id(0)
    begin = chunk * CHUNK
    end = tl.minimum(begin + CHUNK, num_pairs)
    counts = _chunk_histogram(ids_ptr, ids_stride_t, ids_stride_k, begin, end, TOP_K, BLOCK_E, SUB)
    tl.store(chunk_counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit
def _align_layout_kernel(
    chunk_counts_ptr, chunk_first_row_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr,
    num_blocks_ptr, num_chunks,
    BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    chunks = tl.arange(0, BLOCK_C)
    tile = chunks[:, None] * BLOCK_E + tl.arange(0, BLOCK_E)[None, :]
    live = chunks[:, None] < num_chunks
    per_chunk = tl.load(chunk_counts_ptr + tile, mask=live, other=0)
    earlier_chunks = tl.cumsum(per_chunk, axis=0) - per_chunk
    first_row = _write_block_layout(
        tl.sum(per_chunk, axis=0), block_expert_ptr, block_row_start_ptr, block_row_end_ptr, num_blocks_ptr,
        BLOCK_E, BLOCK_M,
    )  # fmt: skip
    tl.store(chunk_first_row_ptr + tile, first_row[None, :] + earlier_chunks, mask=live)


@triton.jit
def _align_scatter_kernel(
    ids_ptr, chunk_first_row_ptr, sorted_pairs_ptr, num_pairs, ids_stride_t, ids_stride_k,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    chunk = tl.program_id(0)
    begin = chunk * CHUNK
    end = tl.minimum(begin + CHUNK, num_pairs)
    first_row = tl.load(chunk_first_row_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E))
    _scatter_chunk(
        ids_ptr, ids_stride_t, ids_stride_k, sorted_pairs_ptr, first_row, begin, end, TOP_K, BLOCK_E, SUB
    )


def align_pairs_by_expert(
    expert_ids: torch.Tensor, num_experts: int, block_m: int, *, align_chunk: int = 256
) -> ExpertBlocks:
    """Sort the (token, k) pairs of expert_ids [T, K] (int32/int64, values in [0, num_experts)) by expert
    on the device and cut each expert's rows into blocks of `block_m` (see `ExpertBlocks`)."""
    if expert_ids.dim() != 2 or expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"expert_ids must be [T, K] int32/int64, got {tuple(expert_ids.shape)} {expert_ids.dtype}"
        )
    if align_chunk < 1 or align_chunk & (align_chunk - 1):
        raise ValueError(f"align_chunk must be a power of two, got {align_chunk}")
    tokens, top_k = expert_ids.shape
    num_pairs = tokens * top_k
    max_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    device = expert_ids.device
    blocks = ExpertBlocks(
        sorted_pairs=torch.empty(num_pairs, dtype=torch.int32, device=device),
        block_expert=torch.empty(max_blocks, dtype=torch.int32, device=device),
        block_row_start=torch.empty(max_blocks, dtype=torch.int32, device=device),
        block_row_end=torch.empty(max_blocks, dtype=torch.int32, device=device),
        num_blocks=torch.empty(1, dtype=torch.int32, device=device),  # written by the layout code
    )
    if num_pairs == 0:
        blocks.num_blocks.zero_()
        return blocks
    block_e = triton.next_power_of_2(num_experts)
    chunk = max(align_chunk, triton.next_power_of_2(triton.cdiv(num_pairs, _MAX_ALIGN_CHUNKS)))
    sub = min(_ALIGN_SUB, chunk)
    num_chunks = triton.cdiv(num_pairs, chunk)
    stride_t, stride_k = expert_ids.stride()
    tables = (blocks.block_expert, blocks.block_row_start, blocks.block_row_end, blocks.num_blocks)
    table_writes = dict(zip(("block_expert", "block_row_start", "block_row_end", "num_blocks"), tables))
    if num_chunks == 1:
        if schedule.recording:
            schedule.record(
                "fused_moe._align_single_kernel", writes={"sorted_pairs": blocks.sorted_pairs, **table_writes}
            )
        _align_single_kernel[(1,)](
            expert_ids, blocks.sorted_pairs, *tables, num_pairs, stride_t, stride_k,
            TOP_K=top_k, BLOCK_E=block_e, BLOCK_M=block_m, SUB=sub, num_warps=4,
            USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
        )  # fmt: skip
        return blocks
    chunk_counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=device)
    chunk_first_row = torch.empty_like(chunk_counts)
    if schedule.recording:
        schedule.record("fused_moe._align_count_kernel", writes={"chunk_counts": chunk_counts})
        schedule.record(
            "fused_moe._align_layout_kernel", writes={"chunk_first_row": chunk_first_row, **table_writes}
        )
        schedule.record("fused_moe._align_scatter_kernel", writes={"sorted_pairs": blocks.sorted_pairs})
    _align_count_kernel[(num_chunks,)](
        expert_ids, chunk_counts, num_pairs, stride_t, stride_k,
        TOP_K=top_k, BLOCK_E=block_e, CHUNK=chunk, SUB=sub, num_warps=4,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    _align_layout_kernel[(1,)](
        chunk_counts, chunk_first_row, *tables, num_chunks,
        BLOCK_C=triton.next_power_of_2(num_chunks), BLOCK_E=block_e, BLOCK_M=block_m, num_warps=8,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    _align_scatter_kernel[(num_chunks,)](
        expert_ids, chunk_first_row, blocks.sorted_pairs, num_pairs, stride_t, stride_k,
        TOP_K=top_k, BLOCK_E=block_e, CHUNK=chunk, SUB=sub, num_warps=4,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    return blocks


# ---- grouped GEMMs -------------------------------------------------------------------------------------


@triton.jit
def _tile_coords(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped launch order: GROUP_M consecutive blocks sweep one N tile before the next N tile, so
    neighbouring programs share the expert's weight tile (and the gathered rows) through L2."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, hidden_ptr,
    sorted_pairs_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr, num_blocks_ptr,
    hidden_size, inter_size, max_blocks,
    x_stride_t, w_stride_e, w_stride_n,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    pid_m, pid_n = _tile_coords(tl.program_id(0), max_blocks, tl.cdiv(inter_size, BLOCK_N), GROUP_M)
    if pid_m >= tl.load(num_blocks_ptr):  # a block the bound allowed for but this routing did not use
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(block_row_start_ptr + pid_m) + tl.arange(0, BLOCK_M)
    row_mask = rows < tl.load(block_row_end_ptr + pid_m)
    tokens = tl.load(sorted_pairs_ptr + rows, mask=row_mask, other=0) // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter_size
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * x_stride_t + offs_k[None, :]
    gate_ptrs = w_ptr + expert * w_stride_e + offs_n[None, :] * w_stride_n + offs_k[:, None]  # [K, N]
    up_ptrs = gate_ptrs + inter_size * w_stride_n
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            w_gate = tl.load(gate_ptrs, mask=n_mask[None, :], other=0.0)
            w_up = tl.load(up_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < hidden_size - k0
            a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w_gate = tl.load(gate_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            w_up = tl.load(up_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc_gate = tl.dot(a, w_gate.to(a.dtype), acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, w_up.to(a.dtype), acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K

    # the reference rounds both projections and the SiLU product to the model dtype
    io_dtype = hidden_ptr.dtype.element_ty
    gate = acc_gate.to(io_dtype).to(tl.float32)
    up = acc_up.to(io_dtype).to(tl.float32)
    hidden = gate * tl.sigmoid(gate) * up
    hidden_ptrs = hidden_ptr + rows.to(tl.int64)[:, None] * inter_size + offs_n[None, :]
    tl.store(hidden_ptrs, hidden.to(io_dtype), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    hidden_ptr, w_ptr, pair_out_ptr,
    sorted_pairs_ptr, block_expert_ptr, block_row_start_ptr, block_row_end_ptr, num_blocks_ptr,
    hidden_size, inter_size, max_blocks,
    w_stride_e, w_stride_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    pid_m, pid_n = _tile_coords(tl.program_id(0), max_blocks, tl.cdiv(hidden_size, BLOCK_N), GROUP_M)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(block_row_start_ptr + pid_m) + tl.arange(0, BLOCK_M)
    row_mask = rows < tl.load(block_row_end_ptr + pid_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden_size
    offs_k = tl.arange(0, BLOCK_K)

    hidden_ptrs = hidden_ptr + rows.to(tl.int64)[:, None] * inter_size + offs_k[None, :]
    w_ptrs = w_ptr + expert * w_stride_e + offs_n[None, :] * w_stride_n + offs_k[:, None]  # [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        if EVEN_K:
            a = tl.load(hidden_ptrs, mask=row_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < inter_size - k0
            a = tl.load(hidden_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
        hidden_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    pairs = tl.load(sorted_pairs_ptr + rows, mask=row_mask, other=0)
    out_ptrs = pair_out_ptr + pairs.to(tl.int64)[:, None] * hidden_size + offs_n[None, :]
    tl.store(out_ptrs, acc.to(pair_out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _weighted_sum_kernel(
    pair_out_ptr, weights_ptr, out_ptr, shared_out_ptr, shared_weight_ptr,
    hidden_size, w_stride_t, w_stride_k, out_stride_t, shared_out_stride_t, shared_weight_stride_t,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden_size
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # fixed order over k: deterministic
        weight = tl.load(weights_ptr + token * w_stride_t + k * w_stride_k).to(tl.float32)
        expert_out = tl.load(pair_out_ptr + (token * TOP_K + k) * hidden_size + offs, mask=mask, other=0.0)
        acc += weight * expert_out.to(tl.float32)
    if HAS_SHARED:  # after the routed sum, as the reference adds it; one rounding at the end
        shared_weight = tl.load(shared_weight_ptr + token * shared_weight_stride_t).to(tl.float32)
        shared_out = tl.load(shared_out_ptr + token * shared_out_stride_t + offs, mask=mask, other=0.0)
        acc += shared_weight * shared_out.to(tl.float32)
    tl.store(out_ptr + token * out_stride_t + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---- decode path: one GEMV per pair, down fused with the weighted sum ------------------------------------


@triton.jit
def gate_up_rows(
    x_row_ptr, rows_base, row_stride, offs_n, n_mask, inter_size,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, HIDDEN_SIZE: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    """silu(gate @ x) * (up @ x) for the BLOCK_N intermediate columns offs_n of one expert whose gate rows
    start at rows_base (the up rows inter_size rows further), fp32 [BLOCK_N]; each projection is rounded
    to x's dtype first, as the reference rounds them (the caller rounds the product)."""
    offs_k = tl.arange(0, BLOCK_K)
    io_dtype = x_row_ptr.dtype.element_ty
    x_ptrs = x_row_ptr + offs_k
    gate_ptrs = rows_base + offs_n[:, None] * row_stride + offs_k[None, :]
    up_ptrs = rows_base + (offs_n[:, None] + inter_size) * row_stride + offs_k[None, :]
    # Elementwise fp32 partial sums, reduced once after the loop: the steps stay independent loads + FMAs
    # (no cross-thread reduction per step), and the unrolled steps let the compiler issue loads early.
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for step in tl.static_range(K_STEPS):
        if EVEN_K:
            xs = tl.load(x_ptrs + step * BLOCK_K)
            w_gate = tl.load(gate_ptrs + step * BLOCK_K, mask=n_mask[:, None], other=0.0)
            w_up = tl.load(up_ptrs + step * BLOCK_K, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < HIDDEN_SIZE - step * BLOCK_K
            xs = tl.load(x_ptrs + step * BLOCK_K, mask=k_mask, other=0.0)
            w_mask = n_mask[:, None] & k_mask[None, :]
            w_gate = tl.load(gate_ptrs + step * BLOCK_K, mask=w_mask, other=0.0)
            w_up = tl.load(up_ptrs + step * BLOCK_K, mask=w_mask, other=0.0)
        xs = xs.to(tl.float32)[None, :]
        # weights cast to the model dtype first, as the reference's `.to(x.dtype)` does
        acc_gate += w_gate.to(io_dtype).to(tl.float32) * xs
        acc_up += w_up.to(io_dtype).to(tl.float32) * xs
    gate = tl.sum(acc_gate, axis=1).to(io_dtype).to(tl.float32)
    up = tl.sum(acc_up, axis=1).to(io_dtype).to(tl.float32)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _decode_gate_up_kernel(
    x_ptr, w_ptr, ids_ptr, hidden_ptr, shared_w_ptr,
    inter_size, x_stride_t, w_stride_e, w_stride_n, ids_stride_t, ids_stride_k, shared_w_stride_n,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_STEPS: tl.constexpr, HIDDEN_SIZE: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    SLOTS = TOP_K + HAS_SHARED  # a token's routed experts, then its shared expert
    pair = tl.program_id(0)
    token = pair // SLOTS
    slot = pair - token * SLOTS
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter_size

    # with HAS_SHARED, slot TOP_K of a token is the shared expert: only the rows' base and stride differ, so
    # a scalar branch picks them and the loop is the same for every slot (its ids read is clamped to a
    # valid slot and unused)
    expert = tl.load(ids_ptr + token.to(tl.int64) * ids_stride_t + tl.minimum(slot, TOP_K - 1) * ids_stride_k)
    rows_base = w_ptr + expert.to(tl.int64) * w_stride_e
    row_stride = w_stride_n
    if HAS_SHARED:  # noqa: SIM102 (a constexpr branch: no code without a shared expert)
        if slot == TOP_K:
            rows_base = shared_w_ptr
            row_stride = shared_w_stride_n
    hidden = gate_up_rows(
        x_ptr + token.to(tl.int64) * x_stride_t, rows_base, row_stride, offs_n, n_mask, inter_size,
        BLOCK_N, BLOCK_K, K_STEPS, HIDDEN_SIZE, EVEN_K,
    )  # fmt: skip
    io_dtype = hidden_ptr.dtype.element_ty
    tl.store(hidden_ptr + pair.to(tl.int64) * inter_size + offs_n, hidden.to(io_dtype), mask=n_mask)


@triton.jit
def _decode_down_combine_kernel(
    hidden_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, shared_w_ptr, shared_weight_ptr,
    hidden_size, w_stride_e, w_stride_h, ids_stride_t, ids_stride_k, weights_stride_t, weights_stride_k,
    out_stride_t, shared_w_stride_h, shared_weight_stride_t,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
    I_STEPS: tl.constexpr, EXPERTS_PER_STEP: tl.constexpr, INTER_SIZE: tl.constexpr, EVEN_I: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    SLOTS = TOP_K + HAS_SHARED  # rows of the intermediate per token (the shared expert's last)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < hidden_size
    offs_i = tl.arange(0, BLOCK_I)
    io_dtype = hidden_ptr.dtype.element_ty

    if HAS_SHARED:
        # The shared expert's down rows first in program order: their loads are independent of the routed
        # experts' and can be in flight with them; the term is added last, as the reference adds it.
        shared_hidden_ptrs = hidden_ptr + (token * SLOTS + TOP_K) * INTER_SIZE + offs_i
        shared_w_ptrs = shared_w_ptr + offs_h[:, None] * shared_w_stride_h + offs_i[None, :]
        shared_acc = tl.zeros([BLOCK_H, BLOCK_I], dtype=tl.float32)
        for step in tl.static_range(I_STEPS):
            if EVEN_I:
                a = tl.load(shared_hidden_ptrs + step * BLOCK_I)
                w = tl.load(shared_w_ptrs + step * BLOCK_I, mask=h_mask[:, None], other=0.0)
            else:
                i_mask = offs_i < INTER_SIZE - step * BLOCK_I
                a = tl.load(shared_hidden_ptrs + step * BLOCK_I, mask=i_mask, other=0.0)
                w = tl.load(shared_w_ptrs + step * BLOCK_I, mask=h_mask[:, None] & i_mask[None, :], other=0.0)
            shared_acc += w.to(io_dtype).to(tl.float32) * a.to(tl.float32)[None, :]
        shared_out = tl.sum(shared_acc, axis=1).to(io_dtype).to(tl.float32)  # rounded like any expert's

    out = tl.zeros([BLOCK_H], dtype=tl.float32)
    for first_slot in tl.static_range(0, TOP_K, EXPERTS_PER_STEP):  # fixed order over k: deterministic
        slots = first_slot + tl.arange(0, EXPERTS_PER_STEP)
        slot_mask = slots < TOP_K
        experts = tl.load(ids_ptr + token * ids_stride_t + slots * ids_stride_k, mask=slot_mask, other=0)
        weight = tl.load(
            weights_ptr + token * weights_stride_t + slots * weights_stride_k, mask=slot_mask, other=0.0
        ).to(tl.float32)
        hidden_ptrs = hidden_ptr + (token * SLOTS + slots)[:, None] * INTER_SIZE + offs_i[None, :]
        w_ptrs = (
            w_ptr
            + experts.to(tl.int64)[:, None, None] * w_stride_e
            + offs_h[None, :, None] * w_stride_h
            + offs_i[None, None, :]
        )  # [experts, BLOCK_H, BLOCK_I]
        rows_mask = slot_mask[:, None, None] & h_mask[None, :, None]
        acc = tl.zeros([EXPERTS_PER_STEP, BLOCK_H, BLOCK_I], dtype=tl.float32)
        for step in tl.static_range(I_STEPS):
            if EVEN_I:
                a = tl.load(hidden_ptrs + step * BLOCK_I, mask=slot_mask[:, None], other=0.0)
                w = tl.load(w_ptrs + step * BLOCK_I, mask=rows_mask, other=0.0)
            else:
                i_mask = offs_i < INTER_SIZE - step * BLOCK_I
                a_mask = slot_mask[:, None] & i_mask[None, :]
                a = tl.load(hidden_ptrs + step * BLOCK_I, mask=a_mask, other=0.0)
                w = tl.load(w_ptrs + step * BLOCK_I, mask=rows_mask & i_mask[None, None, :], other=0.0)
            acc += w.to(io_dtype).to(tl.float32) * a.to(tl.float32)[:, None, :]
        # each expert output rounded to the model dtype, then weighted in fp32 (as the reference does)
        expert_out = tl.sum(acc, axis=2).to(io_dtype).to(tl.float32)  # [experts, BLOCK_H]
        out += tl.sum(weight[:, None] * expert_out, axis=0)
    if HAS_SHARED:
        out += tl.load(shared_weight_ptr + token * shared_weight_stride_t).to(tl.float32) * shared_out
    tl.store(out_ptr + token * out_stride_t + offs_h, out.to(out_ptr.dtype.element_ty), mask=h_mask)


def _decode_gate_up(
    x: torch.Tensor, gate_up: torch.Tensor, expert_ids: torch.Tensor, hidden: torch.Tensor,
    config: FusedMoeDecodeConfig, shared: SharedExpert | None = None,
) -> None:  # fmt: skip
    """hidden [T*S, I] (x's dtype, row t*S + slot) <- silu(gate[e] @ x[t]) * (up[e] @ x[t]) for every
    pair, S = K slots, or K + 1 with the shared expert's row last."""
    hidden_size = x.shape[1]
    num_pairs, inter_size = hidden.shape
    block_k = min(config.gate_up_block_k, triton.next_power_of_2(hidden_size))
    # no shared expert: its pointer and stride are placeholders the kernel never reads
    shared_gate_up = shared.gate_up if shared is not None else gate_up
    if schedule.recording:
        schedule.record("fused_moe._decode_gate_up_kernel", writes={"hidden": hidden})
    _decode_gate_up_kernel[(num_pairs, triton.cdiv(inter_size, config.gate_up_block_n))](
        x, gate_up, expert_ids, hidden, shared_gate_up,
        inter_size, x.stride(0), gate_up.stride(0), gate_up.stride(1), *expert_ids.stride(),
        shared_gate_up.stride(-2),
        TOP_K=expert_ids.shape[1], HAS_SHARED=shared is not None, BLOCK_N=config.gate_up_block_n,
        BLOCK_K=block_k, K_STEPS=triton.cdiv(hidden_size, block_k), HIDDEN_SIZE=hidden_size,
        EVEN_K=hidden_size % block_k == 0, num_warps=config.gate_up_warps,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip


def decode_down_combine(
    hidden: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
    out: torch.Tensor, config: FusedMoeDecodeConfig, *, shared_down: torch.Tensor | None = None,
    shared_weight: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """out [T, H] <- sum_k weights[t, k] * (down[e] @ hidden[t*S + k]) (+ shared_weight[t] *
    (shared_down @ hidden[t*S + K])), expert outputs rounded first; S = K slots, K + 1 with the shared
    expert (give both shared_down and shared_weight)."""
    tokens, hidden_size = out.shape
    inter_size = hidden.shape[1]
    top_k = expert_ids.shape[1]
    block_i = min(config.down_block_i, triton.next_power_of_2(inter_size))
    if (shared_down is None) != (shared_weight is None):
        raise ValueError("pass both shared_down and shared_weight, or neither")
    has_shared = shared_down is not None and shared_weight is not None
    # no shared expert: placeholders the kernel never reads
    if not has_shared:
        shared_down, shared_weight = down, weights
    assert shared_down is not None and shared_weight is not None
    if schedule.recording:
        schedule.record("fused_moe._decode_down_combine_kernel", writes={"out": out})
    _decode_down_combine_kernel[(tokens, triton.cdiv(hidden_size, config.down_block_h))](
        hidden, down, expert_ids, weights, out, shared_down, shared_weight,
        hidden_size, down.stride(0), down.stride(1), *expert_ids.stride(), *weights.stride(), out.stride(0),
        shared_down.stride(-2), shared_weight.stride(0),
        TOP_K=top_k, HAS_SHARED=has_shared, BLOCK_H=config.down_block_h, BLOCK_I=block_i,
        I_STEPS=triton.cdiv(inter_size, block_i),
        EXPERTS_PER_STEP=min(config.down_experts, triton.next_power_of_2(top_k)), INTER_SIZE=inter_size,
        EVEN_I=inter_size % block_i == 0, num_warps=config.down_warps,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip


def _fused_moe_decode(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
    expert_ids: torch.Tensor, out: torch.Tensor, config: FusedMoeDecodeConfig,
    shared: SharedExpert | None = None,
) -> None:  # fmt: skip
    tokens, top_k = expert_ids.shape
    slots = top_k + (shared is not None)
    hidden = torch.empty((tokens * slots, down.shape[2]), dtype=x.dtype, device=x.device)
    _decode_gate_up(x, gate_up, expert_ids, hidden, config, shared)
    decode_down_combine(
        hidden, down, expert_ids, weights, out, config,
        shared_down=shared.down if shared is not None else None,
        shared_weight=shared.weight if shared is not None else None,
    )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_shared(
    shared: SharedExpert, x: torch.Tensor, gate_up: torch.Tensor, inter_size: int, decode: bool
) -> SharedExpert:
    """Shapes of the shared expert against x; the decode path also needs the routed experts' I and
    gate_up dtype (its gate_up kernel picks the shared rows by pointer, in the same loop)."""
    tokens, hidden_size = x.shape
    shared_inter = shared.down.shape[-1] if shared.down.dim() == 2 else -1
    if shared.gate_up.shape != (2 * shared_inter, hidden_size) or shared.down.shape != (
        hidden_size,
        shared_inter,
    ):
        raise ValueError(
            f"shared.gate_up {tuple(shared.gate_up.shape)} / shared.down {tuple(shared.down.shape)} must be "
            f"[2*I_s, {hidden_size}] / [{hidden_size}, I_s]"
        )
    if shared.weight.shape != (tokens,) or not shared.weight.is_floating_point():
        raise ValueError(f"shared.weight must be [{tokens}] floating point, got {tuple(shared.weight.shape)}")
    if decode and shared_inter != inter_size:
        raise ValueError(
            f"the decode path runs the shared expert as one more expert slot: its width {shared_inter} must "
            f"equal the routed experts' {inter_size} (or take the sorted path with a FusedMoeConfig)"
        )
    if decode and shared.gate_up.dtype != gate_up.dtype:
        raise ValueError(
            f"the decode path needs shared.gate_up in gate_up's dtype {gate_up.dtype}, "
            f"got {shared.gate_up.dtype}"
        )
    return SharedExpert(
        gate_up=_last_dim_contiguous(shared.gate_up),
        down=_last_dim_contiguous(shared.down),
        weight=shared.weight,
    )


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    shared: SharedExpert | None = None,
    out: torch.Tensor | None = None,
    config: FusedMoeConfig | FusedMoeDecodeConfig | None = None,
) -> torch.Tensor:
    """Routed experts: sum_k weights[t, k] * expert_{expert_ids[t, k]}(x[t]) -> [T, H] in x's dtype.

    x [T, H] bf16/fp16/fp32; gate_up [E, 2I, H] (rows [0:I] gate, [I:2I] up); down [E, H, I] (weights are
    cast to x's dtype as they are read); weights [T, K] any float dtype (fp32 from `moe_route_topk`, or the
    model dtype); expert_ids [T, K] int32/int64 with values in [0, E) (not checked: that would need a host
    sync). `shared` adds shared.weight[t] * shared_expert(x[t]) inside the same fp32 sum (see
    `SharedExpert`), rounded to x's dtype once at the end, as `REFERENCE.moe_block` combines them.
    `out` may supply the [T, H] buffer (x's dtype, contiguous last dim, not aliasing x). Path:
    `config=None` takes the decode path with `default_decode_config(T*K)` when T*K <= DECODE_MAX_PAIRS,
    else the sorted path with `default_config(T*K)`; a `FusedMoeDecodeConfig` forces the decode path and
    a `FusedMoeConfig` the sorted path. Same result as `ninfer.ops.moe.moe_experts` (+ the shared term) up
    to fp32 summation order; deterministic; no host sync.
    """
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be [T, H] bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
    tokens, hidden_size = x.shape
    num_experts, two_inter, gate_up_hidden = gate_up.shape
    inter_size = two_inter // 2
    if gate_up_hidden != hidden_size or two_inter % 2 or down.shape != (num_experts, hidden_size, inter_size):
        raise ValueError(
            f"gate_up {tuple(gate_up.shape)} / down {tuple(down.shape)} do not fit x {tuple(x.shape)}"
        )
    if expert_ids.dim() != 2 or expert_ids.shape[0] != tokens or weights.shape != expert_ids.shape:
        raise ValueError(
            f"weights {tuple(weights.shape)} / expert_ids {tuple(expert_ids.shape)} must be [{tokens}, K]"
        )
    if not weights.is_floating_point():
        raise ValueError(f"weights must be floating point, got {weights.dtype}")
    if out is None:
        out = torch.empty((tokens, hidden_size), dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [{tokens}, {hidden_size}] {x.dtype} with a contiguous last dim")
    top_k = expert_ids.shape[1]
    num_pairs = tokens * top_k
    if config is None and num_pairs <= DECODE_MAX_PAIRS:
        config = default_decode_config(num_pairs)
    decode = isinstance(config, FusedMoeDecodeConfig)
    if shared is not None:
        if top_k == 0:
            raise ValueError("a shared expert needs K >= 1 routed experts")
        shared = _check_shared(shared, x, gate_up, inter_size, decode)
    if num_pairs == 0:
        return out.zero_()  # T = 0 is empty; K = 0 sums nothing

    x = _last_dim_contiguous(x)
    gate_up = _last_dim_contiguous(gate_up)
    down = _last_dim_contiguous(down)
    if decode:
        _fused_moe_decode(x, gate_up, down, weights, expert_ids, out, config, shared=shared)
    else:
        config = config or default_config(num_pairs)
        _fused_moe_sorted(x, gate_up, down, weights, expert_ids, out, config, shared=shared)
    return out


def _shared_expert_out(x: torch.Tensor, shared: SharedExpert) -> torch.Tensor:
    """shared.down @ (silu(gate) * up) [T, H] in x's dtype, rounded where `swiglu_mlp` rounds (both
    projections, the SiLU product, the output): one GEMM for gate and up, one for down."""
    inter = shared.down.shape[1]
    projected = F.linear(x, shared.gate_up.to(x.dtype))
    return F.linear(swiglu(projected[:, :inter], projected[:, inter:]), shared.down.to(x.dtype))


def _fused_moe_sorted(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
    expert_ids: torch.Tensor, out: torch.Tensor, config: FusedMoeConfig, shared: SharedExpert | None = None,
) -> None:  # fmt: skip
    tokens, hidden_size = x.shape
    num_experts, inter_size = gate_up.shape[0], down.shape[2]
    top_k = expert_ids.shape[1]
    num_pairs = tokens * top_k
    blocks = align_pairs_by_expert(expert_ids, num_experts, config.block_m, align_chunk=config.align_chunk)
    tables = (blocks.sorted_pairs, blocks.block_expert, blocks.block_row_start, blocks.block_row_end)
    max_blocks = blocks.block_expert.shape[0]
    dot_precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32: no TF32 rounding

    hidden = torch.empty((num_pairs, inter_size), dtype=x.dtype, device=x.device)  # sorted row order
    pair_out = torch.empty((num_pairs, hidden_size), dtype=x.dtype, device=x.device)  # pair order
    gate_up_grid = (max_blocks * triton.cdiv(inter_size, config.gate_up_block_n),)
    if schedule.recording:
        schedule.record("fused_moe._gate_up_kernel", writes={"hidden": hidden})
    _gate_up_kernel[gate_up_grid](
        x, gate_up, hidden, *tables, blocks.num_blocks,
        hidden_size, inter_size, max_blocks,
        x.stride(0), gate_up.stride(0), gate_up.stride(1),
        TOP_K=top_k, BLOCK_M=config.block_m, BLOCK_N=config.gate_up_block_n, BLOCK_K=config.gate_up_block_k,
        GROUP_M=config.group_m, EVEN_K=hidden_size % config.gate_up_block_k == 0, DOT_PRECISION=dot_precision,
        num_warps=config.gate_up_warps, num_stages=config.gate_up_stages,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    down_grid = (max_blocks * triton.cdiv(hidden_size, config.down_block_n),)
    if schedule.recording:
        schedule.record("fused_moe._down_kernel", writes={"pair_out": pair_out})
    _down_kernel[down_grid](
        hidden, down, pair_out, *tables, blocks.num_blocks,
        hidden_size, inter_size, max_blocks,
        down.stride(0), down.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.down_block_n, BLOCK_K=config.down_block_k,
        GROUP_M=config.group_m, EVEN_K=inter_size % config.down_block_k == 0, DOT_PRECISION=dot_precision,
        num_warps=config.down_warps, num_stages=config.down_stages,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    block_h = min(_SUM_BLOCK_H, triton.next_power_of_2(hidden_size))
    # the shared expert in torch ops; only its weighted add joins the fp32 sum (no placeholder reads)
    shared_out = _shared_expert_out(x, shared) if shared is not None else pair_out
    shared_weight = shared.weight if shared is not None else weights
    if schedule.recording:
        schedule.record("fused_moe._weighted_sum_kernel", writes={"out": out})
    _weighted_sum_kernel[(tokens, triton.cdiv(hidden_size, block_h))](
        pair_out, weights, out, shared_out, shared_weight,
        hidden_size, weights.stride(0), weights.stride(1), out.stride(0), shared_out.stride(0),
        shared_weight.stride(0),
        TOP_K=top_k, HAS_SHARED=shared is not None, BLOCK_H=block_h, num_warps=4,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
