"""Where a decode graph's time goes, kernel by kernel, as the graph runs them (PDL overlap included).

    python3 -m tools.graph_timeline PACKAGE [--batch 1,8] [--context 2048] [--replays 5] [--top 30]

Random weights of the package's exact dims (as `tools.profile_step`), bf16 on CUDA. The decode step is
captured in a CUDA graph and replayed under the torch profiler, which records every kernel inside the
replay with its grid. Kernels overlap under programmatic dependent launch, so a kernel's own duration says
little; what this prints is each kernel's *marginal* time: how far it moved the latest end seen so far
(end - max(end of every earlier kernel), floored at 0), whose sum over a replay is the replay's span.
Summed by kernel name and grid (one row per distinct launch shape: gdn_in and gdn_out are both the GEMV
kernel, with different grids), medians over the replays. The profiler slows the launch a little, so the
span is a bit above `tools.profile_step`'s graph time; compare rows, not totals, across trees.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections import defaultdict

import torch

from ninfer.targets.qwen3_6.model import StepBatch, forward
from tools.kernel_bench.common import graphed
from tools.profile_step import PAGE_SIZE, graph_time_ms, make_batch, synthetic_decode_setup


def kernel_events(trace_path: str) -> list[dict]:
    """The trace's kernel events (name, grid, start and end in microseconds), in start order."""
    with open(trace_path) as f:
        trace = json.load(f)
    kernels = []
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "kernel" or "dur" not in event:
            continue
        args = event.get("args", {})
        grid = tuple(args.get("grid", ()))
        kernels.append({
            "name": event["name"][:120],
            "grid": grid,
            "start": float(event["ts"]),
            "end": float(event["ts"]) + float(event["dur"]),
        })  # fmt: skip
    return sorted(kernels, key=lambda k: k["start"])


def split_replays(kernels: list[dict], per_replay: int) -> list[list[dict]]:
    return [kernels[i : i + per_replay] for i in range(0, len(kernels) - per_replay + 1, per_replay)]


def marginal_table(replay: list[dict]) -> tuple[float, dict[str, tuple[int, float, float]]]:
    """(span, {label: (launches, summed own duration, summed marginal time)}) of one replay."""
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    latest = replay[0]["start"]
    for k in replay:
        label = f"{k['name']} {list(k['grid'])}"
        row = rows[label]
        row[0] += 1
        row[1] += k["end"] - k["start"]
        row[2] += max(0.0, k["end"] - latest)
        latest = max(latest, k["end"])
    return latest - replay[0]["start"], {label: tuple(v) for label, v in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("package")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda")
    batches = [int(b) for b in args.batch.split(",")]
    variant, view, kernels, store = synthetic_decode_setup(args.package, batches, args.context)
    with torch.inference_mode():
        for b in batches:
            batch = make_batch(b, 1, args.context, PAGE_SIZE, device)

            def step(batch: StepBatch = batch) -> None:
                forward(view, variant, batch, store, logits="last", kernels=kernels)

            print(f"B={b}: graph replay {graph_time_ms(step):.3f} ms (no profiler)", flush=True)
            replay = graphed(step)
            with tempfile.TemporaryDirectory() as tmp:
                # one replay alone first, to count its kernels
                path = os.path.join(tmp, "one.json")
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    replay()
                    torch.cuda.synchronize()
                prof.export_chrome_trace(path)
                per_replay = len(kernel_events(path))
                path = os.path.join(tmp, "many.json")
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.replays):
                        replay()
                    torch.cuda.synchronize()
                prof.export_chrome_trace(path)
                events = kernel_events(path)
            replays = split_replays(events, per_replay)
            if not replays:
                print(f"B={b}: no kernel events recorded (profiler cannot see graph kernels here)")
                continue
            tables = [marginal_table(r) for r in replays]
            spans = [span for span, _ in tables]
            print(f"B={b}: {per_replay} kernels per replay, span under the profiler "
                  f"{statistics.median(spans) / 1e3:.3f} ms (median of {len(spans)})")  # fmt: skip
            labels = tables[0][1].keys()
            merged = {
                label: (
                    tables[0][1][label][0],
                    statistics.median(t[1].get(label, (0, 0.0, 0.0))[1] for t in tables),
                    statistics.median(t[1].get(label, (0, 0.0, 0.0))[2] for t in tables),
                )
                for label in labels
            }
            print(f"{'marginal us':>12s} {'own us':>9s} {'n':>4s}  kernel [grid]")
            for label, (n, own, marginal) in sorted(merged.items(), key=lambda kv: -kv[1][2])[: args.top]:
                print(f"{marginal:12.1f} {own:9.1f} {n:4d}  {label}")
            by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
            for label, (_, own, marginal) in merged.items():
                by_name[label.split(" [")[0]][0] += marginal
                by_name[label.split(" [")[0]][1] += own
            print("by kernel:")
            for name, (marginal, own) in sorted(by_name.items(), key=lambda kv: -kv[1][0]):
                print(f"{marginal:12.1f} {own:9.1f}        {name}")


if __name__ == "__main__":
    main()
