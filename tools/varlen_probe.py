"""What torch's flash varlen attention can do for the prefill on this device, against ours.

    python3 -m tools.varlen_probe [--cases 1024x1024,1024x32768,8192x131072] [--json FILE]

For the 27B's and the 35B-A3B's attention shapes (24 / 16 query heads, 4 / 2 KV heads, head dim 256,
bf16, KV in 64-token pages), a chunk of n queries at the end of a context of L positions, timed with
CUDA events (median of 5 after 2 warm-ups) and compared with `sdpa_prefill_attention` (the fast table's
op today: pages gathered, heads repeated, SDPA with a lower-right causal mask):

- ``paged``: `torch.nn.attention.varlen.varlen_attn` reading the pages through a block table
  (``seqused_k``, ``block_table``), GQA, causal (bottom-right);
- ``gathered``: the row's pages gathered (no head repeat), then `varlen_attn` with GQA, causal;
- ``paged_graph``: ``paged`` captured in a CUDA graph (device lengths only), replayed.

Prints what the installed torch offers (its `varlen_attn` signature and flash implementations) and each
method's time, TFLOP/s and max |difference| from ours; a method the build refuses prints why.
"""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from ninfer.bench.probes import median_seconds

SHAPES = {"27b": (24, 4), "35b": (16, 2)}
HEAD_DIM = 256
PAGE = 64


def _time(fn: Callable[[], Any], repeats: int = 5) -> float:
    return 1e3 * median_seconds(fn, torch.device("cuda"), repeats, warmup=2)


def _case(name: str, n: int, length: int, results: list[dict[str, Any]]) -> None:
    from ninfer.ops.attention import sdpa_prefill_attention

    n_heads, n_kv = SHAPES[name]
    dev, dt = torch.device("cuda"), torch.bfloat16
    pages = -(-length // PAGE)
    gen = torch.Generator(device=dev).manual_seed(0)
    k_pages = torch.randn(pages + 3, PAGE, n_kv, HEAD_DIM, device=dev, dtype=dt, generator=gen)
    v_pages = torch.randn(pages + 3, PAGE, n_kv, HEAD_DIM, device=dev, dtype=dt, generator=gen)
    q = torch.randn(n, n_heads, HEAD_DIM, device=dev, dtype=dt, generator=gen)
    table = (torch.randperm(pages, device=dev, generator=gen) + 3).int().unsqueeze(0)  # scattered pages
    scale = HEAD_DIM**-0.5
    facts = SimpleNamespace(
        block_table=table,
        query_bounds=lambda: [0, n],
        context_lengths=lambda: [length],
    )
    ours = sdpa_prefill_attention(q, k_pages, v_pages, facts, scale)  # type: ignore[arg-type]
    flops = 4 * n_heads * HEAD_DIM * (n * length - n * (n - 1) / 2)
    row = {"shape": name, "queries": n, "context": length}

    def record(method: str, fn: Callable[[], torch.Tensor]) -> None:
        try:
            out = fn()
            diff = (out.float() - ours.float()).abs().max().item()
            ms = _time(fn)
            row[method] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "max_diff": diff}
        except Exception as exc:  # noqa: BLE001 - the probe reports what the build refuses
            row[method] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(name, n, length, method, row[method], flush=True)

    record("ours", lambda: sdpa_prefill_attention(q, k_pages, v_pages, facts, scale))  # type: ignore[arg-type]
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        row["varlen"] = {"error": str(exc)}
        results.append(row)
        return
    cu_q = torch.tensor([0, n], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, length], dtype=torch.int32, device=dev)
    used = torch.tensor([length], dtype=torch.int32, device=dev)

    def paged() -> torch.Tensor:
        return varlen_attn(
            q, k_pages, v_pages, cu_q, None, n, length, scale=scale, window_size=(-1, 0),
            enable_gqa=True, seqused_k=used, block_table=table,
        )  # fmt: skip

    def gathered() -> torch.Tensor:
        idx = table[0].long()
        k = k_pages[idx].flatten(0, 1)[:length]
        v = v_pages[idx].flatten(0, 1)[:length]
        return varlen_attn(q, k, v, cu_q, cu_k, n, length, scale=scale, window_size=(-1, 0), enable_gqa=True)

    record("paged", paged)
    record("gathered", gathered)

    def graphed() -> Callable[[], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            paged()
            with torch.cuda.graph(graph, stream=stream):
                out = paged()
        torch.cuda.current_stream().wait_stream(stream)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    try:
        replay = graphed()
        record("paged_graph", replay)
    except Exception as exc:  # noqa: BLE001
        row["paged_graph"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(name, n, length, "paged_graph", row["paged_graph"], flush=True)
    results.append(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1024x1024,1024x32768,8192x131072")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    info: dict[str, Any] = {"torch": torch.__version__, "capability": torch.cuda.get_device_capability()}
    try:
        from torch.nn.attention import varlen

        info["varlen_attn"] = str(inspect.signature(varlen.varlen_attn))
    except Exception as exc:  # noqa: BLE001
        info["varlen_attn"] = f"unavailable: {exc}"
    attention = torch.nn.attention
    for probe in ("list_flash_attention_impls", "current_flash_attention_impl"):
        fn = getattr(attention, probe, None)
        info[probe] = repr(fn()) if fn is not None else "absent"
    print(json.dumps(info), flush=True)
    results: list[dict[str, Any]] = []
    for shape in SHAPES:
        for case in args.cases.split(","):
            n, length = (int(x) for x in case.split("x"))
            _case(shape, n, length, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
