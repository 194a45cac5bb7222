"""Where a decode step's and a prefill chunk's GPU time goes: per-kernel-class breakdown of one forward.

    python3 -m tools.profile_step PACKAGE [--kernels fast|reference] [--batch 1,8] [--context 2048]
                                          [--prefill 2048[,8192]] [--prefill-detail]

Random weights of the package's exact dims (as `ninfer bench --synthetic`), bf16 on CUDA, the model's
`forward` over a state store sized for the batch. For each B: the decode step replayed from a CUDA graph
(median of graph replays: the step's device time without the Engine), then one eager step under the torch
profiler, kernels summed by class. The same for one prefill chunk of each ``--prefill`` size;
``--prefill-detail`` adds, for that chunk, every host sync it makes (by call site, from
``torch.cuda.set_sync_debug_mode``) and its device time by aten op and input shape.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import traceback
import warnings
from collections import Counter, defaultdict

import torch

from ninfer.targets.qwen3_6.binder import random_model_view
from ninfer.targets.qwen3_6.kernels import select_kernels
from ninfer.targets.qwen3_6.model import StateStore, StepBatch, forward
from ninfer.targets.registry import get_package
from tools.kernel_bench.common import graphed, time_us

# kernel-name patterns -> class, first match wins
CLASSES = [
    ("gemm", r"gemm|gemv|cutlass|sm90_xmma|nvjet|splitK|matmul"),
    ("moe", r"moe|expert|gate_up_kernel|down_kernel|down_combine|align_"),
    ("gdn", r"gdn|delta|chunk_|recurrent|solve_tril|wy_|fwd_h|fwd_o|kkt|cumsum"),
    ("conv", r"conv"),
    ("attention", r"attn|attention|flash|fmha|paged|merge_splits|softmax"),
    ("norm", r"norm|rsqrt"),
    ("activation", r"swiglu|silu|sigmoid_gate"),
    ("copy/index", r"copy|index|gather|scatter|cat|fill|Memcpy|Memset"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce"),
]


def kernel_class(name: str) -> str:
    for label, pattern in CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def make_batch(
    b: int, tokens: int, context: int, page_size: int, device: torch.device, *, verify: bool = False
) -> StepBatch:
    """B rows of ``tokens`` new tokens each at the end of ``context`` positions; row r owns pages r*P..
    ``verify``: a speculative verify's step (the state after each token into its own slot, slots B..B +
    B x tokens, the static (B, T) path), so the store needs B x (1 + tokens) state slots."""
    pages = -(-context // page_size)
    n = b * tokens
    pos = torch.cat([torch.arange(context - tokens, context) for _ in range(b)]).to(device)
    table = torch.arange(b * pages, dtype=torch.int32, device=device).view(b, pages)
    slots = torch.cat([r * pages * page_size + torch.arange(context - tokens, context) for r in range(b)])
    qs = list(range(0, n + 1, tokens))
    return StepBatch(
        token_ids=torch.randint(1000, 100000, (n,), device=device),
        positions=pos.expand(3, -1),
        query_start=torch.tensor(qs, dtype=torch.int32, device=device),
        context_lens=torch.full((b,), context, dtype=torch.int32, device=device),
        block_table=table,
        slot_mapping=slots.to(device),
        state_in=torch.arange(b, device=device),
        state_out=(
            torch.arange(b, b + b * tokens, device=device).view(b, tokens)
            if verify
            else torch.arange(b, 2 * b, device=device)
        ),
        fresh=torch.zeros(b, dtype=torch.bool, device=device),
        tokens_per_row=tokens if verify else None,
        query_start_host=tuple(qs),
        context_lens_host=(context,) * b,
    )


PAGE_SIZE = 64


def synthetic_decode_setup(  # noqa: ANN201
    package: str, batches: list[int], context: int, kernels: str = "fast", tokens_per_row: int = 1
):
    """(variant, view, kernels, store) for steps of up to max(batches) rows of up to ``context`` positions
    (``tokens_per_row`` > 1: verify steps, `make_batch(verify=True)`): random bf16 weights of the package's
    exact dims on CUDA, KV pages of PAGE_SIZE positions."""
    device = torch.device("cuda")
    variant = get_package(package).variant
    view = random_model_view(variant, seed=0, dtype=torch.bfloat16, device=device)
    b_max = max(batches)
    slots = b_max * (1 + max(1, tokens_per_row))
    store = StateStore.allocate(variant, slots, b_max * -(-context // PAGE_SIZE), PAGE_SIZE,
                                torch.bfloat16, device)  # fmt: skip
    return variant, view, select_kernels(device, kernels), store


def profile(fn, steps: int = 3) -> dict[str, float]:
    """Kernel time per class (microseconds per call) over ``steps`` calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per_class: dict[str, float] = defaultdict(float)
    launches: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us = event.device_time / steps
            per_class[kernel_class(event.name)] += us
            launches[kernel_class(event.name)] += 1 / steps
            per_kernel[event.name[:90]] += us
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:24]
    classes = dict(sorted(per_class.items(), key=lambda kv: -kv[1]))
    return {"classes": classes, "launches": {k: round(launches[k]) for k in classes}, "top": top}


def sync_sites(fn) -> Counter[str]:
    """Host syncs one call of ``fn`` makes, counted by the innermost non-torch frame that caused them.

    torch flags reads back to the host and copies from pageable host memory; a ``non_blocking`` copy from
    pageable memory also waits for the stream but is not flagged."""
    sites: Counter[str] = Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
        frames = [f for f in frames if "warnings" not in f.filename]
        site = frames[-1] if frames else None
        sites[f"{site.filename}:{site.lineno} {site.name}" if site else str(filename)] += 1

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sites


def op_table(fn, rows: int = 25) -> str:
    """Device time of one call of ``fn`` by aten op and input shapes (what launched the copies)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    averages = prof.key_averages(group_by_input_shape=True)
    return averages.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=40)


def graph_time_ms(fn) -> float:
    """Median CUDA-graph replay time of ``fn`` in milliseconds."""
    return time_us(graphed(fn)) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("package")
    parser.add_argument("--kernels", default="fast")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prefill", default="2048", help="prefill chunk sizes, comma-separated")
    parser.add_argument("--prefill-detail", action="store_true", help="host syncs and per-op device time")
    args = parser.parse_args()
    device = torch.device("cuda")
    batches = [int(b) for b in args.batch.split(",")]
    prefills = [int(n) for n in args.prefill.split(",")]
    variant, view, kernels, store = synthetic_decode_setup(
        args.package, batches, max(args.context, *prefills), args.kernels
    )
    page_size = PAGE_SIZE
    report: dict = {"package": args.package, "kernels": kernels.name, "decode": {}, "prefill": {}}
    with torch.inference_mode():
        for b in batches:
            batch = make_batch(b, 1, args.context, page_size, device)

            def step(batch: StepBatch = batch) -> None:
                forward(view, variant, batch, store, logits="last", kernels=kernels)

            ms = graph_time_ms(step)
            report["decode"][b] = {"graph_ms": ms, **profile(step)}
            print(f"decode B={b} ctx={args.context}: graph replay {ms:.3f} ms", flush=True)
            counts = report["decode"][b]["launches"]
            print(f"   {sum(counts.values())} launches", flush=True)
            for label, us in report["decode"][b]["classes"].items():
                print(f"   {label:12s} {us:9.1f} us  {counts[label]:5d} launches", flush=True)
            for name, us in report["decode"][b]["top"]:
                print(f"      {us:9.1f} us  {name}", flush=True)
        for tokens in prefills:
            batch = make_batch(1, tokens, tokens, page_size, device)

            def chunk(batch: StepBatch = batch) -> None:
                forward(view, variant, batch, store, logits="last", kernels=kernels)

            chunk()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                chunk()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / 3
            report["prefill"][tokens] = {"ms": ms, **profile(chunk, steps=1)}
            print(f"prefill {tokens} tokens: {ms:.1f} ms ({tokens / ms * 1e3:.0f} tok/s)", flush=True)
            for label, us in report["prefill"][tokens]["classes"].items():
                print(f"   {label:12s} {us / 1e3:9.2f} ms", flush=True)
            for name, us in report["prefill"][tokens]["top"]:
                print(f"      {us / 1e3:9.2f} ms  {name}", flush=True)
            if args.prefill_detail:
                sites = sync_sites(chunk)
                report["prefill"][tokens]["syncs"] = dict(sites)
                print(f"prefill host syncs: {sum(sites.values())}", flush=True)
                for site, count in sites.most_common(20):
                    print(f"   {count:4d}  {site}", flush=True)
                print(op_table(chunk), flush=True)
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], f"profile_{args.package}_{kernels.name}.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
