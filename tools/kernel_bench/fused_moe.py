"""Time the Triton fused MoE (routed experts) against the reference, at the Qwen3.6-35B-A3B shapes.

    python3 -m tools.kernel_bench.fused_moe [--tokens 1 8 ...] [--config '{"block_m": 16, ...}']
                                            [--decode-config '{"down_experts": 8, ...}']
    python3 -m tools.kernel_bench.fused_moe --sweep [--tokens 1 2 4 8]
    python3 -m tools.kernel_bench.fused_moe --block [--tokens 1 2 4 8]

E=256 experts, top-8, H=2048, I=512, bf16, routing from a random router (distinct experts per token).

Default run: one line per T with the path `fused_moe` picks (decode for T*K <= DECODE_MAX_PAIRS, i.e.
T <= 8, else sorted), its median time (eager, and for T <= 64 also as one CUDA-graph replay, which is what
the decode graph sees: eager time at small T is mostly launch overhead), the bytes it must move (distinct
experts read x 3*H*I*2 + activations) and GB/s, the FLOP (2*T*K*3*H*I) and TFLOP/s, the reference's time
(`moe_experts_gathered` for T <= 8, the per-expert loop `moe_experts` above), and the max relative error
max|fast - ref| / max|ref| against `moe_experts`. Decode rows also give the sorted path's graph time for
comparison. A last line checks every error against the bf16 bound. `--config` (JSON of `FusedMoeConfig`
fields) overrides the sorted path's table config, `--decode-config` (JSON of `FusedMoeDecodeConfig` fields)
the decode path's, for every T. With OUT set, the rows also go to $OUT/fused_moe.json.

MoE block rows (also in the default run; `--block` runs only them): at T in {1, 2, 4, 8} the whole decode MoE
block after the hidden state as the model ran it before `moe_decode` (the model's decode block now:
`tools/kernel_bench/moe_decode.py`; this is still its path for views without stacked rows), each inside one
CUDA graph: new = router GEMM
(E rows) + `moe_route_topk` (routing + shared-expert gate) + `fused_moe(shared=...)` (3 launches after
the GEMM); old = the current torch sequence: stacked GEMM [router | shared gate | shared up], gate GEMV,
`moe_route_logits`, `fused_moe`, swiglu, shared down GEMM and the fp32 combine. Each row gives both graph
times, the speed-up, the routing alone (kernel vs `moe_route_logits`, graphs), bytes (router + distinct
experts + shared expert weights) and GB/s of the new block, whether the ids equal `moe_route_logits`'s,
and the max relative error of the new block against the plain-PyTorch block (moe_experts_fp32 + the
shared SwiGLU, on the kernel's routing). With OUT set, they go to $OUT/fused_moe_block.json.

`--sweep`: for a few decode tile choices (SWEEP) at T in {1, 2, 4, 8}, the graph-replay time of the whole
decode path and of each of its two kernels alone, with their GB/s (weight bytes of the distinct experts
the kernel reads, plus its activations) and the error; then the best choice per T. With OUT set, the rows
go to $OUT/fused_moe_sweep.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import torch.nn.functional as F

from ninfer.ops.mlp import swiglu, swiglu_mlp
from ninfer.ops.moe import moe_experts, moe_experts_fp32, moe_experts_gathered, moe_route_logits
from ninfer.ops.triton.fused_moe import (
    DECODE_MAX_PAIRS,
    FusedMoeDecodeConfig,
    SharedExpert,
    _decode_gate_up,
    decode_down_combine,
    default_config,
    default_decode_config,
    fused_moe,
)
from ninfer.ops.triton.moe_routing import moe_route_topk
from tools.kernel_bench.common import finish, graphed, max_rel_error, time_us

EXPERTS, TOP_K, HIDDEN, INTER = 256, 8, 2048, 512
TOKENS = (1, 2, 4, 8, 64, 512, 2048, 8192)
SWEEP_TOKENS = (1, 2, 4, 8)
BLOCK_TOKENS = (1, 2, 4, 8)
GRAPH_MAX_TOKENS = 64
GATHERED_REF_MAX_TOKENS = 8
DEVICE = "cuda"

# Decode tile choices for --sweep (FusedMoeDecodeConfig overrides; {} is the default). At T=1 (8 pairs):
#   default   gate_up 512 progs x 4 steps of 2x[8, 512];   down 512 progs x 2 steps of [4 experts, 4, 512]
#   fat       gate_up 256 progs x 8 steps of 2x[16, 256];  down 256 progs x 4 steps of [2, 8, 512]
#   thin      gate_up 1024 progs x 2 steps of 2x[4, 1024]; down 1024 progs x 1 step of [8, 2, 512]
#   wide-8w   the default with 8 warps and all 8 experts per down step
#   per-k     2 warps, one expert per down step (the plain k loop), I in two steps
#   one-step  gate_up 2048 progs x 1 step of 2x[2, 2048];  down 2048 progs x 1 step of [8, 1, 512], 2 warps
SWEEP: dict[str, dict[str, int]] = {
    "default": {},
    "fat": {"gate_up_block_n": 16, "gate_up_block_k": 256, "down_block_h": 8, "down_experts": 2},
    "thin": {"gate_up_block_n": 4, "gate_up_block_k": 1024, "down_block_h": 2, "down_experts": 8},
    "wide-8w": {"gate_up_warps": 8, "down_experts": 8, "down_warps": 8},
    "per-k": {
        "gate_up_block_k": 256,
        "gate_up_warps": 2,
        "down_block_i": 256,
        "down_experts": 1,
        "down_warps": 2,
    },  # fmt: skip
    "one-step": {
        "gate_up_block_n": 2,
        "gate_up_block_k": 2048,
        "down_block_h": 1,
        "down_experts": 8,
        "down_warps": 2,
    },  # fmt: skip
}


def _routing(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, HIDDEN, generator=gen, device=DEVICE).to(torch.bfloat16)
    probs = torch.softmax(torch.randn(tokens, EXPERTS, generator=gen, device=DEVICE) * 2.0, dim=-1)
    top, ids = torch.topk(probs, TOP_K, dim=-1)
    return x, (top / top.sum(-1, keepdim=True)).to(torch.bfloat16), ids


def bench(
    tokens: int,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    overrides: dict[str, int],
    decode_overrides: dict[str, int],
    gen: torch.Generator,
) -> dict[str, object]:
    x, weights, ids = _routing(tokens, gen)
    pairs = tokens * TOP_K
    sorted_config = dataclasses.replace(default_config(pairs), **overrides)
    decode = pairs <= DECODE_MAX_PAIRS
    config = (
        dataclasses.replace(default_decode_config(pairs), **decode_overrides) if decode else sorted_config
    )
    out = torch.empty_like(x)

    def fast() -> torch.Tensor:
        return fused_moe(x, gate_up, down, weights, ids, out=out, config=config)

    def sorted_path() -> torch.Tensor:
        return fused_moe(x, gate_up, down, weights, ids, out=out, config=sorted_config)

    error = max_rel_error(fast(), moe_experts(x, weights, ids, gate_up, down))
    eager_us = time_us(fast)
    graph_us = time_us(graphed(fast)) if tokens <= GRAPH_MAX_TOKENS else None
    sorted_graph_us = time_us(graphed(sorted_path)) if decode else None
    if tokens <= GATHERED_REF_MAX_TOKENS:
        ref_name, ref = "gathered", lambda: moe_experts_gathered(x, weights, ids, gate_up, down)
    else:
        ref_name, ref = "loop", lambda: moe_experts(x, weights, ids, gate_up, down)
    ref_us = time_us(ref)

    distinct = int(ids.unique().numel())
    weight_bytes = distinct * 3 * HIDDEN * INTER * 2
    # x and out once; the intermediate [P, I] written and read back (+ the per-pair outputs [P, H] on the
    # sorted path); ids and weights
    activation_bytes = 2 * tokens * HIDDEN * 2 + 2 * pairs * INTER * 2 + pairs * (8 + 2)
    if not decode:
        activation_bytes += 2 * pairs * HIDDEN * 2
    nbytes = weight_bytes + activation_bytes
    flop = 2 * pairs * 3 * HIDDEN * INTER
    best_us = graph_us if graph_us is not None else eager_us
    row = {
        "tokens": tokens,
        "path": "decode" if decode else "sorted",
        "distinct_experts": distinct,
        "config": dataclasses.asdict(config),
        "eager_us": round(eager_us, 2),
        "graph_us": None if graph_us is None else round(graph_us, 2),
        "sorted_graph_us": None if sorted_graph_us is None else round(sorted_graph_us, 2),
        "bytes": nbytes,
        "GB/s": round(nbytes / best_us / 1e3, 1),
        "flop": flop,
        "TFLOP/s": round(flop / best_us / 1e6, 2),
        "ref": ref_name,
        "ref_us": round(ref_us, 2),
        "max_rel_err": error,
    }
    graph_text = f"{graph_us:9.2f}" if graph_us is not None else f"{'-':>9}"
    sorted_text = f"  (sorted path graph {sorted_graph_us:.2f} us)" if sorted_graph_us is not None else ""
    print(
        f"T={tokens:<5} {row['path']:<6} experts {distinct:3d}  "
        f"eager {eager_us:9.2f} us  graph {graph_text} us  "
        f"{nbytes / 1e6:8.1f} MB {row['GB/s']:7.1f} GB/s  "
        f"{flop / 1e9:7.1f} GFLOP {row['TFLOP/s']:6.1f} TFLOP/s  "
        f"ref[{ref_name}] {ref_us:10.2f} us  err {error:.2e}{sorted_text}",
        flush=True,
    )
    return row


def sweep_one(
    name: str, tokens: int, gate_up: torch.Tensor, down: torch.Tensor, gen: torch.Generator
) -> dict[str, object]:
    """Graph-replay times of the decode path with SWEEP[name] at T tokens: whole call and each kernel."""
    config = FusedMoeDecodeConfig(**SWEEP[name])
    x, weights, ids = _routing(tokens, gen)
    pairs = tokens * TOP_K
    out = torch.empty_like(x)
    hidden = torch.empty(pairs, INTER, dtype=x.dtype, device=DEVICE)

    def whole() -> None:
        fused_moe(x, gate_up, down, weights, ids, out=out, config=config)

    def gate_up_only() -> None:
        _decode_gate_up(x, gate_up, ids, hidden, config)

    def down_only() -> None:
        decode_down_combine(hidden, down, ids, weights, out, config)

    whole()
    error = max_rel_error(out, moe_experts(x, weights, ids, gate_up, down))
    whole_us = time_us(graphed(whole))
    gate_up_us = time_us(graphed(gate_up_only))
    down_us = time_us(graphed(down_only))

    distinct = int(ids.unique().numel())
    activations = tokens * HIDDEN * 2 + pairs * INTER * 2  # x or out, and the intermediate
    gate_up_bytes = distinct * 2 * INTER * HIDDEN * 2 + activations  # bf16 gate and up rows
    down_bytes = distinct * HIDDEN * INTER * 2 + activations
    whole_bytes = gate_up_bytes + down_bytes
    row = {
        "name": name,
        "tokens": tokens,
        "distinct_experts": distinct,
        "config": dataclasses.asdict(config),
        "graph_us": round(whole_us, 2),
        "gate_up_us": round(gate_up_us, 2),
        "down_us": round(down_us, 2),
        "GB/s": round(whole_bytes / whole_us / 1e3, 1),
        "gate_up_GB/s": round(gate_up_bytes / gate_up_us / 1e3, 1),
        "down_GB/s": round(down_bytes / down_us / 1e3, 1),
        "max_rel_err": error,
    }
    print(
        f"{name:<9} T={tokens}  experts {distinct:2d}  graph {whole_us:7.2f} us {row['GB/s']:7.1f} GB/s  "
        f"gate_up {gate_up_us:7.2f} us {row['gate_up_GB/s']:7.1f} GB/s  "
        f"down {down_us:7.2f} us {row['down_GB/s']:7.1f} GB/s  err {error:.2e}",
        flush=True,
    )
    return row


def _block_weights(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's layout: stacked [router E | shared gate I | shared up I] x H, shared down [H, I], and
    the shared-expert gate row [1, H]."""
    input_proj = torch.randn(EXPERTS + 2 * INTER, HIDDEN, generator=gen, device=DEVICE) * HIDDEN**-0.5
    shared_down = torch.randn(HIDDEN, INTER, generator=gen, device=DEVICE) * INTER**-0.5
    gate = torch.randn(1, HIDDEN, generator=gen, device=DEVICE) * HIDDEN**-0.5
    return input_proj.bfloat16(), shared_down.bfloat16(), gate.bfloat16()


def bench_block(
    tokens: int,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    block_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    gen: torch.Generator,
) -> dict[str, object]:
    """Graph-replay time of the decode MoE block: routing kernel + fused_moe(shared) vs the torch sequence."""
    input_proj, shared_down, gate = block_weights
    router, shared_gate_up = input_proj[:EXPERTS], input_proj[EXPERTS:]
    x = torch.randn(tokens, HIDDEN, generator=gen, device=DEVICE).bfloat16()
    out = torch.empty_like(x)
    logits = F.linear(x, router)

    def new_block() -> torch.Tensor:
        router_logits = F.linear(x, router)
        weights, ids, shared_weight = moe_route_topk(router_logits, TOP_K, x=x, shared_expert_gate=gate)
        shared = SharedExpert(gate_up=shared_gate_up, down=shared_down, weight=shared_weight)
        return fused_moe(x, gate_up, down, weights, ids, shared=shared, out=out)

    def old_block() -> torch.Tensor:
        router_logits, shared_gate, shared_up = F.linear(x, input_proj).split([EXPERTS, INTER, INTER], dim=-1)
        gate_logit = F.linear(x, gate)
        weights, ids = moe_route_logits(router_logits, TOP_K)
        routed = fused_moe(x, gate_up, down, weights, ids)
        shared_out = F.linear(swiglu(shared_gate, shared_up), shared_down)
        return (routed.float() + torch.sigmoid(gate_logit.float()) * shared_out.float()).to(x.dtype)

    def new_route() -> None:
        moe_route_topk(logits, TOP_K, x=x, shared_expert_gate=gate)

    def old_route() -> None:
        moe_route_logits(logits, TOP_K)
        torch.sigmoid(F.linear(x, gate).float())

    got = new_block().clone()
    weights, ids, shared_weight = moe_route_topk(logits, TOP_K, x=x, shared_expert_gate=gate)
    ids_match = bool(torch.equal(ids.long(), moe_route_logits(logits, TOP_K)[1]))
    # the plain-PyTorch block on the kernel's routing (a tie among bf16 logits may order ids differently)
    shared_mlp = swiglu_mlp(x, shared_gate_up[:INTER], shared_gate_up[INTER:], shared_down).float()
    reference_shared = torch.sigmoid(F.linear(x, gate).float())
    expected = (moe_experts_fp32(x, weights, ids.long(), gate_up, down) + reference_shared * shared_mlp).to(
        x.dtype
    )
    error = max_rel_error(got, expected)
    old_error = max_rel_error(old_block(), expected)

    new_us = time_us(graphed(new_block))
    old_us = time_us(graphed(old_block))
    route_us = time_us(graphed(new_route))
    old_route_us = time_us(graphed(old_route))

    distinct = int(ids.unique().numel())
    weight_bytes = (distinct + 1) * 3 * HIDDEN * INTER * 2 + EXPERTS * HIDDEN * 2 + HIDDEN * 2
    nbytes = weight_bytes + 2 * tokens * HIDDEN * 2
    row = {
        "tokens": tokens,
        "name": "block",
        "distinct_experts": distinct,
        "new_graph_us": round(new_us, 2),
        "old_graph_us": round(old_us, 2),
        "speedup": round(old_us / new_us, 2),
        "route_graph_us": round(route_us, 2),
        "old_route_graph_us": round(old_route_us, 2),
        "bytes": nbytes,
        "GB/s": round(nbytes / new_us / 1e3, 1),
        "ids_match_reference": ids_match,
        "max_rel_err": error,
        "old_max_rel_err": old_error,
    }
    print(
        f"block T={tokens}  experts {distinct:2d}  new {new_us:7.2f} us  old {old_us:7.2f} us  "
        f"x{row['speedup']:.2f}  routing {route_us:6.2f} us (torch {old_route_us:6.2f} us)  "
        f"{nbytes / 1e6:6.1f} MB {row['GB/s']:7.1f} GB/s  ids {'=' if ids_match else '!='} ref  "
        f"err {error:.2e} (old {old_error:.2e})",
        flush=True,
    )
    return row


def _experts(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    return gate_up.mul_(HIDDEN**-0.5), down.mul_(INTER**-0.5)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--config", default="{}", help="JSON of FusedMoeConfig fields (sorted path)")
    parser.add_argument("--decode-config", default="{}", help="JSON of FusedMoeDecodeConfig fields")
    parser.add_argument("--sweep", action="store_true", help="time the SWEEP decode tiles instead")
    parser.add_argument("--block", action="store_true", help="time only the decode MoE block rows")
    args = parser.parse_args()

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    gate_up, down = _experts(gen)
    if args.sweep:
        tokens = args.tokens or list(SWEEP_TOKENS)
        print(f"fused_moe decode sweep  E={EXPERTS} K={TOP_K} H={HIDDEN} I={INTER} bf16", flush=True)
        rows = [sweep_one(name, t, gate_up, down, gen) for name in SWEEP for t in tokens]
        for t in tokens:
            best = min((row for row in rows if row["tokens"] == t), key=lambda row: row["graph_us"])
            print(f"best T={t}: {best['name']} {best['graph_us']:.2f} us  {best['config']}", flush=True)
        finish("fused_moe_sweep", rows)
        return

    if not args.block:
        run_experts(args, gate_up, down, gen)
    print(f"MoE decode block  E={EXPERTS} K={TOP_K} H={HIDDEN} I={INTER} shared I={INTER} bf16", flush=True)
    block_weights = _block_weights(gen)
    block_tokens = (args.tokens if args.block else None) or list(BLOCK_TOKENS)
    finish("fused_moe_block", [bench_block(t, gate_up, down, block_weights, gen) for t in block_tokens])


def run_experts(
    args: argparse.Namespace, gate_up: torch.Tensor, down: torch.Tensor, gen: torch.Generator
) -> None:
    """The default rows: the routed experts alone at every T."""
    overrides, decode_overrides = json.loads(args.config), json.loads(args.decode_config)
    print(
        f"fused_moe  E={EXPERTS} K={TOP_K} H={HIDDEN} I={INTER} bf16  "
        f"decode path up to T*K={DECODE_MAX_PAIRS}  overrides {overrides}  decode {decode_overrides}",
        flush=True,
    )
    rows = [bench(t, gate_up, down, overrides, decode_overrides, gen) for t in args.tokens or list(TOKENS)]
    finish("fused_moe", rows)


if __name__ == "__main__":
    main()
