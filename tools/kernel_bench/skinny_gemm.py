"""Time the Triton skinny GEMM (decode GEMV) against cuBLAS (`F.linear`) at the real Qwen3.6 projections.

    python3 -m tools.kernel_bench.skinny_gemm [--rows 1 2 4 8] [--config '{"block_n": 16, ...}']
    python3 -m tools.kernel_bench.skinny_gemm --sweep [--variant 27b|35b-a3b]

Shapes: every decode projection of Qwen3.6-27B and -35B-A3B, stacked as the binder stacks them
(`fused_row_groups`), bf16. Default run: one line per (shape, M) in M = 1, 2, 4, 8 with our kernel's
median time as one CUDA-graph replay (what the decode graph sees) and eager, its GB/s (weight bytes /
graph time), the same for cuBLAS, the speedup (cuBLAS graph time / ours), the max relative error
max|got - ref| / max|ref| of both against an fp32 `F.linear` of the same bf16 inputs, and the config
`default_config` picked. Then, per variant and M, the projections' total over one decode step
(27B: 16 attention, 48 GDN, 64 MLP, 1 lm_head; 35B-A3B: 10 attention, 30 GDN, 40 router/shared-expert,
1 lm_head; routed experts not included): ours, cuBLAS, and the best of the two per shape. A last line
checks every error against the bf16 bound. `--config` (JSON of `SkinnyConfig` fields) replaces the
default config for every shape. With OUT set, the rows also go to $OUT/skinny_gemm.json.

`--sweep`: the graph-replay time of each SWEEP config at M = 1 and 8 for one variant's shapes (27B by
default; lm_head included), with split_k chosen per shape as `default_config` does and, at M = 8, also
fixed at 2 and 4 (narrow projections such as N = 5,120 fill few SMs without it); the best per shape, and
the `_TUNED` entries of `ninfer.ops.triton.skinny_gemm` to paste: every M = 1 best, and an M = 8 best
only where it beats cuBLAS by >= 3 % (`prefers_skinny` then sends 2..8 rows to it). With OUT set, the
rows go to $OUT/skinny_gemm_sweep.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ninfer.ops.triton.skinny_gemm import SkinnyConfig, _split_for, default_config, skinny_linear
from tools.kernel_bench.common import finish, graphed, max_rel_error, time_us

DEVICE = "cuda"
BF16 = torch.bfloat16
H200_SMS = 132
ROWS = (1, 2, 4, 8)
SWEEP_ROWS = (1, 8)
SWEEP_SPLITS = {1: (), 8: (2, 4)}  # fixed split_k tried besides the per-shape default
MIN_GAIN_OVER_CUBLAS = 1.03  # an 8-row config enters _TUNED only this much faster than cuBLAS

# variant: (op, N, K, uses per decode step)
SHAPES: dict[str, list[tuple[str, int, int, int]]] = {
    "27b": [
        ("attn_qkv", 24 * 256 * 2 + 2 * 4 * 256, 5120, 16),  # q doubled by the output gate, k, v
        ("attn_o", 5120, 24 * 256, 16),
        ("gdn_in", 10240 + 6144 + 48 + 48, 5120, 48),  # qkv (conv_dim), z, b, a
        ("gdn_out", 5120, 48 * 128, 48),
        ("mlp_gate_up", 2 * 17408, 5120, 64),
        ("mlp_down", 5120, 17408, 64),
        ("lm_head", 248320, 5120, 1),
    ],
    "35b-a3b": [
        ("attn_qkv", 16 * 256 * 2 + 2 * 2 * 256, 2048, 10),
        ("attn_o", 2048, 16 * 256, 10),
        ("gdn_in", 8192 + 4096 + 32 + 32, 2048, 30),
        ("gdn_out", 2048, 32 * 128, 30),
        ("moe_in", 256 + 2 * 512, 2048, 40),  # router, shared expert gate and up
        ("shared_down", 2048, 512, 40),
        ("lm_head", 248320, 2048, 1),
    ],
}


def _fma(block_n: int, block_k: int, warps: int = 4, stages: int = 1, unroll: int = 1) -> SkinnyConfig:
    return SkinnyConfig(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages, unroll=unroll)


def _dot(block_n: int, block_k: int, warps: int = 4, stages: int = 4) -> SkinnyConfig:
    return SkinnyConfig(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages, use_dot=True)


# Config templates per M bucket for --sweep (split_k is set per shape). At M = 1 the elementwise kernel
# with thin (4-16 rows) strips, loads in flight from unrolling or occupancy, and two dot ones; at M = 8
# the dot kernel from a narrow MMA tile (mma.sync) to wgmma-sized ones (block_n >= 64), with 3-6
# pipeline stages, and two elementwise ones (their [8, block_n, block_k] accumulator kept small).
SWEEP: dict[int, dict[str, SkinnyConfig]] = {
    1: {
        "fma-4x1024": _fma(4, 1024),
        "fma-8x512": _fma(8, 512),
        "fma-8x512-u2": _fma(8, 512, unroll=2),
        "fma-16x256-u2": _fma(16, 256, unroll=2),
        "fma-16x512-w8": _fma(16, 512, warps=8),
        "fma-4x512-u2": _fma(4, 512, unroll=2),
        "dot-32x256-st3": _dot(32, 256, stages=3),
        "dot-64x128-st4": _dot(64, 128),
    },
    8: {
        "dot-16x256-st4": _dot(16, 256),
        "dot-32x256-st3": _dot(32, 256, stages=3),
        "dot-64x128-st4": _dot(64, 128),
        "dot-64x128-st6": _dot(64, 128, stages=6),
        "dot-64x256-w8-st3": _dot(64, 256, warps=8, stages=3),
        "dot-128x128-w8-st4": _dot(128, 128, warps=8),
        "fma-4x256": _fma(4, 256),
        "fma-8x128-u2": _fma(8, 128, unroll=2),
    },
}


def _describe(config: SkinnyConfig) -> str:
    kind = "dot" if config.use_dot else f"fma-u{config.unroll}"
    return (
        f"{kind} {config.block_n}x{config.block_k} split{config.split_k} "
        f"w{config.num_warps} st{config.num_stages}"
    )


def _weights(n: int, k: int) -> torch.Tensor:
    return (torch.randn(n, k, device=DEVICE, dtype=BF16) * k**-0.5).contiguous()


@dataclasses.dataclass
class _Timed:
    graph_us: float
    eager_us: float | None
    error: float


def _time(fn: Callable[[], torch.Tensor], want: torch.Tensor, eager: bool) -> _Timed:
    error = max_rel_error(fn(), want)
    return _Timed(time_us(graphed(fn)), time_us(fn) if eager else None, error)


def bench(
    variant: str, op: str, n: int, k: int, rows: tuple[int, ...], override: dict[str, object]
) -> list[dict[str, object]]:
    w = _weights(n, k)
    w32 = w.float()
    weight_bytes = n * k * 2
    out_rows = []
    for m in rows:
        x = torch.randn(m, k, device=DEVICE, dtype=BF16)
        want = F.linear(x.float(), w32)
        config = dataclasses.replace(default_config(m, n, k), **override)  # type: ignore[arg-type]
        out = torch.empty(m, n, dtype=BF16, device=DEVICE)
        ours = _time(lambda x=x, out=out, c=config: skinny_linear(x, w, out=out, config=c), want, True)
        cublas = _time(lambda x=x: F.linear(x, w), want, True)
        nbytes = weight_bytes + m * (k + n) * 2
        row = {
            "op": op,
            "variant": variant,
            "shape": [m, n, k],
            "bytes": nbytes,
            "graph_us": round(ours.graph_us, 2),
            "eager_us": round(ours.eager_us or 0.0, 2),
            "GB/s": round(weight_bytes / ours.graph_us / 1e3, 1),
            "cublas_graph_us": round(cublas.graph_us, 2),
            "cublas_eager_us": round(cublas.eager_us or 0.0, 2),
            "cublas_GB/s": round(weight_bytes / cublas.graph_us / 1e3, 1),
            "speedup": round(cublas.graph_us / ours.graph_us, 3),
            "max_rel_err": ours.error,
            "cublas_max_rel_err": cublas.error,
            "config": _describe(config),
        }
        print(
            f"{variant:>7} {op:<11} M={m} N={n:6d} K={k:5d} {weight_bytes / 1e6:8.1f} MB | ours "
            f"{ours.graph_us:8.2f} us {row['GB/s']:7.1f} GB/s (eager {row['eager_us']:8.2f}) | cuBLAS "
            f"{cublas.graph_us:8.2f} us {row['cublas_GB/s']:7.1f} GB/s (eager {row['cublas_eager_us']:8.2f}) "
            f"| x{row['speedup']:<5} err {ours.error:.1e} (cuBLAS {cublas.error:.1e}) [{row['config']}]",
            flush=True,
        )
        out_rows.append(row)
    return out_rows


def print_step_totals(rows: list[dict[str, object]]) -> None:
    """Per variant and M: the projections' time over one decode step, ours vs cuBLAS vs best per shape."""
    counts = {(variant, op): count for variant, shapes in SHAPES.items() for op, _, _, count in shapes}
    # (variant, M) -> [(uses per step, ours us, cuBLAS us)]
    per_step: dict[tuple[str, int], list[tuple[int, float, float]]] = {}
    for row in rows:
        variant, op, shape = str(row["variant"]), str(row["op"]), row["shape"]
        assert isinstance(shape, list)
        entry = (counts[variant, op], float(row["graph_us"]), float(row["cublas_graph_us"]))  # type: ignore[arg-type]
        per_step.setdefault((variant, int(shape[0])), []).append(entry)
    for (variant, m), entries in per_step.items():
        if len(entries) != len(SHAPES[variant]):
            continue  # not every projection of the step was timed
        ours = sum(count * us for count, us, _ in entries)
        cublas = sum(count * us for count, _, us in entries)
        best = sum(count * min(mine, theirs) for count, mine, theirs in entries)
        print(
            f"step {variant:>7} M={m}: ours {ours / 1e3:7.3f} ms  cuBLAS {cublas / 1e3:7.3f} ms  "
            f"best-of-each {best / 1e3:7.3f} ms  (ours saves {(cublas - ours) / 1e3:+.3f} ms, "
            f"best-of saves {(cublas - best) / 1e3:+.3f} ms)",
            flush=True,
        )


def _sweep_configs(m: int, n: int, k: int) -> dict[str, SkinnyConfig]:
    """SWEEP[m]'s templates with the per-shape default split, and at the SWEEP_SPLITS[m] splits (dot only)."""
    configs: dict[str, SkinnyConfig] = {}
    for name, template in SWEEP[m].items():
        default = _split_for(n, k, template.block_n, template.block_k, H200_SMS)
        configs[name] = dataclasses.replace(template, split_k=default)
        for split in SWEEP_SPLITS[m]:
            if template.use_dot and split != default and k // split >= 4 * template.block_k:
                configs[f"{name}-split{split}"] = dataclasses.replace(template, split_k=split)
    return configs


def sweep_shape(
    variant: str,
    op: str,
    n: int,
    k: int,
    rows: list[dict[str, object]],
    tuned: dict[tuple[int, int, int], SkinnyConfig],
) -> None:
    """Graph time of every sweep config at M = 1 and 8 for one shape; the best goes into ``tuned`` (at
    M = 8 only if it beats cuBLAS by MIN_GAIN_OVER_CUBLAS)."""
    w = _weights(n, k)
    w32 = w.float()
    for m in SWEEP_ROWS:
        x = torch.randn(m, k, device=DEVICE, dtype=BF16)
        want = F.linear(x.float(), w32)
        out = torch.empty(m, n, dtype=BF16, device=DEVICE)
        cublas_us = time_us(graphed(lambda x=x: F.linear(x, w)))
        timings: list[tuple[float, str, SkinnyConfig]] = []
        for name, config in _sweep_configs(m, n, k).items():
            timed = _time(lambda x=x, out=out, c=config: skinny_linear(x, w, out=out, config=c), want, False)
            timings.append((timed.graph_us, name, config))
            rows.append(
                {
                    "op": op,
                    "variant": variant,
                    "shape": [m, n, k],
                    "name": name,
                    "config": dataclasses.asdict(config),
                    "graph_us": round(timed.graph_us, 2),
                    "GB/s": round(n * k * 2 / timed.graph_us / 1e3, 1),
                    "cublas_graph_us": round(cublas_us, 2),
                    "max_rel_err": timed.error,
                }
            )
        timings.sort(key=lambda item: item[0])
        best_us, best_name, best_config = timings[0]
        if m == 1 or cublas_us >= MIN_GAIN_OVER_CUBLAS * best_us:
            tuned[(m, n, k)] = best_config
        listing = "  ".join(f"{name} {us:.1f}" for us, name, _ in timings)
        print(
            f"{op:<11} M={m} N={n:6d} K={k:5d}: best {best_name} {best_us:.2f} us "
            f"{n * k * 2 / best_us / 1e3:.0f} GB/s vs cuBLAS {cublas_us:.2f} us "
            f"{n * k * 2 / cublas_us / 1e3:.0f} GB/s (x{cublas_us / best_us:.3f}) | {listing}",
            flush=True,
        )


def sweep(variant: str) -> None:
    """Every sweep config on every shape of ``variant`` at M = 1 and 8; print the `_TUNED` entries."""
    rows: list[dict[str, object]] = []
    tuned: dict[tuple[int, int, int], SkinnyConfig] = {}
    for op, n, k, _ in SHAPES[variant]:
        sweep_shape(variant, op, n, k, rows, tuned)
    print(f"_TUNED entries ({variant}; M = 8 only where >= {MIN_GAIN_OVER_CUBLAS}x cuBLAS):")
    print("_TUNED: dict[tuple[int, int, int], SkinnyConfig] = {")
    for key, config in tuned.items():
        print(f"    {key}: {config!r},")
    print("}", flush=True)
    finish("skinny_gemm_sweep", rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="values of M")
    parser.add_argument("--config", default="{}", help="JSON of SkinnyConfig fields, for every shape")
    parser.add_argument("--sweep", action="store_true", help="time the SWEEP configs instead")
    parser.add_argument("--variant", default="27b", choices=list(SHAPES), help="the shapes --sweep times")
    args = parser.parse_args()

    torch.manual_seed(0)
    start = time.perf_counter()
    if args.sweep:
        sweep(args.variant)
    else:
        override = json.loads(args.config)
        rows = [
            row
            for variant, shapes in SHAPES.items()
            for op, n, k, _ in shapes
            for row in bench(variant, op, n, k, tuple(args.rows), override)
        ]
        print_step_totals(rows)
        finish("skinny_gemm", rows)
    print(f"total {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
