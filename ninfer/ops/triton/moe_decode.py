"""The MoE block of a decode step from its stacked input projection, in two launches (fast path of
`REFERENCE.moe_block` for T*K <= DECODE_MAX_PAIRS tokens x experts).

The model first projects x [T, H] through the layer's stacked input rows [router; shared gate; shared up]
(one GEMV, `projected` [T, E + 2I] in the model dtype, exactly the reference's `F.linear(x, input_proj)`).
Then:

1. `routed_gate_up`, one launch over (T x (K + 1) slots, I / BLOCK_N columns):
   - a routed slot k of token t ranks the token's E router logits itself (the packed-key max of
     `moe_route_topk`'s order: largest logit first, ties to the lowest expert), takes the k-th expert and
     streams its gate and up rows against x[t] (`fused_moe.gate_up_rows`);
   - the shared slot K forms silu(gate) * up from the projected shared columns (no weights to read) and,
     in its first column block, writes the token's routing (renormalised top-k weights, rounded as the
     reference rounds them, and the expert ids) and the shared expert's weight sigmoid(x . gate), whose
     dot it takes before its PDL wait (x's writer finished before `projected`'s kernel passed its wait).
2. `fused_moe.decode_down_combine`: the experts' down rows and the weighted fp32 sum, the shared expert's
   term last, rounded once. For T*K <= EARLY_DOWN_MAX_PAIRS (one token at top-8), `_early_down_combine_kernel`
   instead: the same arithmetic and bits, but it ranks its token's experts again from `projected` (written
   two launches back, so readable before its PDL wait) and issues its down-row loads before the wait, so
   that they overlap launch 1's tail. Faster at one token; at eight tokens much slower (its preloaded rows
   take so many registers that half as many programs fit an SM, and the launch runs in several waves, so
   only the first one's loads overlap anything): docs/benchmarks.md, "Why the kernels are as they are", MoE.

Why: the router GEMV then runs in the same stacked GEMV as the shared expert's gate and up (5 MB at 35B-A3B,
at the GEMV's bandwidth), and no launch waits on one program that routes all tokens (the ticket-counter kernel
this replaces spent most of its time per layer in that serial tail; docs/benchmarks.md, MoE). Every routed
program repeats its token's top-k (up to K rounds of one max reduction over E = 256 values): a few hundred
nanoseconds each, all in parallel.

Roundings and ranking are those of `moe_route_topk` + `fused_moe(..., shared=SharedExpert(...))`: the same
results up to the dots' fp32 summation order. No host sync, every grid from static shapes: graph-capturable.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl, schedule
from ninfer.ops.triton.fused_moe import (
    DECODE_MAX_PAIRS,
    FusedMoeDecodeConfig,
    check_powers_of_two,
    decode_down_combine,
    default_decode_config,
    gate_up_rows,
)

__all__ = ["RoutedGateUpConfig", "default_gate_up_config", "moe_decode_block", "routed_gate_up"]

_MAX_EXPERTS = 1024  # one [BLOCK_E] int64 key tile per program
_MAX_BLOCK_H = 2048  # x / gate columns per step of the shared-gate dot
# Down-row bytes per thread the early down kernel may hold across its PDL wait: all of its tiles at the
# default down tiles of T = 1 (288 bytes at Qwen3.6's shapes: 4 hidden rows of 8 experts and the shared
# one over 4 warps), else only the first I-step of the first expert group and the shared expert's (tiles
# the two-launch kernel has in flight at once too).
_MAX_PRELOAD_BYTES = 288
EARLY_DOWN_MAX_PAIRS = 8  # the early down launch by default: one token (faster at T = 1, slower at T = 8)
# Registers of the early down kernel: 162 uncapped at Qwen3.6's T = 1 tiles, 3 programs per SM, so its 512
# programs ran in 1.3 waves; at 128 (140 bytes spilled) 4 fit and they are one wave, measured faster in the
# 35B-A3B decode graph at B = 1 (docs/benchmarks.md, "Why the kernels are as they are", MoE).
EARLY_DOWN_MAXNREG = 128


@dataclasses.dataclass(frozen=True)
class RoutedGateUpConfig:
    """Tiles of `routed_gate_up` (powers of two): a program ranks its token's experts once, then owns
    n_loop blocks of block_n intermediate columns (a gate and an up tile of [block_n, block_k] per step
    over H), so n_loop trades the repeated ranking against fewer, longer programs. narrow_keys: rank
    16-bit logits as int32 keys rather than int64 (`_logit_keys`; the same ranking)."""

    block_n: int = 2
    block_k: int = 2048
    n_loop: int = 1
    warps: int = 4
    narrow_keys: bool = True

    def __post_init__(self) -> None:
        check_powers_of_two(self)


# (largest T*K, tiles) from the H200 sweep of the stacked GEMV + both launches: at T = 1 one block of 2
# columns over the whole H per program, at T = 8 the same tile with 4 blocks per program, so that the 4608
# programs' repeated ranking shrinks to one wave's worth. Re-timed inside the whole 35B-A3B decode graph,
# T = 1 takes 2 blocks per program. Not timed: T = 2 (16 pairs, one block) and T = 3..4 (2 blocks per
# program). Narrow (int32) ranking keys are faster at T = 8 and slower at T = 1, in this launch and in the
# early down launch's ranking alike, so T = 1 keeps int64 keys, as does the early down launch (one token
# only); why the narrow ranking is slower at one token is not established. The figures and the tiles tried:
# docs/benchmarks.md, "Why the kernels are as they are", MoE.
_GATE_UP_CONFIGS: tuple[tuple[int, RoutedGateUpConfig], ...] = (
    (8, RoutedGateUpConfig(block_n=2, block_k=2048, n_loop=2, warps=4, narrow_keys=False)),
    (16, RoutedGateUpConfig(block_n=2, block_k=2048, n_loop=1, warps=4)),
    (32, RoutedGateUpConfig(block_n=2, block_k=2048, n_loop=2, warps=4)),
    (1 << 62, RoutedGateUpConfig(block_n=2, block_k=2048, n_loop=4, warps=4)),
)


def default_gate_up_config(num_pairs: int) -> RoutedGateUpConfig:
    """The table's gate/up tiles for P = T*K pairs."""
    for max_pairs, config in _GATE_UP_CONFIGS:
        if num_pairs <= max_pairs:
            return config
    return _GATE_UP_CONFIGS[-1][1]


@triton.jit
def _logit_keys(
    logits_ptr, NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, CACHE_MODIFIER: tl.constexpr,
    NARROW: tl.constexpr,
):  # fmt: skip
    """A token's router logits as packed keys [BLOCK_E] whose max is the largest logit and, among equal
    logits, the lowest expert: (an order-preserving integer of the logit's bits) << SHIFT | (BLOCK_E-1-e),
    -> (keys, the logits in fp32, valid). NARROW (16-bit logits only): int32 keys of the 16 storage bits
    (SHIFT 16), whose max is one warp reduction instruction and one 32-bit compare, else int64 keys of the
    fp32 bits (SHIFT 32; `RoutedGateUpConfig.narrow_keys` says where each is faster)."""
    experts = tl.arange(0, BLOCK_E)
    valid = experts < NUM_EXPERTS
    logits = tl.load(logits_ptr + experts, mask=valid, other=0.0, cache_modifier=CACHE_MODIFIER)
    logits = tl.where(logits == 0.0, 0.0, logits)  # -0.0 == +0.0 must tie, so they need one key
    low = BLOCK_E - 1 - experts
    if NARROW:
        tl.static_assert(logits.dtype.primitive_bitwidth == 16, "narrow keys need 16-bit logits")
        bits = logits.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended
        keys = bits ^ ((bits >> 15) & 0x7FFF)  # flip the magnitude bits of negatives (an involution)
        packed = (keys << 16) + low
        lowest = tl.full([BLOCK_E], -(2**31), tl.int32)
    else:
        bits = logits.to(tl.float32).to(tl.int32, bitcast=True)
        keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        packed = (keys.to(tl.int64) << 32) + low.to(tl.int64)
        lowest = tl.full([BLOCK_E], -(2**63), tl.int64)
    return tl.where(valid, packed, lowest), logits.to(tl.float32), valid


@triton.jit
def _take_best(packed, BLOCK_E: tl.constexpr):
    """(the best candidate's expert, the keys with it taken out)."""
    experts = tl.arange(0, BLOCK_E)
    best = tl.max(packed, axis=0)
    if packed.dtype.primitive_bitwidth == 32:
        chosen = (BLOCK_E - 1 - (best & 0xFFFF)).to(tl.int32)
        taken = tl.full([BLOCK_E], -(2**31), tl.int32)
    else:
        chosen = (BLOCK_E - 1 - (best - ((best >> 32) << 32))).to(tl.int32)
        taken = tl.full([BLOCK_E], -(2**63), tl.int64)
    return chosen, tl.where(experts == chosen, taken, packed)


@triton.jit
def _write_routing(
    logits_ptr, weights_ptr, ids_ptr, weights_stride_k, ids_stride_k,
    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
    NARROW_KEYS: tl.constexpr,
):  # fmt: skip
    """The token's top-k ids and renormalised softmax weights (rounded to the logits' dtype, stored fp32)."""
    packed, logits, valid = _logit_keys(logits_ptr, NUM_EXPERTS, BLOCK_E, "", NARROW_KEYS)
    slots = tl.arange(0, BLOCK_SLOTS)
    top_ids = tl.zeros([BLOCK_SLOTS], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        chosen, packed = _take_best(packed, BLOCK_E)
        top_ids = tl.where(slots == k, chosen, top_ids)
    slot_mask = slots < TOP_K
    top_logits = tl.load(logits_ptr + top_ids, mask=slot_mask, other=float("-inf")).to(tl.float32)
    row_max = tl.max(top_logits, axis=0)
    denominator = tl.sum(tl.where(valid, tl.exp(logits - row_max), 0.0), axis=0)
    top_probs = tl.where(slot_mask, tl.exp(top_logits - row_max) / denominator, 0.0)
    model_dtype = logits_ptr.dtype.element_ty
    weights = (top_probs / tl.sum(top_probs, axis=0)).to(model_dtype).to(tl.float32)
    tl.store(weights_ptr + slots * weights_stride_k, weights, mask=slot_mask)
    tl.store(ids_ptr + slots * ids_stride_k, top_ids, mask=slot_mask)


@triton.jit
def _shared_gate_weight(x_row_ptr, gate_ptr, HIDDEN_SIZE: tl.constexpr, BLOCK_H: tl.constexpr):
    """sigmoid(round_to_x_dtype(x . gate)) with an fp32 dot, the gate cast to x's dtype first. Run before
    the PDL wait: x through L2 (`.cg`, as the early down launch reads `projected`), never a line an earlier
    kernel left in this SM's L1."""
    x_dtype = x_row_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in tl.static_range(0, HIDDEN_SIZE, BLOCK_H):
        col_mask = cols < HIDDEN_SIZE - start
        xs = tl.load(x_row_ptr + start + cols, mask=col_mask, other=0.0, cache_modifier=".cg")
        gate = tl.load(gate_ptr + start + cols, mask=col_mask, other=0.0).to(x_dtype)
        acc += xs.to(tl.float32) * gate.to(tl.float32)
    return tl.sigmoid(tl.sum(acc, axis=0).to(x_dtype).to(tl.float32))


@triton.jit
def _routed_gate_up_kernel(
    x_ptr, projected_ptr, w_ptr, gate_ptr, hidden_ptr, weights_ptr, ids_ptr, shared_weight_ptr,
    inter_size, x_stride_t, projected_stride_t, w_stride_e, w_stride_n,
    weights_stride_t, weights_stride_k, ids_stride_t, ids_stride_k, shared_weight_stride_t,
    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr, N_LOOP: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
    HIDDEN_SIZE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_H: tl.constexpr, NARROW_KEYS: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    token = pair // (TOP_K + 1)
    slot = pair - token * (TOP_K + 1)
    n_block = tl.program_id(1)
    io_dtype = hidden_ptr.dtype.element_ty
    logits_ptr = projected_ptr + token.to(tl.int64) * projected_stride_t  # the row's first E columns
    x_row_ptr = x_ptr + token.to(tl.int64) * x_stride_t
    routes = (slot == TOP_K) & (n_block == 0)  # the token's one program that writes its routing
    shared_weight = tl.zeros([], dtype=tl.float32)
    if routes:  # before the wait: the gate is bound, and x's writer finished before `projected`'s started
        shared_weight = _shared_gate_weight(x_row_ptr, gate_ptr, HIDDEN_SIZE, BLOCK_H)
    pdl.enter(USE_PDL)
    hidden_row = hidden_ptr + pair.to(tl.int64) * inter_size
    if slot < TOP_K:
        packed, _, _ = _logit_keys(logits_ptr, NUM_EXPERTS, BLOCK_E, "", NARROW_KEYS)
        expert = slot * 0
        for _ in range(slot + 1):  # the slot-th best needs slot + 1 rounds
            expert, packed = _take_best(packed, BLOCK_E)
        rows_base = w_ptr + expert.to(tl.int64) * w_stride_e
        for j in tl.static_range(N_LOOP):
            offs_n = (n_block * N_LOOP + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < inter_size
            hidden = gate_up_rows(
                x_row_ptr, rows_base, w_stride_n, offs_n, n_mask, inter_size,
                BLOCK_N, BLOCK_K, K_STEPS, HIDDEN_SIZE, EVEN_K,
            )  # fmt: skip
            tl.store(hidden_row + offs_n, hidden.to(io_dtype), mask=n_mask)
    else:  # the shared expert: its gate and up are projected already
        for j in tl.static_range(N_LOOP):
            offs_n = (n_block * N_LOOP + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < inter_size
            gate = tl.load(logits_ptr + NUM_EXPERTS + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            up = tl.load(logits_ptr + NUM_EXPERTS + inter_size + offs_n, mask=n_mask, other=0.0)
            hidden = gate * tl.sigmoid(gate) * up.to(tl.float32)
            tl.store(hidden_row + offs_n, hidden.to(io_dtype), mask=n_mask)
        if routes:  # hands the routing to the down kernel
            _write_routing(
                logits_ptr, weights_ptr + token * weights_stride_t, ids_ptr + token * ids_stride_t,
                weights_stride_k, ids_stride_k, NUM_EXPERTS, TOP_K, BLOCK_E, BLOCK_SLOTS, NARROW_KEYS,
            )  # fmt: skip
            tl.store(shared_weight_ptr + token * shared_weight_stride_t, shared_weight)


@triton.jit
def _down_tile(
    ptrs, rows_mask, offs_i, step, BLOCK_I: tl.constexpr, INTER_SIZE: tl.constexpr, EVEN_I: tl.constexpr
):  # fmt: skip
    """Step `step` of BLOCK_I columns of down rows (rows_mask and offs_i broadcast to the rows' rank), with
    `_decode_down_combine_kernel`'s masks."""
    if EVEN_I:
        w = tl.load(ptrs + step * BLOCK_I, mask=rows_mask, other=0.0)
    else:
        w = tl.load(ptrs + step * BLOCK_I, mask=rows_mask & (offs_i < INTER_SIZE - step * BLOCK_I), other=0.0)
    return w


@triton.jit
def _early_down_combine_kernel(
    projected_ptr, hidden_ptr, w_ptr, weights_ptr, out_ptr, shared_w_ptr, shared_weight_ptr,
    hidden_size, projected_stride_t, w_stride_e, w_stride_h, weights_stride_t, weights_stride_k,
    out_stride_t, shared_w_stride_h, shared_weight_stride_t,
    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_I: tl.constexpr, I_STEPS: tl.constexpr, EXPERTS_PER_STEP: tl.constexpr, INTER_SIZE: tl.constexpr,
    EVEN_I: tl.constexpr, PRELOAD_GROUPS: tl.constexpr, PRELOAD_STEPS: tl.constexpr,
    LAUNCH_NEXT_EARLY: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """`fused_moe._decode_down_combine_kernel` with the shared slot, its down rows loaded before the PDL
    wait: the token's top-k is ranked again from `projected` (written two launches back, so complete
    before this kernel launched), and the first PRELOAD_STEPS I-steps of the first PRELOAD_GROUPS expert
    groups (the shared expert's too) are in flight while launch 1 finishes. After the wait, the same tiles,
    products and reductions in the same order as that kernel: the same bits."""
    pdl.launch_next(LAUNCH_NEXT_EARLY, USE_PDL)
    SLOTS = TOP_K + 1  # rows of the intermediate per token (the shared expert's last)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < hidden_size
    offs_i = tl.arange(0, BLOCK_I)
    io_dtype = hidden_ptr.dtype.element_ty

    # ---- before the wait: nothing launch 1 writes (hidden, weights, ids, shared weight) is read here
    # .cg: the logits from L2 (complete and flushed there), never a line an earlier kernel left in L1
    packed, _, _ = _logit_keys(projected_ptr + token * projected_stride_t, NUM_EXPERTS, BLOCK_E, ".cg", False)
    lanes = tl.arange(0, EXPERTS_PER_STEP)
    group_experts = ()  # [EXPERTS_PER_STEP] ids per group, slot order (padding slots: expert 0, masked)
    for first_slot in tl.static_range(0, TOP_K, EXPERTS_PER_STEP):
        experts = tl.zeros([EXPERTS_PER_STEP], dtype=tl.int32)
        for j in tl.static_range(EXPERTS_PER_STEP):
            if first_slot + j < TOP_K:
                chosen, packed = _take_best(packed, BLOCK_E)  # slot first_slot + j: that many rounds
                experts = tl.where(lanes == j, chosen, experts)
        group_experts = group_experts + (experts,)
    shared_w_ptrs = shared_w_ptr + offs_h[:, None] * shared_w_stride_h + offs_i[None, :]
    shared_tiles = ()
    for step in tl.static_range(PRELOAD_STEPS):
        shared_tiles = shared_tiles + (
            _down_tile(shared_w_ptrs, h_mask[:, None], offs_i[None, :], step, BLOCK_I, INTER_SIZE, EVEN_I),
        )
    tiles = ()  # group g's step s at g * PRELOAD_STEPS + s
    for g in tl.static_range(PRELOAD_GROUPS):
        slot_mask = g * EXPERTS_PER_STEP + lanes < TOP_K
        w_ptrs = (
            w_ptr
            + group_experts[g].to(tl.int64)[:, None, None] * w_stride_e
            + offs_h[None, :, None] * w_stride_h
            + offs_i[None, None, :]
        )  # [experts, BLOCK_H, BLOCK_I]
        rows_mask = slot_mask[:, None, None] & h_mask[None, :, None]
        for step in tl.static_range(PRELOAD_STEPS):
            w = _down_tile(w_ptrs, rows_mask, offs_i[None, None, :], step, BLOCK_I, INTER_SIZE, EVEN_I)
            tiles = tiles + (w,)

    pdl.enter_after(LAUNCH_NEXT_EARLY, USE_PDL)

    # ---- after the wait: `_decode_down_combine_kernel`'s arithmetic, its loads of the tiles above skipped;
    # the shared expert's weight is loaded first, with the rest, rather than after the sums
    shared_weight = tl.load(shared_weight_ptr + token * shared_weight_stride_t).to(tl.float32)
    shared_hidden_ptrs = hidden_ptr + (token * SLOTS + TOP_K) * INTER_SIZE + offs_i
    shared_acc = tl.zeros([BLOCK_H, BLOCK_I], dtype=tl.float32)
    for step in tl.static_range(I_STEPS):
        if EVEN_I:
            a = tl.load(shared_hidden_ptrs + step * BLOCK_I)
        else:
            i_mask = offs_i < INTER_SIZE - step * BLOCK_I
            a = tl.load(shared_hidden_ptrs + step * BLOCK_I, mask=i_mask, other=0.0)
        if step < PRELOAD_STEPS:
            w = shared_tiles[step]
        else:
            w = _down_tile(shared_w_ptrs, h_mask[:, None], offs_i[None, :], step, BLOCK_I, INTER_SIZE, EVEN_I)
        shared_acc += w.to(io_dtype).to(tl.float32) * a.to(tl.float32)[None, :]
    shared_out = tl.sum(shared_acc, axis=1).to(io_dtype).to(tl.float32)  # rounded like any expert's

    out = tl.zeros([BLOCK_H], dtype=tl.float32)
    for g in tl.static_range(len(group_experts)):  # fixed order over k: deterministic
        slots = g * EXPERTS_PER_STEP + lanes
        slot_mask = slots < TOP_K
        weight = tl.load(
            weights_ptr + token * weights_stride_t + slots * weights_stride_k, mask=slot_mask, other=0.0
        ).to(tl.float32)
        hidden_ptrs = hidden_ptr + (token * SLOTS + slots)[:, None] * INTER_SIZE + offs_i[None, :]
        w_ptrs = (
            w_ptr
            + group_experts[g].to(tl.int64)[:, None, None] * w_stride_e
            + offs_h[None, :, None] * w_stride_h
            + offs_i[None, None, :]
        )
        rows_mask = slot_mask[:, None, None] & h_mask[None, :, None]
        acc = tl.zeros([EXPERTS_PER_STEP, BLOCK_H, BLOCK_I], dtype=tl.float32)
        for step in tl.static_range(I_STEPS):
            if EVEN_I:
                a = tl.load(hidden_ptrs + step * BLOCK_I, mask=slot_mask[:, None], other=0.0)
            else:
                a_mask = slot_mask[:, None] & (offs_i < INTER_SIZE - step * BLOCK_I)[None, :]
                a = tl.load(hidden_ptrs + step * BLOCK_I, mask=a_mask, other=0.0)
            if g < PRELOAD_GROUPS and step < PRELOAD_STEPS:
                w = tiles[g * PRELOAD_STEPS + step]
            else:
                w = _down_tile(w_ptrs, rows_mask, offs_i[None, None, :], step, BLOCK_I, INTER_SIZE, EVEN_I)
            acc += w.to(io_dtype).to(tl.float32) * a.to(tl.float32)[:, None, :]
        # each expert output rounded to the model dtype, then weighted in fp32 (as the reference does)
        expert_out = tl.sum(acc, axis=2).to(io_dtype).to(tl.float32)  # [experts, BLOCK_H]
        out += tl.sum(weight[:, None] * expert_out, axis=0)
    out += shared_weight * shared_out
    tl.store(out_ptr + token * out_stride_t + offs_h, out.to(out_ptr.dtype.element_ty), mask=h_mask)


def _check(
    x: torch.Tensor,
    projected: torch.Tensor,
    gate_up: torch.Tensor,
    shared_expert_gate: torch.Tensor,
    top_k: int,
) -> None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, H] bf16/fp16/fp32 with a contiguous last dim, got {tuple(x.shape)}")
    tokens, hidden_size = x.shape
    if (
        gate_up.dim() != 3
        or gate_up.shape[2] != hidden_size
        or gate_up.shape[1] % 2
        or gate_up.stride(-1) != 1
    ):
        raise ValueError(
            f"gate_up must be [E, 2I, {hidden_size}] with a contiguous last dim, got {tuple(gate_up.shape)}"
        )
    num_experts, inter_size = gate_up.shape[0], gate_up.shape[1] // 2
    width = num_experts + 2 * inter_size
    if projected.shape != (tokens, width) or projected.dtype != x.dtype or projected.stride(-1) != 1:
        raise ValueError(
            f"projected must be [{tokens}, {width}] (router logits, shared gate, shared up) in {x.dtype}, "
            f"got {tuple(projected.shape)} {projected.dtype}"
        )
    if not 1 <= top_k <= num_experts or num_experts > _MAX_EXPERTS:
        raise ValueError(f"need 1 <= top_k <= E <= {_MAX_EXPERTS}, got top_k={top_k}, E={num_experts}")
    if tokens * top_k > DECODE_MAX_PAIRS:
        raise ValueError(f"the decode MoE block takes T*K <= {DECODE_MAX_PAIRS} pairs, got {tokens}*{top_k}")
    if shared_expert_gate.numel() != hidden_size:
        raise ValueError(
            f"shared_expert_gate must have {hidden_size} values, got {tuple(shared_expert_gate.shape)}"
        )


def routed_gate_up(
    x: torch.Tensor,
    projected: torch.Tensor,
    gate_up: torch.Tensor,
    shared_expert_gate: torch.Tensor,
    top_k: int,
    config: RoutedGateUpConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch 1 of `moe_decode_block` -> (hidden [T*(K+1), I] in x's dtype, row t*(K+1) + slot, the shared
    expert's last; weights [T, K] fp32; expert_ids [T, K] int32; shared_weight [T] fp32)."""
    _check(x, projected, gate_up, shared_expert_gate, top_k)
    tokens, hidden_size = x.shape
    num_experts, inter_size = gate_up.shape[0], gate_up.shape[1] // 2
    config = config or default_gate_up_config(tokens * top_k)
    device = x.device
    hidden = torch.empty((tokens * (top_k + 1), inter_size), dtype=x.dtype, device=device)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=device)
    shared_weight = torch.empty((tokens,), dtype=torch.float32, device=device)
    if tokens == 0:
        return hidden, weights, ids, shared_weight
    gate = shared_expert_gate.reshape(hidden_size)
    gate = gate if gate.stride(0) == 1 else gate.contiguous()
    block_k = min(config.block_k, triton.next_power_of_2(hidden_size))
    grid = (tokens * (top_k + 1), triton.cdiv(inter_size, config.block_n * config.n_loop))
    if schedule.recording:  # the shared expert's gate dot before the wait: x and the bound gate
        schedule.record(
            "moe_decode._routed_gate_up_kernel", early_reads={"x": x, "shared_expert_gate": gate},
            writes={"hidden": hidden, "weights": weights, "ids": ids, "shared_weight": shared_weight},
        )
    _routed_gate_up_kernel[grid](
        x, projected, gate_up, gate, hidden, weights, ids, shared_weight,
        inter_size, x.stride(0), projected.stride(0), gate_up.stride(0), gate_up.stride(1),
        *weights.stride(), *ids.stride(), shared_weight.stride(0),
        NUM_EXPERTS=num_experts, TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_SLOTS=triton.next_power_of_2(top_k), BLOCK_N=config.block_n, N_LOOP=config.n_loop,
        BLOCK_K=block_k,
        K_STEPS=triton.cdiv(hidden_size, block_k), HIDDEN_SIZE=hidden_size,
        EVEN_K=hidden_size % block_k == 0, BLOCK_H=min(_MAX_BLOCK_H, triton.next_power_of_2(hidden_size)),
        NARROW_KEYS=config.narrow_keys and projected.element_size() == 2, num_warps=config.warps,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    return hidden, weights, ids, shared_weight


def _early_down_combine(
    projected: torch.Tensor, hidden: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
    out: torch.Tensor, config: FusedMoeDecodeConfig, shared_down: torch.Tensor, shared_weight: torch.Tensor,
    launch_next_early: bool,
) -> None:  # fmt: skip
    """`decode_down_combine` with the shared slot, its down rows loaded before the PDL wait
    (`_early_down_combine_kernel`): the same out, bit for bit."""
    tokens, hidden_size = out.shape
    num_experts, top_k = down.shape[0], weights.shape[1]
    inter_size = hidden.shape[1]
    block_i = min(config.down_block_i, triton.next_power_of_2(inter_size))
    i_steps = triton.cdiv(inter_size, block_i)
    per_step = min(config.down_experts, triton.next_power_of_2(top_k))
    groups = triton.cdiv(top_k, per_step)
    rows = groups * per_step * down.element_size() + shared_down.element_size()  # bytes per row and column
    per_thread = rows * config.down_block_h * block_i * i_steps // (32 * config.down_warps)
    preload_groups, preload_steps = (groups, i_steps) if per_thread <= _MAX_PRELOAD_BYTES else (1, 1)
    if schedule.recording:  # before the wait: the ranking from the logits, the experts' down rows
        schedule.record(
            "moe_decode._early_down_combine_kernel", launch_next_early=launch_next_early,
            early_reads={"projected": projected, "down": down, "shared_down": shared_down},
            writes={"out": out},
        )  # fmt: skip
    _early_down_combine_kernel[(tokens, triton.cdiv(hidden_size, config.down_block_h))](
        projected, hidden, down, weights, out, shared_down, shared_weight,
        hidden_size, projected.stride(0), down.stride(0), down.stride(1), *weights.stride(), out.stride(0),
        shared_down.stride(0), shared_weight.stride(0),
        NUM_EXPERTS=num_experts, TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_H=config.down_block_h, BLOCK_I=block_i, I_STEPS=i_steps, EXPERTS_PER_STEP=per_step,
        INTER_SIZE=inter_size, EVEN_I=inter_size % block_i == 0, PRELOAD_GROUPS=preload_groups,
        PRELOAD_STEPS=preload_steps, LAUNCH_NEXT_EARLY=launch_next_early, num_warps=config.down_warps,
        maxnreg=EARLY_DOWN_MAXNREG, USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip


def moe_decode_block(
    x: torch.Tensor,
    projected: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    shared_down: torch.Tensor,
    shared_expert_gate: torch.Tensor,
    top_k: int,
    *,
    gate_up_config: RoutedGateUpConfig | None = None,
    down_config: FusedMoeDecodeConfig | None = None,
    early_down: bool | None = None,
    launch_next_early: bool = False,
) -> torch.Tensor:
    """The sparse MoE block of T <= DECODE_MAX_PAIRS / K decode tokens -> [T, H] in x's dtype.

    x [T, H]; projected [T, E + 2I] = x @ [router; shared gate; shared up]^T in x's dtype; gate_up
    [E, 2I, H] and down [E, H, I] (the routed experts, read in x's dtype); shared_down [H, I] (the shared
    expert has the routed experts' width I); shared_expert_gate [1, H] or [H]. x is read before the first
    launch's PDL wait: the kernel that wrote `projected` must have waited for x's writer before letting
    that launch start (our GEMV's `pdl.enter`, or any kernel outside PDL). `REFERENCE.moe_block`'s
    result up to fp32 summation order; two launches, no host sync. The configs default to
    `default_gate_up_config(T*K)` and `fused_moe.default_decode_config(T*K)` (its down tiles). early_down
    picks the down launch: `_early_down_combine` (ranks again and loads its down rows before the PDL wait) or
    `fused_moe.decode_down_combine`; the same result, bit for bit. None: early for T*K <= EARLY_DOWN_MAX_PAIRS
    (measured faster at one token, slower at eight: the module docstring). launch_next_early: the early down
    launch lets the next kernel launch before its own wait (`pdl`; the plain one does not).
    """
    _check(x, projected, gate_up, shared_expert_gate, top_k)  # before anything is launched
    tokens, hidden_size = x.shape
    if down.shape != (gate_up.shape[0], hidden_size, gate_up.shape[1] // 2) or down.stride(-1) != 1:
        raise ValueError(
            f"down must be [E, {hidden_size}, I] with a contiguous last dim, got {tuple(down.shape)}"
        )
    if shared_down.shape != (hidden_size, gate_up.shape[1] // 2) or shared_down.stride(-1) != 1:
        raise ValueError(f"shared_down must be [{hidden_size}, I] contiguous, got {tuple(shared_down.shape)}")
    hidden_states, weights, ids, shared_weight = routed_gate_up(
        x, projected, gate_up, shared_expert_gate, top_k, gate_up_config
    )
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    down_config = down_config or default_decode_config(tokens * top_k)
    if early_down is None:
        early_down = tokens * top_k <= EARLY_DOWN_MAX_PAIRS
    if early_down:
        _early_down_combine(
            projected, hidden_states, down, weights, out, down_config, shared_down, shared_weight,
            launch_next_early,
        )  # fmt: skip
        return out
    decode_down_combine(
        hidden_states,
        down,
        ids,
        weights,
        out,
        down_config,
        shared_down=shared_down,
        shared_weight=shared_weight,
    )
    return out
