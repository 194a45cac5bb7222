"""Time the decode MoE block (`ninfer.ops.triton.moe_decode`) at the Qwen3.6-35B-A3B shapes, and sweep its
gate/up tiles.

    python3 -m tools.kernel_bench.moe_decode [--tokens 1 8] [--profile]

E=256 experts, top-8, H=2048, I=512, bf16, random weights and inputs. For each T, each line is the graph
replay (L2 flushed between replays, so the weights come from HBM) of the block after the layer's hidden
state, as the model runs it:

- `old`: the router GEMV, `moe_route_topk` (routing + shared gate), then `fused_moe` with the shared
  expert's gate/up rows as one more slot (the fallback for views without the stacked rows; the path
  before `moe_decode` ran the GEMV and the routing as one ticket-counter launch, 32.8 us at T = 1);
- `new <tiles>`: the stacked input GEMV (`ops.linear.fast_linear` over [router; shared gate; shared up]) then
  `moe_decode_block` with those `RoutedGateUpConfig` tiles (block_n, block_k, n_loop, warps) and the
  default down tiles.

Then the best tiles per T. With OUT set, the rows go to $OUT/moe_decode_sweep.json.

``--profile`` (run with NINFER_PDL=0) prints each launch's own time instead, with the default tiles, for
three routings (`_routing_logits`): whether experts shared by tokens cost their bytes once or per token.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch

from ninfer.ops.linear import fast_linear
from ninfer.ops.triton.fused_moe import SharedExpert, fused_moe
from ninfer.ops.triton.moe_decode import RoutedGateUpConfig, default_gate_up_config, moe_decode_block
from ninfer.ops.triton.moe_routing import moe_route_topk
from tools.kernel_bench.common import finish, graphed, time_us

EXPERTS, TOP_K, HIDDEN, INTER = 256, 8, 2048, 512
DEVICE, BF16 = "cuda", torch.bfloat16
# (block_n, block_k, n_loop, warps)
SWEEP = [
    (2, 2048, 1, 4),
    (2, 2048, 2, 4),
    (2, 2048, 4, 4),
    (2, 2048, 8, 4),
    (2, 1024, 2, 2),
    (4, 1024, 1, 4),
    (4, 1024, 2, 4),
    (4, 1024, 4, 4),
    (4, 2048, 1, 8),
    (4, 2048, 2, 8),
    (8, 512, 1, 4),
    (8, 512, 2, 4),
    (8, 512, 4, 4),
    (8, 1024, 1, 8),
    (8, 1024, 2, 8),
    (16, 256, 1, 4),
    (16, 256, 2, 4),
    (16, 512, 1, 8),
    (32, 256, 1, 8),
]


def _routing_logits(natural: torch.Tensor, pattern: str) -> torch.Tensor:
    """Router logits [T, E] for a routing pattern: `natural` (the GEMV's), `disjoint` (token t routes to
    experts 8t..8t+7: no expert shared) or `same` (every token to experts 0..7)."""
    if pattern == "natural":
        return natural
    logits = natural.clone()
    for t in range(logits.shape[0]):
        first = (TOP_K * t) % EXPERTS if pattern == "disjoint" else 0
        logits[t, first : first + TOP_K] += 100.0
    return logits


def profile_launches(tokens: int, weights: dict[str, torch.Tensor]) -> None:
    """Each launch's own time (`tools.profile_step.profile`; with NINFER_PDL=0 no kernel waits inside its
    launch) over 20 graph replays of `moe_decode_block` after the stacked GEMV, L2 flushed before each
    replay, per routing pattern."""
    from tools.profile_step import profile

    x = torch.randn(tokens, HIDDEN, device=DEVICE).to(BF16)
    natural = fast_linear(x, weights["input_proj"])
    flush = torch.empty(1 << 28, dtype=torch.int8, device=DEVICE)
    for pattern in ("natural", "disjoint", "same"):
        projected = natural.clone()
        projected[:, :EXPERTS] = _routing_logits(natural[:, :EXPERTS], pattern)

        def block(projected: torch.Tensor = projected) -> torch.Tensor:
            return moe_decode_block(
                x, projected, weights["gate_up"], weights["down"], weights["shared_down"],
                weights["shared_gate"], TOP_K,
            )  # fmt: skip

        replay = graphed(block)

        def flushed_replay(replay: Callable[[], None] = replay) -> None:
            flush.zero_()
            replay()

        for name, us in profile(flushed_replay, steps=20)["top"]:
            if "elementwise" not in name:  # not the flush
                print(f"T={tokens} {pattern:8s} {name[:40]:40s} {us:8.2f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--profile", action="store_true", help="each launch's time (run with NINFER_PDL=0)")
    args = parser.parse_args()
    torch.manual_seed(0)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, device=DEVICE) * scale).to(BF16)

    input_proj = randn(EXPERTS + 2 * INTER, HIDDEN, scale=HIDDEN**-0.5)
    gate_up = randn(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5)
    down = randn(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5)
    shared_down = randn(HIDDEN, INTER, scale=INTER**-0.5)
    shared_gate = randn(1, HIDDEN, scale=HIDDEN**-0.5)
    if args.profile:
        weights = {"input_proj": input_proj, "gate_up": gate_up, "down": down, "shared_down": shared_down,
                   "shared_gate": shared_gate}  # fmt: skip
        for tokens in args.tokens:
            profile_launches(tokens, weights)
        return
    rows = []
    for tokens in args.tokens:
        x = randn(tokens, HIDDEN, scale=1.0)

        def old(x: torch.Tensor = x) -> torch.Tensor:
            logits = fast_linear(x, input_proj[:EXPERTS])
            weights, ids, shared_weight = moe_route_topk(logits, TOP_K, x=x, shared_expert_gate=shared_gate)
            shared = SharedExpert(gate_up=input_proj[EXPERTS:], down=shared_down, weight=shared_weight)
            return fused_moe(x, gate_up, down, weights, ids, shared=shared)

        def new(config: RoutedGateUpConfig, x: torch.Tensor = x) -> torch.Tensor:
            projected = fast_linear(x, input_proj)
            return moe_decode_block(
                x, projected, gate_up, down, shared_down, shared_gate, TOP_K, gate_up_config=config
            )

        reference = old()
        old_us = time_us(graphed(old))
        print(f"T={tokens} old (GEMV + moe_route_topk + fused_moe): {old_us:7.2f} us", flush=True)
        default = default_gate_up_config(tokens * TOP_K)
        timings = []
        for block_n, block_k, n_loop, warps in SWEEP:
            config = RoutedGateUpConfig(
                block_n=block_n, block_k=block_k, n_loop=n_loop, warps=warps, narrow_keys=default.narrow_keys
            )
            error = (
                (new(config).float() - reference.float()).abs().max() / reference.float().abs().max()
            ).item()
            us = time_us(graphed(lambda config=config: new(config)))
            mark = " (default)" if config == default else ""
            timings.append((us, config))
            rows.append({"tokens": tokens, **dataclasses.asdict(config), "graph_us": round(us, 2),
                         "old_us": round(old_us, 2), "max_rel_err": error})  # fmt: skip
            print(f"T={tokens} new {block_n:3d} x {block_k:4d} x{n_loop} {warps}w: {us:7.2f} us  "
                  f"err {error:.1e}{mark}", flush=True)  # fmt: skip
        best_us, best = min(timings, key=lambda t: t[0])
        print(f"T={tokens}: best {best} {best_us:.2f} us against old {old_us:.2f} us", flush=True)
    finish("moe_decode_sweep", rows)


if __name__ == "__main__":
    main()
