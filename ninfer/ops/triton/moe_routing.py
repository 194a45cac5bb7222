"""Triton MoE routing: top-k softmax routing of Qwen3.6-35B-A3B and the shared expert's sigmoid gate in one
launch (fast path of `ninfer.ops.moe.moe_route_logits` plus the shared-expert gate).

For every token t, from the router logits [T, E] in the model dtype:

    probs = softmax(float(logits[t]))                  (fp32, over all E experts)
    ids   = the K experts of largest prob, descending   (ties: the lowest expert index first)
    w     = round_to_model_dtype(probs[ids] / sum(probs[ids]))   stored as fp32
    shared_weight[t] = sigmoid(float(round_to_model_dtype(dot(x[t], shared_expert_gate))))  (fp32 dot)

which is `moe_route_logits` (weights rounded to the model dtype as its `.to(logits.dtype)` does, handed
over in fp32 because `fused_moe` reads them in fp32 anyway) and `sigmoid(F.linear(x, w_sg).float())` of
`REFERENCE.moe_block` up to the GEMM's fp32 summation order.

Shape: one program per token. A decode row is E = 256 logits (one register tile) and, with the shared gate,
one H = 2048 dot; the work is tiny, so the point of the kernel is replacing ~8 launches (softmax, top-k,
sum, divide, casts, the gate GEMV and sigmoid) by one, with no host sync and every shape static. Prefill
calls it after the router GEMM (up to a prefill unit of tokens); decode takes `moe_decode`, whose
experts' gate/up programs rank their token's logits themselves in the same order.

Top-k is K rounds of (max, lowest index attaining it, mark taken) over the tile. The ranking uses the fp32
logits rather than the probs: softmax is monotonic, so the order is the probs' order, but it does not
depend on the exp implementation (Triton's exp and torch's may differ by an ulp, which could swap nearly
equal probs). Distinct logits that the reference's fp32 probs merge into a tie (only through underflow or
fp32 logits a few ulps apart) rank by logit here; torch.topk's order among ties is unspecified anyway.
E need not be a power of two (the tile is masked); K <= E.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl, schedule

__all__ = ["moe_route_topk", "output_buffer"]

_MAX_BLOCK_H = 2048  # x / gate columns per step of the shared-gate dot


@triton.jit
def _route_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, x_ptr, gate_ptr, shared_weight_ptr,
    num_experts, logits_stride_t, weights_stride_t, weights_stride_k, ids_stride_t, ids_stride_k,
    x_stride_t, shared_weight_stride_t,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SHARED: tl.constexpr,
    HIDDEN_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    model_dtype = logits_ptr.dtype.element_ty

    logits = tl.load(logits_ptr + token * logits_stride_t + experts, mask=valid, other=0.0).to(tl.float32)
    row_max = tl.max(tl.where(valid, logits, float("-inf")), axis=0)
    exps = tl.where(valid, tl.exp(logits - row_max), 0.0)
    probs = exps / tl.sum(exps, axis=0)

    slots = tl.arange(0, BLOCK_K)
    top_probs = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    candidate = valid
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.where(candidate, logits, float("-inf")), axis=0)
        # the lowest index among the candidates attaining the max: ties go to the lower expert
        chosen = tl.min(tl.where(candidate & (logits == best), experts, BLOCK_E), axis=0)
        chosen_prob = tl.sum(tl.where(experts == chosen, probs, 0.0), axis=0)
        top_probs = tl.where(slots == k, chosen_prob, top_probs)
        top_ids = tl.where(slots == k, chosen, top_ids)
        candidate = candidate & (experts != chosen)

    # renormalised over the top k, then rounded to the model dtype as the reference's `.to(logits.dtype)`
    weights = (top_probs / tl.sum(top_probs, axis=0)).to(model_dtype).to(tl.float32)
    slot_mask = slots < TOP_K
    tl.store(weights_ptr + token * weights_stride_t + slots * weights_stride_k, weights, mask=slot_mask)
    tl.store(ids_ptr + token * ids_stride_t + slots * ids_stride_k, top_ids, mask=slot_mask)

    if HAS_SHARED:
        x_dtype = x_ptr.dtype.element_ty
        cols = tl.arange(0, BLOCK_H)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in tl.static_range(0, HIDDEN_SIZE, BLOCK_H):
            col_mask = cols < HIDDEN_SIZE - start
            xs = tl.load(x_ptr + token * x_stride_t + start + cols, mask=col_mask, other=0.0)
            # the gate row cast to x's dtype first, as the reference's `.to(x.dtype)` does
            gate = tl.load(gate_ptr + start + cols, mask=col_mask, other=0.0).to(x_dtype)
            acc += xs.to(tl.float32) * gate.to(tl.float32)
        # the reference's GEMM output is in x's dtype: round before the fp32 sigmoid
        gate_logit = tl.sum(acc, axis=0).to(x_dtype).to(tl.float32)
        tl.store(shared_weight_ptr + token * shared_weight_stride_t, tl.sigmoid(gate_logit))


def output_buffer(
    name: str, out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``out`` if it is a buffer of that shape, dtype and device (ValueError naming it otherwise), else a
    new one."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"{name} must be {list(shape)} {dtype} on {device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    return out


def moe_route_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    x: torch.Tensor | None = None,
    shared_expert_gate: torch.Tensor | None = None,
    weights_out: torch.Tensor | None = None,
    ids_out: torch.Tensor | None = None,
    shared_weight_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Top-k softmax routing in one launch -> (weights [T, K] fp32, expert_ids [T, K] int32,
    shared_weight [T] fp32 or None).

    router_logits [T, E] bf16/fp16/fp32 (any row stride, contiguous last dim); 1 <= top_k <= E. weights
    are `moe_route_logits`'s (renormalised top-k probs rounded to the logits' dtype), held in fp32; ids in
    descending prob order, ties to the lowest expert index. With x [T, H] and shared_expert_gate [1, H] or
    [H] (both or neither) also shared_weight = sigmoid(round_to_x_dtype(x @ gate)) with an fp32 dot.
    `weights_out`, `ids_out` and `shared_weight_out` may supply the outputs (exact shape and dtype, any
    strides). No host sync; graph-capturable.
    """
    if router_logits.dim() != 2 or router_logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            "router_logits must be [T, E] bf16/fp16/fp32, "
            f"got {tuple(router_logits.shape)} {router_logits.dtype}"
        )
    tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if (x is None) != (shared_expert_gate is None):
        raise ValueError("pass both x and shared_expert_gate, or neither")
    device = router_logits.device
    weights = output_buffer("weights_out", weights_out, (tokens, top_k), torch.float32, device)
    ids = output_buffer("ids_out", ids_out, (tokens, top_k), torch.int32, device)
    has_shared = x is not None
    shared_weight = None
    hidden_size = 1
    if has_shared:
        assert x is not None and shared_expert_gate is not None
        hidden_size = x.shape[-1]
        if x.dim() != 2 or x.shape[0] != tokens or not x.is_floating_point():
            raise ValueError(f"x must be [{tokens}, H] floating point, got {tuple(x.shape)} {x.dtype}")
        if shared_expert_gate.numel() != hidden_size or shared_expert_gate.dim() not in (1, 2):
            raise ValueError(f"shared_expert_gate must be [1, {hidden_size}] or [{hidden_size}]")
        shared_weight = output_buffer(
            "shared_weight_out", shared_weight_out, (tokens,), torch.float32, device
        )
        x = x if x.stride(-1) == 1 else x.contiguous()
        shared_expert_gate = shared_expert_gate.reshape(hidden_size)
        shared_expert_gate = (
            shared_expert_gate if shared_expert_gate.stride(0) == 1 else shared_expert_gate.contiguous()
        )
    elif shared_weight_out is not None:
        raise ValueError("shared_weight_out needs x and shared_expert_gate")
    if tokens == 0:
        return weights, ids, shared_weight

    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    block_h = min(_MAX_BLOCK_H, triton.next_power_of_2(hidden_size))
    # unused pointers when there is no shared gate: any tensor of the right kind (never read)
    shared_args = (x, shared_expert_gate, shared_weight) if has_shared else (logits, logits, weights)
    if schedule.recording:
        schedule.record(
            "moe_routing._route_topk_kernel",
            writes={"weights": weights, "ids": ids, "shared_weight": shared_weight if has_shared else None},
        )
    _route_topk_kernel[(tokens,)](
        logits, weights, ids, *shared_args,
        num_experts, logits.stride(0), *weights.stride(), *ids.stride(),
        x.stride(0) if x is not None else 0, shared_weight.stride(0) if shared_weight is not None else 0,
        TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
        HAS_SHARED=has_shared, HIDDEN_SIZE=hidden_size, BLOCK_H=block_h,
        num_warps=4 if has_shared else 2,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    return weights, ids, shared_weight
