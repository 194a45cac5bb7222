"""Our Triton paged prefill attention against the SDPA path, over launch shapes, on this device.

    python3 -m tools.prefill_attention_probe [--cases 27b:1024x32768,...] [--tiles 128x64x8x2,...]
                                             [--json FILE]

For the 27B's and the 35B-A3B's attention shapes (24 / 16 query heads, 4 / 2 KV heads, head dim 256,
bf16, KV in 64-token scattered pages), a chunk of n queries at the end of a context of L positions
(``NAMExNxL``), timed with CUDA events (median of 5 after 2 warm-ups): `sdpa_prefill_attention` (pages
gathered, heads repeated, SDPA with a lower-right causal mask) and
`ninfer.ops.triton.paged_prefill_attention` at each launch shape ``BLOCK_MxBLOCK_NxWARPSxSTAGES`` (a
shape the compiler refuses prints why), the first shape captured in a CUDA graph, and the kernel's own
default (`PrefillTiles()`). Prints each
method's time, TFLOP/s (causal FLOPs) and max |difference| from the SDPA path.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from ninfer.bench.probes import median_seconds

SHAPES = {"27b": (24, 4), "35b": (16, 2)}
HEAD_DIM = 256
PAGE = 64
CASES = (
    "27b:1024x1024,27b:4096x4096,27b:256x32768,27b:1024x32768,27b:8192x131072,35b:1024x32768,35b:4096x4096"
)
TILES = "128x64x8x2,128x32x8x2,64x64x4x2,64x64x8x2,64x32x4x3,128x128x8x1,128x64x4x2"


def _time(fn: Callable[[], Any], repeats: int = 5) -> float:
    return 1e3 * median_seconds(fn, torch.device("cuda"), repeats, warmup=2)


def _case(spec: str, tiles: list[tuple[int, ...]], results: list[dict[str, Any]]) -> None:
    from ninfer.ops.attention import sdpa_prefill_attention
    from ninfer.ops.triton.paged_prefill_attention import PrefillTiles, paged_prefill_attention

    name, dims = spec.split(":")
    n, length = (int(v) for v in dims.split("x"))
    n_heads, n_kv = SHAPES[name]
    dev, dt = torch.device("cuda"), torch.bfloat16
    pages = -(-length // PAGE)
    gen = torch.Generator(device=dev).manual_seed(0)
    k_pages = torch.randn(pages + 3, PAGE, n_kv, HEAD_DIM, device=dev, dtype=dt, generator=gen)
    v_pages = torch.randn(pages + 3, PAGE, n_kv, HEAD_DIM, device=dev, dtype=dt, generator=gen)
    q = torch.randn(n, n_heads, HEAD_DIM, device=dev, dtype=dt, generator=gen)
    table = (torch.randperm(pages, device=dev, generator=gen) + 3).int().unsqueeze(0)  # scattered pages
    query_start = torch.tensor([0, n], dtype=torch.int32, device=dev)
    context_lens = torch.tensor([length], dtype=torch.int32, device=dev)
    scale = HEAD_DIM**-0.5
    facts = SimpleNamespace(block_table=table, query_bounds=lambda: [0, n], context_lengths=lambda: [length])
    sdpa = sdpa_prefill_attention(q, k_pages, v_pages, facts, scale)  # type: ignore[arg-type]
    flops = 4 * n_heads * HEAD_DIM * (n * length - n * (n - 1) / 2)
    row: dict[str, Any] = {"shape": name, "queries": n, "context": length}

    def record(method: str, fn: Callable[[], torch.Tensor]) -> None:
        try:
            out = fn()
            diff = (out.float() - sdpa.float()).abs().max().item()
            ms = _time(fn)
            row[method] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "max_diff": diff}
        except Exception as exc:  # noqa: BLE001 - the probe reports what the compiler refuses
            row[method] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(spec, method, row[method], flush=True)

    record("sdpa", lambda: sdpa_prefill_attention(q, k_pages, v_pages, facts, scale))  # type: ignore[arg-type]
    for bm, bn, warps, stages in tiles:
        shape = PrefillTiles(bm, bn, warps, stages)
        record(
            f"triton_{bm}x{bn}x{warps}x{stages}",
            lambda shape=shape: paged_prefill_attention(
                q, k_pages, v_pages, table, query_start, context_lens, scale, tiles=shape
            ),
        )
    shape = PrefillTiles(*tiles[0])
    out = paged_prefill_attention(q, k_pages, v_pages, table, query_start, context_lens, scale, tiles=shape)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_prefill_attention(
            q, k_pages, v_pages, table, query_start, context_lens, scale, tiles=shape, out=out
        )

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    record("triton_graph", replay)
    record(
        "triton_default",
        lambda: paged_prefill_attention(q, k_pages, v_pages, table, query_start, context_lens, scale),
    )
    results.append(row)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--tiles", default=TILES)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    results: list[dict[str, Any]] = []
    for spec in args.cases.split(","):
        _case(spec, tiles, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
