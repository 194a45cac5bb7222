"""MoE router GEMV + top-k softmax routing + the shared expert's sigmoid gate in ONE launch (decode).

For T <= 16 tokens x [T, H], the router [E, H] and optionally the shared expert gate [H], computes

    logits = round_to_x_dtype(x @ router.to(x.dtype)^T)           fp32 accumulation (F.linear's output)
    probs  = softmax(float(logits[t]))                            fp32, over all E experts
    ids    = the K experts of largest logit, descending           ties: the lowest expert index first
    w      = round_to_x_dtype(probs[ids] / sum(probs[ids]))       stored as fp32
    shared_weight[t] = sigmoid(float(round_to_x_dtype(dot(x[t], gate.to(x.dtype)))))   fp32 dot

i.e. `moe_route_topk(F.linear(x, router), K, x=x, shared_expert_gate=gate)` of
`ninfer.ops.triton.moe_routing` (same rounding points, ranking and tie rule; see its docstring), up to
the fp32 summation order of the dots. At decode every MoE layer of Qwen3.6-35B-A3B (E = 256, K = 8,
H = 2048) otherwise runs the router GEMV and the routing kernel as two dependent launches.

Shape of the kernel: a grid of (E / BLOCK_R row blocks) x (SPLIT_K column ranges) GEMV programs plus,
with the shared gate, one program for the gate dot (one more "router row", whose result needs no
routing, so that program writes shared_weight itself and takes no ticket). A GEMV program streams its
[BLOCK_R, H / SPLIT_K] router strip once (evict_first: the weights are read once per step) against all
T tokens, with a [BLOCK_T, BLOCK_R, BLOCK_K] fp32 register accumulator reduced over K once at the end,
and stores its fp32 partial logits in a scratch [SPLIT_K, T, E]. Splitting K as well as E keeps ~128
programs (one wave on the H200's 132 SMs) while each reads x only for its own K range (x is re-read
per row block: bigger row blocks keep that L2 traffic small at T = 8).

The LAST GEMV program to finish routes all tokens at once:

1. each program stores its partials, then ``tl.debug_barrier()`` (bar.sync), then one thread takes a
   ticket: ``atomic_add`` acq_rel at gpu scope on a persistent int32 counter;
2. the program that draws ticket == NUM_GEMV_PROGRAMS - 1 knows every partial is stored. It sums the
   partials in split order (a fixed order: deterministic), rounds them to x's dtype (F.linear's output;
   optionally stored to ``logits_out``), then does the top-k over a [BLOCK_T, BLOCK_E] tile so that the
   reductions of all tokens run together (a per-token loop would serialise T x K reductions);
3. it resets the counter to 0 for the next launch or graph replay.

Memory ordering (PTX memory model): a program's partial stores precede its bar.sync, which orders them
before its ticket thread's atomic, a gpu-scope release (cumulative over what the barrier ordered before
it). The last program's atomic is a gpu-scope acquire that reads the end of the counter's release
sequence (every earlier ticket is an RMW on it), so it synchronises with every other program's release;
Triton hands the ticket value to the CTA's other threads through shared memory behind another bar.sync,
so every partial store is causally before every routing load. Those loads use ``.cg`` (L2 only), so a
stale L1 line cannot be read either. The reset is a plain store: no ticket of this launch is left, and the
next launch on the stream starts after this grid completed (with PDL too: `pdl.enter` waits for the
previous grid's completion and memory flush before any memory access). No program ever waits on another,
so there is no deadlock whatever the residency.

Top-k: K rounds of one int64 max-reduction per token row. Each candidate is packed as
(order-preserving int32 key of its fp32 logit) << 32 | (BLOCK_E - 1 - expert), so the max is the largest
logit and, among equal logits, the lowest expert index (the tie rule of `moe_route_topk`), and the chosen
logit is decoded from the key without another reduction. -0.0 is folded into +0.0 first (they compare
equal, so they must tie). The softmax max is the first round's logit; the chosen probs are
exp(l - max) / sum(exp(logits - max)), the same elementwise ops as the full probs tile. NaN logits are
not supported (the reference's order for them is unspecified anyway).

Limits: T <= MAX_TOKENS (prefill keeps the GEMM + `moe_route_topk` path), E <= MAX_EXPERTS (one register
tile per token row). One counter per device is shared by every call, so calls on one device must be
stream-ordered (the engine runs one stream). Graph capturable: no host sync, grid and launch options
from static shapes; the counter is allocated (zeroed) on the first call, which therefore must not be
inside a CUDA-graph capture (a warm-up call does it; Triton's compilation needs one anyway).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl
from ninfer.ops.triton.moe_routing import output_buffer

__all__ = ["MAX_EXPERTS", "MAX_TOKENS", "RouteGemvConfig", "default_config", "moe_route_gemv"]

MAX_TOKENS = 16  # decode batches; the [BLOCK_T, BLOCK_R, BLOCK_K] accumulator grows with T
MAX_EXPERTS = 512  # the routing tile [BLOCK_T, BLOCK_E] int64 must stay in registers
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TARGET_PROGRAMS = 128  # GEMV programs: about one per SM of the H200 (132), one wave
_MAX_BLOCK_H = 512  # gate-dot columns per step: [BLOCK_T, 512] fp32 is 32 registers a thread at T = 8

_TICKET_COUNTERS: dict[torch.device, torch.Tensor] = {}


@dataclasses.dataclass(frozen=True)
class RouteGemvConfig:
    """Tiles of one launch: block_rows router rows (experts) per program, split_k programs along H (capped
    so that no split is empty), block_k H elements per accumulator step, num_warps for every program
    (the last one's routing tile included)."""

    block_rows: int = 16
    split_k: int = 8
    block_k: int = 64
    num_warps: int = 4

    def check(self) -> None:
        for name in ("block_rows", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


@functools.cache  # called per launch: keep the Python overhead off the decode path
def default_config(tokens: int, num_experts: int, hidden: int) -> RouteGemvConfig:
    """16 rows per program; H split so that there are ~_TARGET_PROGRAMS programs with >= 4 steps each
    (35B-A3B: 16 row blocks x 8 splits of 256 columns); a smaller K step above 8 tokens."""
    block_rows = min(16, triton.next_power_of_2(num_experts))
    block_k = min(64 if tokens <= 8 else 32, triton.next_power_of_2(hidden))
    row_blocks = triton.cdiv(num_experts, block_rows)
    split_k = max(1, min(triton.cdiv(_TARGET_PROGRAMS, row_blocks), hidden // (4 * block_k)))
    return RouteGemvConfig(block_rows=block_rows, split_k=split_k, block_k=block_k, num_warps=4)


def _ticket_counter(device: torch.device) -> torch.Tensor:
    """The device's persistent int32 ticket counter ([1], zero between launches), allocated once."""
    counter = _TICKET_COUNTERS.get(device)
    if counter is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a counter allocated (and zeroed) inside a capture would only be zeroed at replay
            raise RuntimeError(
                "moe_route_gemv allocates its ticket counter on first use: call it once outside "
                "CUDA-graph capture (a warm-up call) before capturing it"
            )
        counter = torch.zeros(1, dtype=torch.int32, device=device)
        _TICKET_COUNTERS[device] = counter
    return counter


@triton.jit
def _gemv_partials(
    x_ptr, router_ptr, partial_ptr, pid, num_tokens, x_stride_t, router_stride_e,
    NUM_EXPERTS: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """One program's fp32 partial logits [T, BLOCK_R] over its K range, stored to the split's scratch."""
    row_block = pid // SPLIT_K
    split = pid % SPLIT_K
    x_dtype = x_ptr.dtype.element_ty
    tokens = tl.arange(0, BLOCK_T)
    rows = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    token_mask = tokens < num_tokens
    row_mask = rows < NUM_EXPERTS
    x_rows = x_ptr + tokens[:, None] * x_stride_t
    w_rows = router_ptr + rows.to(tl.int64)[:, None] * router_stride_e
    k_begin = split * (K_STEPS * BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_R, BLOCK_K], dtype=tl.float32)
    for step in tl.static_range(K_STEPS):  # unrolled: every step's loads can be in flight together
        ks = k_begin + step * BLOCK_K + offs_k
        if EVEN_K:  # no K mask: the masks stay constant along K, so the loads keep their 16-byte vectors
            w_mask = row_mask[:, None]
            x_mask = token_mask[:, None]
        else:
            k_mask = ks < HIDDEN
            w_mask = row_mask[:, None] & k_mask[None, :]
            x_mask = token_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        xs = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
        # the router cast to x's dtype first, as the reference's `router.to(x.dtype)` does
        acc += xs.to(tl.float32)[:, None, :] * w.to(x_dtype).to(tl.float32)[None, :, :]
    partial = tl.sum(acc, axis=2)
    out = partial_ptr + (split * num_tokens + tokens[:, None]) * NUM_EXPERTS + rows[None, :]
    tl.store(out, partial, mask=token_mask[:, None] & row_mask[None, :])


@triton.jit
def _route_tokens(
    x_ptr, partial_ptr, weights_ptr, ids_ptr, logits_ptr, num_tokens,
    weights_stride_t, weights_stride_k, ids_stride_t, ids_stride_k, logits_stride_t, logits_stride_e,
    NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_SLOTS: tl.constexpr, SPLIT_K: tl.constexpr, HAS_LOGITS_OUT: tl.constexpr,
):  # fmt: skip
    """The last program: logits from the partials, then softmax / top-k / renormalise for every token."""
    model_dtype = x_ptr.dtype.element_ty
    tokens = tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    token_mask = tokens < num_tokens
    valid = token_mask[:, None] & (experts < NUM_EXPERTS)[None, :]

    partials = partial_ptr + tokens[:, None] * NUM_EXPERTS + experts[None, :]
    summed = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):  # split order: the same logits on every run
        summed += tl.load(
            partials + split * num_tokens * NUM_EXPERTS, mask=valid, other=0.0, cache_modifier=".cg"
        )
    rounded = summed.to(model_dtype)  # F.linear's output dtype: the reference ranks these values
    if HAS_LOGITS_OUT:
        out = logits_ptr + tokens[:, None] * logits_stride_t + experts[None, :] * logits_stride_e
        tl.store(out, rounded, mask=valid)
    logits = rounded.to(tl.float32)
    logits = tl.where(logits == 0.0, 0.0, logits)  # -0.0 == +0.0 must tie, so they need one key

    # order-preserving int32 key of an fp32: flip the magnitude bits of negatives (an involution)
    bits = logits.to(tl.int32, bitcast=True)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    packed = (keys.to(tl.int64) << 32) + (BLOCK_E - 1 - experts).to(tl.int64)[None, :]
    taken = tl.full([BLOCK_T, BLOCK_E], -(2**63), tl.int64)  # below every non-NaN logit's packed value
    packed = tl.where(valid, packed, taken)

    slots = tl.arange(0, BLOCK_SLOTS)
    top_logits = tl.zeros([BLOCK_T, BLOCK_SLOTS], dtype=tl.float32)
    top_ids = tl.zeros([BLOCK_T, BLOCK_SLOTS], dtype=tl.int32)
    row_max = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(packed, axis=1)  # the largest logit; among equal ones the lowest expert
        best_key = best >> 32
        chosen = (BLOCK_E - 1 - (best - (best_key << 32))).to(tl.int32)
        key32 = best_key.to(tl.int32)
        chosen_logit = (key32 ^ ((key32 >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        if k == 0:
            row_max = chosen_logit
        top_logits = tl.where(slots[None, :] == k, chosen_logit[:, None], top_logits)
        top_ids = tl.where(slots[None, :] == k, chosen[:, None], top_ids)
        packed = tl.where(experts[None, :] == chosen[:, None], taken, packed)

    # padding token rows chose nothing (their decoded logit is a NaN): keep their arithmetic finite
    row_max = tl.where(token_mask, row_max, 0.0)
    exps = tl.where(valid, tl.exp(logits - row_max[:, None]), 0.0)
    denominators = tl.where(token_mask, tl.sum(exps, axis=1), 1.0)
    slot_mask = slots < TOP_K
    live = token_mask[:, None] & slot_mask[None, :]
    top_probs = tl.where(live, tl.exp(top_logits - row_max[:, None]) / denominators[:, None], 0.0)
    # renormalised over the top k, then rounded to the model dtype as the reference's `.to(logits.dtype)`
    top_sums = tl.where(token_mask, tl.sum(top_probs, axis=1), 1.0)
    weights = (top_probs / top_sums[:, None]).to(model_dtype).to(tl.float32)
    tl.store(
        weights_ptr + tokens[:, None] * weights_stride_t + slots[None, :] * weights_stride_k,
        weights,
        mask=live,
    )
    tl.store(ids_ptr + tokens[:, None] * ids_stride_t + slots[None, :] * ids_stride_k, top_ids, mask=live)


@triton.jit
def _shared_gate(
    x_ptr, gate_ptr, shared_weight_ptr, num_tokens, x_stride_t, shared_weight_stride_t,
    HIDDEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """shared_weight = sigmoid(round_to_x_dtype(x . gate)) for every token (the extra program)."""
    x_dtype = x_ptr.dtype.element_ty
    tokens = tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    cols = tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for start in tl.static_range(0, HIDDEN, BLOCK_H):
        col_mask = cols < HIDDEN - start
        xs = tl.load(
            x_ptr + tokens[:, None] * x_stride_t + start + cols[None, :],
            mask=token_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        # the gate row cast to x's dtype first, as the reference's `.to(x.dtype)` does
        gate = tl.load(gate_ptr + start + cols, mask=col_mask, other=0.0).to(x_dtype)
        acc += xs.to(tl.float32) * gate.to(tl.float32)[None, :]
    # the reference's GEMM output is in x's dtype: round before the fp32 sigmoid
    gate_logit = tl.sum(acc, axis=1).to(x_dtype).to(tl.float32)
    tl.store(shared_weight_ptr + tokens * shared_weight_stride_t, tl.sigmoid(gate_logit), mask=token_mask)


@triton.jit
def _route_gemv_kernel(
    x_ptr, router_ptr, gate_ptr, partial_ptr, counter_ptr,
    weights_ptr, ids_ptr, shared_weight_ptr, logits_ptr,
    num_tokens, x_stride_t, router_stride_e, weights_stride_t, weights_stride_k, ids_stride_t, ids_stride_k,
    shared_weight_stride_t, logits_stride_t, logits_stride_e,
    NUM_EXPERTS: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, NUM_GEMV_PROGRAMS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
    BLOCK_H: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_LOGITS_OUT: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    pid = tl.program_id(0)
    if pid < NUM_GEMV_PROGRAMS:
        _gemv_partials(
            x_ptr, router_ptr, partial_ptr, pid, num_tokens, x_stride_t, router_stride_e,
            NUM_EXPERTS, HIDDEN, BLOCK_T, BLOCK_R, BLOCK_K, K_STEPS, SPLIT_K, EVEN_K,
        )  # fmt: skip
        # all of this CTA's partial stores before its ticket (see the module docstring for the ordering)
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == NUM_GEMV_PROGRAMS - 1:  # every other program's partials are stored and visible
            _route_tokens(
                x_ptr, partial_ptr, weights_ptr, ids_ptr, logits_ptr, num_tokens,
                weights_stride_t, weights_stride_k, ids_stride_t, ids_stride_k, logits_stride_t,
                logits_stride_e, NUM_EXPERTS, TOP_K, BLOCK_T, BLOCK_E, BLOCK_SLOTS, SPLIT_K, HAS_LOGITS_OUT,
            )  # fmt: skip
            tl.store(counter_ptr, 0)  # every ticket is taken: ready for the next launch / graph replay
    else:
        if HAS_SHARED:  # the one extra program: the gate is one more router row that needs no routing
            _shared_gate(
                x_ptr, gate_ptr, shared_weight_ptr, num_tokens, x_stride_t, shared_weight_stride_t,
                HIDDEN, BLOCK_T, BLOCK_H,
            )  # fmt: skip


def moe_route_gemv(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    *,
    shared_expert_gate: torch.Tensor | None = None,
    weights_out: torch.Tensor | None = None,
    ids_out: torch.Tensor | None = None,
    shared_weight_out: torch.Tensor | None = None,
    logits_out: torch.Tensor | None = None,
    config: RouteGemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Router GEMV + top-k softmax routing (+ shared gate) in one launch -> (weights [T, K] fp32,
    expert_ids [T, K] int32, shared_weight [T] fp32 or None).

    x [T, H] bf16/fp16/fp32 with T <= MAX_TOKENS (T = 0 returns empty outputs; any row stride,
    unit stride along H); router [E, H] any float dtype, cast to x's dtype as the reference does, with a
    unit stride along H (a row block of a stacked projection is fine), E <= MAX_EXPERTS; 1 <= top_k <= E.
    Results are `moe_route_topk(F.linear(x, router.to(x.dtype)), top_k, x=x, shared_expert_gate=...)`'s
    up to the dots' fp32 summation order. shared_expert_gate [1, H] or [H]: also shared_weight.
    `weights_out`, `ids_out`, `shared_weight_out` may supply the outputs (exact shape and dtype, any
    strides); `logits_out` [T, E] in x's dtype, if given, receives the rounded router logits. `config`
    overrides `default_config(T, E, H)`. No host sync; graph-capturable after one call outside capture.
    """
    if x.dim() != 2 or x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"x must be [T, H] bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
    tokens, hidden = x.shape
    if tokens > MAX_TOKENS:
        raise ValueError(
            f"moe_route_gemv takes at most {MAX_TOKENS} tokens, got {tokens} (prefill: GEMM + moe_route_topk)"
        )
    if router.dim() != 2 or router.shape[1] != hidden or not router.is_floating_point():
        raise ValueError(
            f"router must be [E, {hidden}] floating point, got {tuple(router.shape)} {router.dtype}"
        )
    num_experts = router.shape[0]
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"router must have 1..{MAX_EXPERTS} rows (experts), got {num_experts}")
    if hidden > 1 and router.stride(1) != 1:
        raise ValueError("router must have a unit stride along H (row-major)")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    device = x.device
    if router.device != device:
        raise ValueError(f"router is on {router.device}, x on {device}")
    weights = output_buffer("weights_out", weights_out, (tokens, top_k), torch.float32, device)
    ids = output_buffer("ids_out", ids_out, (tokens, top_k), torch.int32, device)
    if logits_out is not None:
        output_buffer("logits_out", logits_out, (tokens, num_experts), x.dtype, device)
    has_shared = shared_expert_gate is not None
    shared_weight = None
    if shared_expert_gate is not None:
        if (
            shared_expert_gate.numel() != hidden
            or shared_expert_gate.dim() not in (1, 2)
            or not shared_expert_gate.is_floating_point()
        ):
            raise ValueError(
                f"shared_expert_gate must be [1, {hidden}] or [{hidden}] floating point, "
                f"got {tuple(shared_expert_gate.shape)}"
            )
        shared_weight = output_buffer(
            "shared_weight_out", shared_weight_out, (tokens,), torch.float32, device
        )
        shared_expert_gate = shared_expert_gate.reshape(hidden)
        if shared_expert_gate.stride(0) != 1:
            shared_expert_gate = shared_expert_gate.contiguous()
    elif shared_weight_out is not None:
        raise ValueError("shared_weight_out needs shared_expert_gate")
    if tokens == 0:
        return weights, ids, shared_weight
    if hidden == 0:
        raise ValueError("x must have H >= 1 columns")
    if x.stride(1) != 1:
        x = x.contiguous()

    config = config or default_config(tokens, num_experts, hidden)
    config.check()
    # K ranges are whole steps; splits that would start past H are dropped (the count stays static)
    k_per_split = triton.cdiv(triton.cdiv(hidden, config.split_k), config.block_k) * config.block_k
    split_k = triton.cdiv(hidden, k_per_split)
    num_gemv_programs = triton.cdiv(num_experts, config.block_rows) * split_k
    block_t = triton.next_power_of_2(tokens)
    partials = torch.empty((split_k, tokens, num_experts), dtype=torch.float32, device=device)
    counter = _ticket_counter(device)
    # unused pointers (never read or written): any tensor of the right kind
    gate = shared_expert_gate if shared_expert_gate is not None else x
    shared = shared_weight if shared_weight is not None else weights
    logits = logits_out if logits_out is not None else x
    _route_gemv_kernel[(num_gemv_programs + int(has_shared),)](
        x, router, gate, partials, counter, weights, ids, shared, logits,
        tokens, x.stride(0), router.stride(0), *weights.stride(), *ids.stride(),
        shared.stride(0), logits.stride(0), logits.stride(1),
        NUM_EXPERTS=num_experts, HIDDEN=hidden, TOP_K=top_k, BLOCK_T=block_t,
        BLOCK_R=config.block_rows, BLOCK_K=config.block_k, K_STEPS=k_per_split // config.block_k,
        SPLIT_K=split_k, EVEN_K=hidden % k_per_split == 0, NUM_GEMV_PROGRAMS=num_gemv_programs,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_SLOTS=triton.next_power_of_2(top_k),
        BLOCK_H=min(_MAX_BLOCK_H // max(1, block_t // 8), triton.next_power_of_2(hidden)),
        HAS_SHARED=has_shared, HAS_LOGITS_OUT=logits_out is not None,
        num_warps=config.num_warps,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    return weights, ids, shared_weight
