"""Time the fused one-row GEMV + residual add + RMSNorm against the two launches it replaces.

    python3 -m tools.kernel_bench.gemv_norm [--config '{"block_n": 16, ...}'] [--sweep]

Shapes: the decode (B = 1) projections of Qwen3.6 that end in the residual add + next norm, bf16:
27B o_proj / GDN out_proj 6144 -> 5120 and down_proj 17408 -> 5120, 35B-A3B o_proj / GDN out_proj
4096 -> 2048. One line per shape: `linear_add_rms_norm` as one CUDA-graph replay (median), the bytes it
must move (weights, act, residual, norm weight, h and x) and the GB/s, the unfused `skinny_linear` +
`add_rms_norm` as one graph replay, the speedup, and the max relative error of h and x against the
unfused pair (which should be bit-exact up to the sum-of-squares order: the row also says how many
elements of x and h differ from it at all, and by at most how many ulps). Then the time saved per decode
step (per-shape saving times the uses per step), and the check line. `--config` (JSON of SkinnyConfig
fields) replaces the default GEMV config for the fused op (the unfused pair keeps its default).
`--sweep`: the fused op's graph time under a few GEMV configs per shape instead. With OUT set, the rows
also go to $OUT/gemv_norm.json (or gemv_norm_sweep.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import torch

from ninfer.ops.triton.gemv_norm import linear_add_rms_norm
from ninfer.ops.triton.norm import add_rms_norm
from ninfer.ops.triton.skinny_gemm import SkinnyConfig, _split_for, default_config, skinny_linear
from tools.kernel_bench.common import finish, graphed, max_rel_error, time_us, timing_row

DEVICE = "cuda"
BF16 = torch.bfloat16
EPS = 1e-6
H200_SMS = 132

# (variant, op, N, K, uses per decode step at B = 1)
SHAPES = [
    ("27b", "attn_o+gdn_out", 5120, 6144, 16 + 48),
    ("27b", "mlp_down", 5120, 17408, 64),
    ("35b-a3b", "attn_o+gdn_out", 2048, 4096, 10 + 30),
]
SHAPES_USES = {(variant, op): uses for variant, op, _, _, uses in SHAPES}

# GEMV templates for --sweep (split_k set per shape as default_config does)
SWEEP = {
    "fma-8x512-u2": SkinnyConfig(block_n=8, block_k=512, unroll=2),
    "fma-8x512": SkinnyConfig(block_n=8, block_k=512),
    "fma-4x1024": SkinnyConfig(block_n=4, block_k=1024),
    "fma-4x512-u2": SkinnyConfig(block_n=4, block_k=512, unroll=2),
    "fma-16x256-u2": SkinnyConfig(block_n=16, block_k=256, unroll=2),
    "fma-16x512-w8": SkinnyConfig(block_n=16, block_k=512, num_warps=8),
    "dot-32x256-st3": SkinnyConfig(block_n=32, block_k=256, num_stages=3, use_dot=True),
    "dot-64x128-st4": SkinnyConfig(block_n=64, block_k=128, num_stages=4, use_dot=True),
}


def _inputs(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    act = torch.randn(1, k, device=DEVICE).to(BF16)
    w = (torch.randn(n, k, device=DEVICE) * k**-0.5).to(BF16)
    residual = (torch.randn(1, n, device=DEVICE) * 2.0).to(BF16)
    norm_weight = (torch.randn(n, device=DEVICE) * 0.5).to(BF16)
    return act, w, residual, norm_weight


def _ulp_gap(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int]:
    """(elements that differ, max distance in ulps) of two bf16 tensors (bit patterns as integers)."""
    gap = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    return int((gap > 0).sum().item()), int(gap.max().item())


def bench(variant: str, op: str, n: int, k: int, override: dict[str, object]) -> dict[str, object]:
    act, w, residual, norm_weight = _inputs(n, k)
    config = dataclasses.replace(default_config(1, n, k), **override)  # type: ignore[arg-type]
    y = torch.empty(1, n, dtype=BF16, device=DEVICE)
    h_ref, x_ref = torch.empty_like(y), torch.empty_like(y)
    h, x = torch.empty_like(y), torch.empty_like(y)

    def unfused() -> None:
        skinny_linear(act, w, out=y)
        add_rms_norm(y, residual, norm_weight, EPS, out=h_ref, summed_out=x_ref)

    def fused() -> None:
        linear_add_rms_norm(act, w, residual, norm_weight, EPS, out_h=h, out_x=x, config=config)

    unfused_replay, fused_replay = graphed(unfused), graphed(fused)
    h.fill_(float("nan"))
    x.fill_(float("nan"))
    fused_replay()
    unfused_replay()
    error = max(max_rel_error(h, h_ref), max_rel_error(x, x_ref))
    if h.isnan().any() or x.isnan().any():
        error = max(error, 1.0)  # an unwritten output fails the check
    x_diff, x_ulps = _ulp_gap(x, x_ref)
    h_diff, h_ulps = _ulp_gap(h, h_ref)
    nbytes = n * k * 2 + k * 2 + 5 * n * 2  # weights, act, residual + norm weight + h + x
    fused_us, unfused_us = time_us(fused_replay), time_us(unfused_replay)
    row = timing_row(op, variant, (1, n, k), nbytes, fused_us, unfused_us, error, ref_label="unfused")
    row.update(
        uses_per_step=SHAPES_USES[variant, op],
        saved_us_per_step=round((unfused_us - fused_us) * SHAPES_USES[variant, op], 1),
        fused_eager_us=round(time_us(fused), 2),
        unfused_eager_us=round(time_us(unfused), 2),
        x_elements_differing=x_diff,
        x_max_ulps=x_ulps,
        h_elements_differing=h_diff,
        h_max_ulps=h_ulps,
        config=dataclasses.asdict(config),
    )
    print(
        f"{'':>22} vs unfused: x differs in {x_diff}/{n} (max {x_ulps} ulp), h in {h_diff}/{n} "
        f"(max {h_ulps} ulp); eager fused {row['fused_eager_us']} us, unfused {row['unfused_eager_us']} us; "
        f"saves {row['saved_us_per_step']} us per step over {row['uses_per_step']} uses [{config}]",
        flush=True,
    )
    return row


def sweep() -> None:
    rows: list[dict[str, object]] = []
    for variant, op, n, k, _ in SHAPES:
        act, w, residual, norm_weight = _inputs(n, k)
        h_ref, x_ref = add_rms_norm(skinny_linear(act, w), residual, norm_weight, EPS)
        h, x = torch.empty_like(h_ref), torch.empty_like(x_ref)
        timings = []
        for name, template in SWEEP.items():
            config = dataclasses.replace(
                template, split_k=_split_for(n, k, template.block_n, template.block_k, H200_SMS)
            )

            replay = graphed(
                functools.partial(
                    linear_add_rms_norm, act, w, residual, norm_weight, EPS, out_h=h, out_x=x, config=config
                )
            )
            h.fill_(float("nan"))
            replay()
            error = max(max_rel_error(h, h_ref), max_rel_error(x, x_ref))
            us = time_us(replay)
            timings.append((us, name))
            rows.append(
                {"op": op, "variant": variant, "shape": [1, n, k], "name": name, "graph_us": round(us, 2),
                 "GB/s": round(n * k * 2 / us / 1e3, 1), "config": dataclasses.asdict(config),
                 "max_rel_err": error}
            )  # fmt: skip
        timings.sort()
        listing = "  ".join(f"{name} {us:.2f}" for us, name in timings)
        print(f"{variant:>7} {op:<15} N={n} K={k}: best {timings[0][1]} | {listing}", flush=True)
    finish("gemv_norm_sweep", rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="{}", help="JSON of SkinnyConfig fields for the fused op")
    parser.add_argument("--sweep", action="store_true", help="time the SWEEP GEMV configs instead")
    args = parser.parse_args()

    torch.manual_seed(0)
    start = time.perf_counter()
    if args.sweep:
        sweep()
    else:
        override = json.loads(args.config)
        rows = [bench(variant, op, n, k, override) for variant, op, n, k, _ in SHAPES]
        for variant in dict.fromkeys(row["variant"] for row in rows):
            saved = sum(float(row["saved_us_per_step"]) for row in rows if row["variant"] == variant)  # type: ignore[arg-type]
            print(
                f"step {variant:>7}: the fused op saves {saved / 1e3:+.3f} ms per B = 1 decode step",
                flush=True,
            )
        finish("gemv_norm", rows)
    print(f"total {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
