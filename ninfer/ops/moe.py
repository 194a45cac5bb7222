"""Reference sparse MoE block of Qwen3.6-35B-A3B (HF `Qwen3_5MoeSparseMoeBlock` semantics).

Routing: fp32 softmax over all experts, top-k, renormalised to sum 1, weights cast to the model dtype.
Experts are fused SwiGLUs: gate_up [E, 2I, H] (rows [0:I] gate, [I:2I] up) and down [E, H, I].
The reference loops over the experts that were hit (host sync; a fast kernel aligns on device) and
accumulates the weighted expert outputs in fp32.

The whole block from its weights (the fast op table's entry), reference and fast side by side:
`moe_mlp` (`moe_block`, its input projections one GEMM when the binder stacked them) and `fast_moe_mlp`:
at decode (up to `fused_moe.DECODE_MAX_PAIRS` token x expert pairs, stacked rows, a shared expert as wide
as the routed ones) the stacked input GEMV (router logits and the shared expert's gate and up), then
`ninfer.ops.triton.moe_decode.moe_decode_block`'s two launches; otherwise the router GEMM, the routing
kernel (`moe_routing.moe_route_topk`) and `fused_moe` with the shared expert as one more weighted slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ninfer.ops.linear import fast_linear
from ninfer.ops.mlp import swiglu
from ninfer.ops.pdl_policy import pdl_policy

__all__ = [
    "moe_route",
    "moe_route_logits",
    "moe_experts",
    "moe_experts_fp32",
    "moe_block",
    "moe_block_from_projections",
    "MoeMlpWeights",
    "moe_mlp",
    "fast_moe_mlp",
]


def moe_route(x: torch.Tensor, router_w: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax router: x [N, H], router_w [E, H] -> (weights [N, k] x.dtype, expert_ids [N, k] long).

    Logits are formed in the model dtype as HF does (so ties break identically), softmax in fp32.
    """
    return moe_route_logits(F.linear(x, router_w.to(x.dtype)), top_k)


def moe_route_logits(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route` from router logits [N, E] in the model dtype -> (weights [N, k], expert_ids [N, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_probs, expert_ids = torch.topk(probs, top_k, dim=-1)
    top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
    return top_probs.to(logits.dtype), expert_ids


def _moe_experts_fp32(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Weighted sum of the routed experts' outputs, accumulated in fp32: [N, H] fp32."""
    dtype = x.dtype
    intermediate = down.shape[-1]
    out = x.new_zeros(x.shape, dtype=torch.float32)
    for expert in torch.unique(expert_ids).tolist():
        token_idx, slot = torch.where(expert_ids == expert)
        projected = F.linear(x[token_idx], gate_up[expert].to(dtype))
        hidden = swiglu(projected[:, :intermediate], projected[:, intermediate:])
        expert_out = F.linear(hidden, down[expert].to(dtype))
        out = out.index_add(0, token_idx, expert_out.float() * weights[token_idx, slot, None].float())
    return out


def moe_experts_gathered(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """`moe_experts` with every shape static and no host sync (graph-capturable decode path).

    Gathers each token's k experts' weights ([N, k, 2I, H]): memory grows with N, so it serves the
    few-token decode unit; prefill keeps the per-expert loop.
    """
    intermediate = down.shape[-1]
    projected = torch.einsum("nh,nkih->nki", x, gate_up[expert_ids].to(x.dtype))
    hidden = swiglu(projected[..., :intermediate], projected[..., intermediate:])
    expert_out = torch.einsum("nki,nkhi->nkh", hidden.to(x.dtype), down[expert_ids].to(x.dtype))
    return (expert_out.float() * weights.float().unsqueeze(-1)).sum(dim=1)


def moe_experts_fp32(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    graph_safe: bool = False,
) -> torch.Tensor:
    """The routed experts' weighted sum in fp32 [N, H]: the per-expert loop, or with ``graph_safe`` the
    gathered path (static shapes, no host sync) for few-token decode units."""
    experts = moe_experts_gathered if graph_safe else _moe_experts_fp32
    return experts(x, weights, expert_ids, gate_up, down)


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """sum_k weights[n, k] * expert_{ids[n, k]}(x[n]) -> [N, H] in x's dtype."""
    return _moe_experts_fp32(x, weights, expert_ids, gate_up, down).to(x.dtype)


def moe_block(
    x: torch.Tensor,
    router_w: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    shared_gate_w: torch.Tensor,
    shared_up_w: torch.Tensor,
    shared_down_w: torch.Tensor,
    shared_expert_gate_w: torch.Tensor,
    top_k: int,
    graph_safe: bool = False,
) -> torch.Tensor:
    """Routed experts + sigmoid(x @ shared_expert_gate_w.T) * shared SwiGLU expert: x [N, H] -> [N, H].

    ``graph_safe`` uses the gathered expert path (no host sync) for few-token decode units.
    """
    dtype = x.dtype
    return moe_block_from_projections(
        x,
        F.linear(x, router_w.to(dtype)),
        F.linear(x, shared_gate_w.to(dtype)),
        F.linear(x, shared_up_w.to(dtype)),
        gate_up,
        down,
        shared_down_w,
        shared_expert_gate_w,
        top_k,
        graph_safe,
    )


def moe_block_from_projections(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    shared_gate: torch.Tensor,
    shared_up: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    shared_down_w: torch.Tensor,
    shared_expert_gate_w: torch.Tensor,
    top_k: int,
    graph_safe: bool = False,
) -> torch.Tensor:
    """`moe_block` once the input's projections are done (the model may run them as one stacked GEMM):
    router_logits [N, E], shared_gate / shared_up [N, S] in x's dtype."""
    weights, expert_ids = moe_route_logits(router_logits, top_k)
    routed = moe_experts_fp32(x, weights, expert_ids, gate_up, down, graph_safe)
    shared = F.linear(swiglu(shared_gate, shared_up), shared_down_w.to(x.dtype))
    shared_gate_weight = torch.sigmoid(F.linear(x, shared_expert_gate_w.to(x.dtype)).float())
    return (routed + shared_gate_weight * shared.float()).to(x.dtype)


# ---- the block from its weights -------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MoeMlpWeights:
    """Routed experts (gate_up [E, 2I, H] with rows [0:I] gate, [I:2I] up; down [E, H, I]) plus a
    sigmoid-gated shared SwiGLU expert of width S."""

    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor
    down: torch.Tensor
    shared_gate_proj: torch.Tensor  # [S, H]
    shared_up_proj: torch.Tensor  # [S, H]
    shared_down_proj: torch.Tensor  # [H, S]
    shared_expert_gate: torch.Tensor  # [1, H]
    input_proj: torch.Tensor | None = None  # [router; shared_gate_proj; shared_up_proj] when stacked


def moe_mlp(w: MoeMlpWeights, x: torch.Tensor, top_k: int, decode: bool) -> torch.Tensor:
    """HF `Qwen3_5MoeSparseMoeBlock` (`moe_block`), its input projections one GEMM when stacked: x [N, H]
    -> [N, H]; decode: a few tokens inside a CUDA graph (the gathered experts, no host sync)."""
    num_experts, shared = w.router.shape[0], w.shared_gate_proj.shape[0]
    if w.input_proj is None:
        return moe_block(
            x, w.router, w.gate_up, w.down, w.shared_gate_proj, w.shared_up_proj, w.shared_down_proj,
            w.shared_expert_gate, top_k, decode,
        )  # fmt: skip
    router_logits, gate, up = F.linear(x, w.input_proj).split([num_experts, shared, shared], dim=-1)
    return moe_block_from_projections(
        x, router_logits, gate, up, w.gate_up, w.down, w.shared_down_proj, w.shared_expert_gate, top_k,
        decode,
    )  # fmt: skip


def fast_moe_mlp(w: MoeMlpWeights, x: torch.Tensor, top_k: int, decode: bool) -> torch.Tensor:
    """`moe_mlp` (module docstring): decode in the stacked GEMV and two launches, else the router GEMM,
    the routing kernel and `fused_moe` (a shared expert wider than the routed ones takes its sorted
    path, which computes it apart)."""
    from ninfer.ops.triton.fused_moe import DECODE_MAX_PAIRS, SharedExpert, default_config, fused_moe
    from ninfer.ops.triton.moe_decode import moe_decode_block
    from ninfer.ops.triton.moe_routing import moe_route_topk

    num_experts = w.router.shape[0]
    same_width = w.shared_down_proj.shape[1] == w.gate_up.shape[1] // 2
    decode_sized = decode and x.shape[0] * top_k <= DECODE_MAX_PAIRS
    if decode_sized and w.input_proj is not None and same_width:
        projected = fast_linear(x, w.input_proj)
        return moe_decode_block(
            x, projected, w.gate_up, w.down, w.shared_down_proj, w.shared_expert_gate, top_k,
            launch_next_early=pdl_policy(x.shape[0]).launch_next_early,
        )  # fmt: skip
    if w.input_proj is not None:  # rows [router; shared gate; shared up]: the shared gate_up is a slice
        router, shared_gate_up = w.input_proj[:num_experts], w.input_proj[num_experts:]
    else:
        router, shared_gate_up = w.router.to(x.dtype), torch.cat([w.shared_gate_proj, w.shared_up_proj])
    bound_router = w.input_proj is not None or w.router.dtype == x.dtype  # else a cast made just before
    weights, expert_ids, shared_weight = moe_route_topk(
        fast_linear(x, router, static_weight=bound_router),
        top_k,
        x=x,
        shared_expert_gate=w.shared_expert_gate,
    )
    assert shared_weight is not None
    shared = SharedExpert(gate_up=shared_gate_up, down=w.shared_down_proj, weight=shared_weight)
    # fused_moe's decode path runs the shared expert as one more slot of equal width; a wider one takes
    # the sorted path, which computes it apart
    config = None if same_width else default_config(weights.numel())
    return fused_moe(x, w.gate_up, w.down, weights, expert_ids, shared=shared, config=config)
