"""Where a decode graph's time goes, kernel by kernel, as the graph runs them (PDL overlap included).

    python3 -m tools.graph_timeline PACKAGE [--batch 1,8] [--context 2048] [--replays 5] [--top 30]
                                   [--tokens T] [--engine]

Random weights of the package's exact dims (as `tools.profile_step`), bf16 on CUDA. The decode step is
captured in a CUDA graph and replayed under the torch profiler, which records every kernel inside the
replay with its grid. Kernels overlap under programmatic dependent launch, so a kernel's own duration says
little; what this prints is each kernel's *marginal* time: how far it moved the latest end seen so far
(end - max(end of every earlier kernel), floored at 0), whose sum over a replay is the replay's span.
Summed by kernel name and grid (one row per distinct launch shape: gdn_in and gdn_out are both the GEMV
kernel, with different grids), medians over the replays. The profiler slows the launch a little, so the
span is a bit above `tools.profile_step`'s graph time; compare rows, not totals, across trees.

``--engine`` then does the same for the Engine's own captured graphs (`engine_graphs`: the input
unpacking and the argmax included, holding a real decode step of the synthetic Engine) and prints, per
kernel, its marginal time there minus in the step graph.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable

import torch

from ninfer.runtime.engine.engine import Engine
from ninfer.targets.qwen3_6.model import StepBatch, forward
from tools.kernel_bench.common import graphed, time_us
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


Table = dict[str, tuple[int, float, float]]  # label -> (launches, own us, marginal us), medians


def profile_replays(replay: Callable[[], None], replays: int) -> tuple[int, list[float], Table] | None:
    """(kernels per replay, spans, merged table) of ``replays`` replays under the profiler; None where the
    profiler sees no kernels inside a graph."""
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
            for _ in range(replays):
                replay()
            torch.cuda.synchronize()
        prof.export_chrome_trace(path)
        events = kernel_events(path)
    tables = [marginal_table(r) for r in split_replays(events, per_replay)]
    if not tables:
        return None
    merged = {
        label: (
            n,
            statistics.median(t[1].get(label, (0, 0.0, 0.0))[1] for t in tables),
            statistics.median(t[1].get(label, (0, 0.0, 0.0))[2] for t in tables),
        )
        for label, (n, _, _) in tables[0][1].items()
    }
    return per_replay, [span for span, _ in tables], merged


def by_kernel(table: Table) -> dict[str, tuple[float, float]]:
    """Marginal and own time summed per kernel name (every grid)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for label, (_, own, marginal) in table.items():
        row = out[label.split(" [")[0]]
        row[0] += marginal
        row[1] += own
    return {name: (m, o) for name, (m, o) in out.items()}


def print_timeline(title: str, result: tuple[int, list[float], Table] | None, top: int) -> None:
    if result is None:
        print(f"{title}: no kernel events recorded (profiler cannot see graph kernels here)")
        return
    per_replay, spans, merged = result
    print(f"{title}: {per_replay} kernels per replay, span under the profiler "
          f"{statistics.median(spans) / 1e3:.3f} ms (median of {len(spans)})")  # fmt: skip
    print(f"{'marginal us':>12s} {'own us':>9s} {'n':>4s}  kernel [grid]")
    for label, (n, own, marginal) in sorted(merged.items(), key=lambda kv: -kv[1][2])[:top]:
        print(f"{marginal:12.1f} {own:9.1f} {n:4d}  {label}")
    print("by kernel:")
    for name, (marginal, own) in sorted(by_kernel(merged).items(), key=lambda kv: -kv[1][0]):
        print(f"{marginal:12.1f} {own:9.1f}        {name}")


def print_difference(a: Table, b: Table, names: tuple[str, str]) -> None:
    """Per kernel [grid]: marginal time in ``b`` minus ``a``, largest first (launch counts beside)."""
    print(f"marginal us: {names[1]} - {names[0]} (launches {names[0]} / {names[1]})")
    rows = []
    for label in a.keys() | b.keys():
        na, _, ma = a.get(label, (0, 0.0, 0.0))
        nb, _, mb = b.get(label, (0, 0.0, 0.0))
        rows.append((mb - ma, na, nb, label))
    for diff, na, nb, label in sorted(rows, key=lambda r: (-abs(r[0]), r[3]))[:30]:  # ties by label
        print(f"{diff:+10.1f} {na:4d}/{nb:<4d} {label}")
    print(f"{sum(r[0] for r in rows):+10.1f} in all")


def engine_graphs(
    package: str, batches: list[int], context: int
) -> tuple[Engine, dict[int, Callable[[], None]]]:
    """The Engine's own decode graphs (the synthetic Engine `ninfer bench --synthetic` starts), each left
    holding a real decode step of B rows at about ``context`` positions: B requests decoded until every
    B-row graph replayed a few rounds, then the Engine closed. Returns (the closed Engine, which keeps the
    graphs' buffers alive; B -> the replay). Raises RuntimeError where a B-row round never ran."""
    from ninfer.bench.drive import ROUND_SLACK, BenchPlan
    from ninfer.bench.startup import start_synthetic
    from ninfer.types import EngineConfig, GenerationRequest, default_prefill_chunk

    # the bench's own budget: the first request decodes while the others prefill, one after the other
    plan = BenchPlan(
        batches=tuple(batches), context=context, decode_steps=ROUND_SLACK, prefill_tokens=context,
        prefill_repeats=1, prefill_chunk=default_prefill_chunk("fast"),
    )  # fmt: skip
    config = EngineConfig(
        max_concurrency=max(batches), queue_capacity=max(batches), queue_timeout_s=None,
        max_context=plan.max_context, device="auto", cuda_graphs=True, warmup=True,
    )  # fmt: skip
    engine = start_synthetic(package, config, seed=0).engine
    graphs = engine.core.program.executor.graphs  # type: ignore[attr-defined]
    replays: dict[int, Callable[[], None]] = {}
    try:
        gen = torch.Generator().manual_seed(0)
        for b in batches:
            before = graphs.replays.get((b, 1), 0)
            requests = [
                GenerationRequest(prompt=torch.randint(100, 8000, (context,), generator=gen).tolist(),
                                  max_tokens=plan.decode_max_tokens(b), temperature=0.0, ignore_eos=True)
                for _ in range(b)
            ]  # fmt: skip
            handles = [engine.submit(r) for r in requests]
            for handle in handles:
                handle.result()
            if graphs.replays.get((b, 1), 0) == before:  # it would still hold the capture's placeholder step
                raise RuntimeError(f"no decode round of {b} rows ran")
            replays[b] = graphs.graph(b, 1).replay  # holds B rows' last decode step
    finally:
        engine.close()
    return engine, replays


def step_timelines(
    package: str, batches: list[int], context: int, replays: int, top: int, tokens: int = 1
) -> dict[int, tuple[int, list[float], Table] | None]:
    """The model's decode step alone (`forward` over a prepared `StepBatch`), graphed, per B; ``tokens`` >
    1: a speculative verify's step of B rows x T tokens (states per position, logits at every token)."""
    device = torch.device("cuda")
    results = {}
    variant, view, kernels, store = synthetic_decode_setup(package, batches, context, tokens_per_row=tokens)
    mode = "all" if tokens > 1 else "last"
    with torch.inference_mode():
        for b in batches:
            batch = make_batch(b, tokens, context, PAGE_SIZE, device, verify=tokens > 1)

            def step(batch: StepBatch = batch) -> None:
                forward(view, variant, batch, store, logits=mode, kernels=kernels)

            title = f"B={b}" + (f" T={tokens}" if tokens > 1 else "")
            print(f"{title}: graph replay {graph_time_ms(step):.3f} ms (no profiler)", flush=True)
            results[b] = profile_replays(graphed(step), replays)
            print_timeline(title, results[b], top)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("package")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--tokens", type=int, default=1,
        help="tokens per row: T > 1 times a speculative verify's (B, T) step instead of the decode step",
    )  # fmt: skip
    parser.add_argument(
        "--engine", action="store_true",
        help="then the Engine's own captured graphs (input unpacking and argmax included), and the "
        "difference per kernel against the step graph",
    )  # fmt: skip
    args = parser.parse_args()
    if args.tokens < 1 or (args.engine and args.tokens > 1):
        parser.error("--tokens must be >= 1, and 1 with --engine (the Engine's graphs compared are decode's)")
    batches = [int(b) for b in args.batch.split(",")]
    results = step_timelines(args.package, batches, args.context, args.replays, args.top, args.tokens)
    if not args.engine:
        return
    gc.collect()  # the step's weights go (one package's weights at a time fit on the device)
    torch.cuda.empty_cache()
    engine, replays = engine_graphs(args.package, batches, args.context)
    for b, replay in replays.items():
        print(f"B={b}: the Engine's graph {time_us(replay) / 1e3:.3f} ms (no profiler)", flush=True)
        engine_result = profile_replays(replay, args.replays)
        print_timeline(f"B={b} (the Engine's graph)", engine_result, args.top)
        if results[b] is not None and engine_result is not None:
            print_difference(results[b][2], engine_result[2], ("step", "engine"))


if __name__ == "__main__":
    main()
