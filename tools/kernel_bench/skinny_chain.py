"""Time GEMV tiles the way the decode graph runs them: a chain of projections back to back in one CUDA graph.

    python3 -m tools.kernel_bench.skinny_chain [--shapes 5120x6144 5120x17408] [--chain 16] [--rows 1]

The sweep in `skinny_gemm` times one launch per graph, so each config pays its own launch and ramp-up.
In a decode step the projections follow each other under programmatic dependent launch, so a config's
cost is its steady-state streaming plus the overlap it allows with its neighbour. Here each config runs
``--chain`` one-row projections of the same shape over distinct weights (more bytes than L2 holds),
captured in one graph; the time per projection is the replay over the chain length. cuBLAS (`F.linear`)
and the `_TUNED` config are printed for comparison. ``--rows 8`` times eight-row projections (the B = 8
decode step) against the dot kernel's tiles, with and without split-K. With OUT set, the rows go to
$OUT/skinny_chain.json.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from ninfer.ops.triton.skinny_gemm import SkinnyConfig, default_config, skinny_linear
from tools.kernel_bench.common import finish, graphed, max_rel_error, time_us
from tools.kernel_bench.skinny_gemm import BF16, DEVICE, _fma, _weights

# one-row elementwise tiles around the tuned ones: thinner strips (more programs, finer balance over the
# SMs), more steps per loop trip (more loads in flight per program), and fewer or more warps
CANDIDATES = {
    "fma-1x1024-u2": _fma(1, 1024, unroll=2),
    "fma-2x256-u4": _fma(2, 256, unroll=4),
    "fma-2x512-u2": _fma(2, 512, unroll=2),
    "fma-2x512-u2-w2": _fma(2, 512, warps=2, unroll=2),
    "fma-2x1024-u1": _fma(2, 1024, unroll=1),
    "fma-4x256-u4": _fma(4, 256, unroll=4),
    "fma-4x512-u2": _fma(4, 512, unroll=2),
    "fma-4x512-u2-w8": _fma(4, 512, warps=8, unroll=2),
    "fma-4x512-u4": _fma(4, 512, unroll=4),
    "fma-4x1024-u1": _fma(4, 1024, unroll=1),
    "fma-8x256-u4": _fma(8, 256, unroll=4),
    "fma-8x512-u2": _fma(8, 512, unroll=2),
}


# several-row dot tiles (split-K 1 / 2 / 4; a split writes fp32 partials and adds a reduce launch)
ROW_CANDIDATES = {
    f"dot-{bn}x{bk}-st{st}-split{sk}": SkinnyConfig(
        block_n=bn, block_k=bk, split_k=sk, num_warps=4, num_stages=st, use_dot=True
    )
    for bn, bk, st in ((16, 256, 4), (32, 128, 4), (32, 256, 3), (64, 128, 4), (64, 128, 6))
    for sk in (1, 2, 4)
}


def time_chain(n: int, k: int, chain: int, m: int = 1) -> list[dict[str, object]]:
    weights = [_weights(n, k) for _ in range(chain)]
    x = torch.randn(m, k, device=DEVICE, dtype=BF16)
    outs = [torch.empty(m, n, device=DEVICE, dtype=BF16) for _ in range(chain)]
    want = F.linear(x.float(), weights[-1].float())
    rows: list[dict[str, object]] = []

    def record(name: str, fn, config: SkinnyConfig | None) -> None:  # noqa: ANN001
        per_call = time_us(graphed(fn)) / chain
        rows.append({
            "shape": [m, n, k], "name": name, "config": None if config is None else repr(config),
            "us": round(per_call, 2), "GB/s": round(n * k * 2 / per_call / 1e3, 1),
            "max_rel_err": max_rel_error(outs[-1], want),
        })  # fmt: skip

    def cublas() -> None:
        for w, out in zip(weights, outs):
            torch.matmul(x, w.t(), out=out)

    record("cublas", cublas, None)
    tuned = default_config(m, n, k)
    configs = {"tuned": tuned, **(CANDIDATES if m == 1 else ROW_CANDIDATES)}
    for name, config in configs.items():

        def chained(config: SkinnyConfig = config) -> None:
            for w, out in zip(weights, outs):  # static weights, as the graph's bound ones
                skinny_linear(x, w, out=out, config=config, static_weight=True)

        record(name, chained, config)
    rows.sort(key=lambda row: row["us"])
    for row in rows:
        print(f"{m}x{n}x{k}  {row['name']:<22} {row['us']:7.2f} us  {row['GB/s']:7.1f} GB/s  "
              f"err {row['max_rel_err']:.1e}  {row['config'] or ''}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--shapes", nargs="+", default=["5120x6144", "5120x17408", "14336x5120"])
    parser.add_argument("--chain", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1, help="M, the projection's rows (1..16)")
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        rows += time_chain(n, k, args.chain, args.rows)
    finish("skinny_chain", rows)


if __name__ == "__main__":
    main()
