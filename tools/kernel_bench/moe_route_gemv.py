"""Time the one-launch router GEMV + routing (`ninfer.ops.triton.moe_route_gemv`) against the two-launch
path it replaces, at the Qwen3.6-35B-A3B decode shape (E=256 experts, top-8, H=2048, bf16, shared gate).

    python3 -m tools.kernel_bench.moe_route_gemv [--tokens 1 8] [--config '{"block_rows": 16, ...}']
    python3 -m tools.kernel_bench.moe_route_gemv --sweep [--tokens 1 8]

Default run: for each T two lines, each the fused launch's median time as one CUDA-graph replay (what the
decode graph sees; L2 flushed between replays by do_bench, so the router comes from HBM), the bytes it
must move (router + x + gate + outputs) and GB/s, against one of the two-launch paths, also one graph:
`skinny_linear` (the model's GEMV at T = 1) or cuBLAS `F.linear` (the model's at T > 1), each followed
by `moe_route_topk`. The error column is the worst of: the fused logits against an fp64 GEMM rounded to
bf16 (relative to the largest logit), the fused weights against `moe_route_topk` run on the fused
logits, and 1.0 if any expert id differs from that. Then per T the time saved over the 40 MoE layers of
one decode step, and a check line against the bf16 bound. `--config` (JSON of `RouteGemvConfig` fields)
overrides the default config. With OUT set, the rows go to $OUT/moe_route_gemv.json.

`--sweep`: the graph time of each SWEEP config per T, then the best per T; rows to
$OUT/moe_route_gemv_sweep.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ninfer.ops.triton.moe_route_gemv import RouteGemvConfig, default_config, moe_route_gemv
from ninfer.ops.triton.moe_routing import moe_route_topk
from ninfer.ops.triton.skinny_gemm import skinny_linear
from tools.kernel_bench.common import finish, graphed, max_rel_error, time_us, timing_row

EXPERTS, TOP_K, HIDDEN, MOE_LAYERS = 256, 8, 2048, 40
TOKENS = (1, 8)
DEVICE = "cuda"
BF16 = torch.bfloat16
# (block_rows, split_k, block_k): programs = 256 / block_rows * split_k
SWEEP = [
    (16, 8, 64),
    (8, 8, 64),
    (8, 16, 64),
    (16, 4, 128),
    (32, 8, 32),
    (16, 16, 32),
    (32, 4, 64),
    (4, 8, 128),
]


@dataclasses.dataclass
class _Case:
    """One T's inputs and the static output buffers every timed graph writes."""

    x: torch.Tensor
    router: torch.Tensor
    gate: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    shared: torch.Tensor
    logits: torch.Tensor

    @classmethod
    def make(cls, tokens: int) -> _Case:
        return cls(
            x=torch.randn(tokens, HIDDEN, device=DEVICE, dtype=BF16),
            router=(torch.randn(EXPERTS, HIDDEN, device=DEVICE) * HIDDEN**-0.5).to(BF16),
            gate=(torch.randn(1, HIDDEN, device=DEVICE) * HIDDEN**-0.5).to(BF16),
            weights=torch.empty(tokens, TOP_K, device=DEVICE),
            ids=torch.empty(tokens, TOP_K, dtype=torch.int32, device=DEVICE),
            shared=torch.empty(tokens, device=DEVICE),
            logits=torch.empty(tokens, EXPERTS, dtype=BF16, device=DEVICE),
        )

    def fused(self, config: RouteGemvConfig | None = None) -> Callable[[], object]:
        def run() -> object:
            return moe_route_gemv(
                self.x, self.router, TOP_K, shared_expert_gate=self.gate, weights_out=self.weights,
                ids_out=self.ids, shared_weight_out=self.shared, logits_out=self.logits, config=config,
            )  # fmt: skip

        return run

    def two_launch(self, gemv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        def run() -> object:
            return moe_route_topk(
                gemv(self.x, self.router), TOP_K, x=self.x, shared_expert_gate=self.gate,
                weights_out=self.weights, ids_out=self.ids, shared_weight_out=self.shared,
            )  # fmt: skip

        return run

    @property
    def nbytes(self) -> int:
        tokens = self.x.shape[0]
        return (EXPERTS + 1 + tokens) * HIDDEN * 2 + tokens * (2 * TOP_K * 4 + 4 + EXPERTS * 2)

    def error(self, config: RouteGemvConfig | None = None) -> float:
        """Worst of: logits vs fp64 GEMM, weights vs moe_route_topk on the same logits, 1.0 on an id."""
        self.logits.fill_(float("nan"))
        self.weights.fill_(float("nan"))
        self.fused(config)()
        weights, ids = self.weights.clone(), self.ids.clone()
        exact = (self.x.double() @ self.router.double().t()).to(BF16)
        ref_weights, ref_ids, _ = moe_route_topk(self.logits, TOP_K, x=self.x, shared_expert_gate=self.gate)
        error = max(max_rel_error(self.logits, exact), max_rel_error(weights, ref_weights))
        return error if torch.equal(ids, ref_ids) else 1.0


def bench(tokens: int, config: RouteGemvConfig | None) -> list[dict[str, object]]:
    case = _Case.make(tokens)
    error = case.error(config)
    fused_us = time_us(graphed(case.fused(config)))
    rows = []
    for label, gemv in (("skinny+topk", skinny_linear), ("cublas+topk", F.linear)):
        ref_us = time_us(graphed(case.two_launch(gemv)))
        row = timing_row(
            "moe_route_gemv", f"T{tokens}", (tokens, EXPERTS, HIDDEN), case.nbytes, fused_us, ref_us, error,
            ref_label=label,
        )  # fmt: skip
        row["reference"] = label
        row["tokens"] = tokens
        rows.append(row)
    best_ref = min(float(row["torch_us"]) for row in rows)  # type: ignore[arg-type]
    print(
        f"T={tokens}: {MOE_LAYERS} MoE layers per decode step: fused {MOE_LAYERS * fused_us:7.1f} us, best "
        f"two-launch {MOE_LAYERS * best_ref:7.1f} us, saves {MOE_LAYERS * (best_ref - fused_us):+7.1f} us "
        f"[{config or default_config(tokens, EXPERTS, HIDDEN)}]",
        flush=True,
    )
    return rows


def sweep(token_counts: list[int]) -> None:
    rows: list[dict[str, object]] = []
    for tokens in token_counts:
        case = _Case.make(tokens)
        timings = []
        for block_rows, split_k, block_k in SWEEP:
            config = RouteGemvConfig(block_rows=block_rows, split_k=split_k, block_k=block_k)
            error = case.error(config)
            graph_us = time_us(graphed(case.fused(config)))
            name = f"{block_rows}x{split_k}x{block_k}"
            timings.append((graph_us, name))
            rows.append(
                {
                    "op": "moe_route_gemv",
                    "tokens": tokens,
                    "name": name,
                    "config": dataclasses.asdict(config),
                    "graph_us": round(graph_us, 2),
                    "GB/s": round(case.nbytes / graph_us / 1e3, 1),
                    "max_rel_err": error,
                }
            )
            print(f"T={tokens} {name:>10}: {graph_us:7.2f} us  err {error:.1e}", flush=True)
        best_us, best_name = min(timings)
        print(f"T={tokens}: best {best_name} {best_us:.2f} us", flush=True)
    finish("moe_route_gemv_sweep", rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="values of T")
    parser.add_argument("--config", default=None, help="JSON of RouteGemvConfig fields")
    parser.add_argument("--sweep", action="store_true", help="time the SWEEP configs instead")
    args = parser.parse_args()

    torch.manual_seed(0)
    start = time.perf_counter()
    if args.sweep:
        sweep(args.tokens)
    else:
        config = RouteGemvConfig(**json.loads(args.config)) if args.config else None
        rows = [row for tokens in args.tokens for row in bench(tokens, config)]
        finish("moe_route_gemv", rows)
    print(f"total {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
