"""Where the Engine worker's host time goes between two decode steps: cProfile of the worker thread.

    python3 -m tools.profile_engine PACKAGE [--batch 1] [--context 2048] [--steps 64] [--kernels auto]
                                   [--no-decode-lookahead]
                                   [--trace 16] [--gc default|freeze|off]

Starts the synthetic Engine exactly as `ninfer bench --synthetic PACKAGE` does, submits B requests and,
from an EngineCore observer (which runs on the worker thread before each unit), turns a cProfile on for
``--steps`` decode rounds of all B rows. Prints the unit interval without and with the profiler, then the
functions by own time and by cumulative time, per decode round. The device time of the step is the
replay time `tools.profile_step` reports; what this shows is the host work around it. On Python 3.12
cProfile records every thread, so the main thread's polling (`time.sleep`) appears in the totals too.

On CUDA, every decode round of B rows is also timed with CUDA events around the graph replay (no
profiler attached, so the figures are undistorted): the device time from just before the launch call to
the graph's end (launch latency + graph), the device time from one graph's end to the next launch (the
sampler's kernels where the rows need the sampler, the token read-back, the Engine's and the Program's
host work: the GPU idles), and the host time inside the replay call; after the Engine closes, the same
graph replays back to back, which is the graph's own time. Then ``--trace`` more rounds under the torch
profiler (host and device timelines): how long the host spends inside each graph launch
(`cudaGraphLaunch`), how long after the launch call began the graph's first kernel starts, and how long
the GPU sits idle between two rounds (the gaps between kernels longer than ``IDLE_GAP_US``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import time

import torch

from ninfer.bench.startup import start_synthetic
from ninfer.types import EngineConfig, GenerationRequest

IDLE_GAP_US = 20.0  # a gap between two kernels longer than this is the GPU waiting for the host


def _current_cpu() -> int:
    """The CPU this thread last ran on (field 39 of /proc/thread-self/stat), -1 where unknown."""
    try:
        with open("/proc/thread-self/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


class DecodeProfiler:
    """Observer: times every decode round of ``rows`` rows, profiles rounds skip..skip+steps (cProfile),
    then traces the next ``trace`` rounds (torch profiler, host and device)."""

    def __init__(self, rows: int, skip: int, steps: int, trace: int = 0) -> None:
        self.rows, self.skip, self.steps, self.trace = rows, skip, steps, trace
        self.marks: list[float] = []
        self.profile = cProfile.Profile()
        self.profiled_marks: list[float] = []
        self.tracer: torch.profiler.profile | None = None
        self.traced = False
        self.worker_cpus: list[int] = []

    def __call__(self, core: object, unit: object) -> None:
        if unit.kind.value != "decode" or len(unit.members) != self.rows:  # type: ignore[attr-defined]
            return
        now = time.perf_counter()
        self.marks.append(now)
        seen = len(self.marks)
        if seen in (1, self.skip):  # which CPU the worker runs on (Linux), outside the timed intervals
            self.worker_cpus.append(_current_cpu())
        if seen == self.skip:
            self.profile.enable()
        if self.skip <= seen <= self.skip + self.steps:
            self.profiled_marks.append(now)
        if seen == self.skip + self.steps:
            self.profile.disable()
        if self.trace and seen == self.skip + self.steps + 1:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self.tracer = torch.profiler.profile(activities=activities)
            self.tracer.__enter__()
        if self.tracer is not None and not self.traced and seen == self.skip + self.steps + 1 + self.trace:
            torch.cuda.synchronize()
            self.tracer.__exit__(None, None, None)
            self.traced = True


class ReplayTimer:
    """Wraps the B-row decode graph's `replay` with CUDA events and host stamps (median per round)."""

    def __init__(self, engine: object, rows: int, limit: int) -> None:
        from ninfer.targets.qwen3_6.impl.runtime import draws as program_module

        self.limit = limit  # rounds timed (the later ones run under cProfile and the tracer)

        program = engine.core.program  # type: ignore[attr-defined]
        self.graph = program.executor.graphs.graph(rows, 1)
        self.original = self.graph.replay
        self.rounds: list[tuple[torch.cuda.Event, torch.cuda.Event, float]] = []
        self.graph.replay = self.replay
        # host stamps: replay call start, sampler queued, tokens read back (end of tolist); and a device
        # event after the sampler's kernels
        self.stamps: list[tuple[str, float]] = []
        self.sampled: list[torch.cuda.Event] = []
        original_sample, original_tolist = program_module.sample, torch.Tensor.tolist

        def sample(*args: object, **kwargs: object) -> object:
            out = original_sample(*args, **kwargs)
            # a timed, replayed decode (not a prefill)
            if self.stamps and self.stamps[-1][0] == "launch" and len(self.sampled) < self.limit:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.sampled.append(event)
            return out

        def tolist(tensor: torch.Tensor) -> object:
            out = original_tolist(tensor)
            if len(self.rounds) <= self.limit:  # the tokens' host copy (pinned; a device tensor before)
                self.stamps.append(("read_back", time.perf_counter()))
            return out

        program_module.sample = sample
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]

    def replay(self) -> None:
        if len(self.rounds) >= self.limit:
            self.original()
            return
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        t0 = time.perf_counter()
        self.stamps.append(("launch", t0))
        self.original()
        host = time.perf_counter() - t0
        after.record()
        self.rounds.append((before, after, host))

    def summary(self, skip: int) -> dict[str, float]:
        torch.cuda.synchronize()
        rounds = self.rounds[skip:]
        sampler = [a.elapsed_time(s) * 1e3 for (_, a, _), s in zip(rounds, self.sampled[skip:])]
        host_after_read_back = [
            (t2 - t1) * 1e6
            for (n1, t1), (n2, t2) in zip(self.stamps, self.stamps[1:])
            if n1 == "read_back" and n2 == "launch"
        ][skip:]
        launch_and_graph = [b.elapsed_time(a) * 1e3 for b, a, _ in rounds]
        between = [p[1].elapsed_time(n[0]) * 1e3 for p, n in zip(rounds, rounds[1:])]
        host = [h * 1e6 for _, _, h in rounds]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            self.original()
        start.record()
        for _ in range(20):
            self.original()
        end.record()
        torch.cuda.synchronize()
        return {
            "rounds": float(len(rounds)),
            "graph_back_to_back_us": start.elapsed_time(end) * 1e3 / 20,
            "before_launch_to_graph_end_us": statistics.median(launch_and_graph),
            "graph_end_to_next_launch_us": statistics.median(between),
            "replay_call_host_us": statistics.median(host),
            # no sampler launches when every row is greedy: the graph's own argmax gives the tokens
            "graph_end_to_sampler_end_us": statistics.median(sampler) if sampler else float("nan"),
            "host_read_back_to_next_launch_us": statistics.median(host_after_read_back),
        }


def timeline_summary(tracer: torch.profiler.profile) -> dict[str, float]:
    """Medians over the traced rounds: host time inside `cudaGraphLaunch`, launch call to the first kernel
    after it, and the GPU's idle gaps (between kernels, longer than IDLE_GAP_US), all in microseconds."""
    launches, kernels = [], []
    for event in tracer.events():
        span = (event.time_range.start, event.time_range.end)
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append(span)
        elif event.name == "cudaGraphLaunch":
            launches.append(span)
    kernels.sort()
    if not launches or not kernels:
        return {}
    starts = [start for start, _ in kernels]
    first_kernel = []
    for start, _ in launches:
        later = [s for s in starts if s >= start]
        if later:
            first_kernel.append(later[0] - start)
    gaps = [b[0] - a[1] for a, b in zip(kernels, kernels[1:]) if b[0] - a[1] > IDLE_GAP_US]
    return {
        "rounds": float(len(launches)),
        "launch_host_us": statistics.median(end - start for start, end in launches),
        "launch_to_first_kernel_us": statistics.median(first_kernel) if first_kernel else float("nan"),
        "idle_gaps_per_round": len(gaps) / len(launches),
        "idle_us_per_round": sum(gaps) / len(launches),
        "longest_gap_us": max(gaps, default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("package")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--trace", type=int, default=16, help="rounds traced on CUDA (0: none)")
    parser.add_argument("--no-decode-lookahead", action="store_true", help="decode_lookahead off")
    parser.add_argument(
        "--gc", choices=("default", "freeze", "off"), default="default",
        help="after start-up: leave the collector alone, gc.freeze() the start-up heap, or gc.disable()",
    )  # fmt: skip
    args = parser.parse_args()
    skip = args.steps  # unprofiled rounds first: the baseline interval
    config = EngineConfig(
        max_concurrency=args.batch,
        queue_capacity=args.batch,
        queue_timeout_s=None,
        max_context=args.context + 3 * args.steps + args.trace + 8,
        device="auto",
        cuda_graphs=True,
        decode_lookahead=False if args.no_decode_lookahead else None,
        kernels=args.kernels,  # type: ignore[arg-type]
        warmup=True,
    )
    started = start_synthetic(args.package, config, seed=0)
    if args.gc == "freeze":
        gc.freeze()  # the start-up objects leave the generations the collector walks
    elif args.gc == "off":
        gc.disable()
    collections: list[tuple[float, int, float]] = []  # (start, generation, seconds), every thread
    started_at: dict[int, float] = {}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started_at[info["generation"]] = time.perf_counter()
        else:
            begun = started_at.pop(info["generation"], time.perf_counter())
            collections.append((begun, info["generation"], time.perf_counter() - begun))

    gc.callbacks.append(on_gc)
    engine = started.engine
    trace = args.trace if torch.cuda.is_available() else 0
    profiler = DecodeProfiler(args.batch, skip, args.steps, trace)
    engine.core.observer = profiler
    timer = ReplayTimer(engine, args.batch, limit=skip - 1) if torch.cuda.is_available() else None
    try:
        gen = torch.Generator().manual_seed(0)
        handles = []
        for _ in range(args.batch):
            prompt = torch.randint(100, 8000, (args.context,), generator=gen).tolist()  # ordinary ids
            request = GenerationRequest(
                prompt=prompt, max_tokens=3 * args.steps + trace + 4, temperature=0.0, ignore_eos=True
            )
            handles.append(engine.submit(request))
        while not all(h.done for h in handles):
            time.sleep(0.005)
        for handle in handles:
            handle.close()
    finally:
        engine.close()

    def median_ms(marks: list[float]) -> float:
        return statistics.median(b - a for a, b in zip(marks, marks[1:])) * 1e3

    gc.callbacks.remove(on_gc)
    print(f"worker thread on CPUs {profiler.worker_cpus}; main thread on CPU {_current_cpu()}", flush=True)
    baseline = median_ms(profiler.marks[1:skip])
    window = (profiler.marks[1], profiler.marks[skip - 1]) if len(profiler.marks) >= skip else (0.0, 0.0)
    timed = [(g, d) for t, g, d in collections if window[0] <= t <= window[1]]
    per_gen = {g: sum(1 for gen, _ in timed if gen == g) for g in (0, 1, 2)}
    print(
        f"gc ({args.gc}) during the {skip - 2} unprofiled rounds: {len(timed)} collections {per_gen}, "
        f"{sum(d for _, d in timed) * 1e3:.3f} ms in all, "
        f"longest {max((d for _, d in timed), default=0) * 1e6:.0f} us",
        flush=True,
    )
    print(f"{args.package} B={args.batch}: decode round {baseline:.3f} ms unprofiled", flush=True)
    print(f"   profiled: {median_ms(profiler.profiled_marks):.3f} ms", flush=True)
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        stats = pstats.Stats(profiler.profile, stream=out)
        stats.sort_stats(order).print_stats(28)
        print(f"---- by {order} (totals over {args.steps} rounds)\n{out.getvalue()}", flush=True)
    if timer is not None:
        print("---- decode rounds timed with CUDA events (medians, us; from the first unprofiled rounds)")
        for name, value in timer.summary(skip=2).items():
            print(f"   {name:32s} {value:10.1f}", flush=True)
    if profiler.tracer is not None and profiler.traced:
        summary = timeline_summary(profiler.tracer)
        print(f"---- device timeline over {trace} traced rounds (medians, us)", flush=True)
        for name, value in summary.items():
            print(f"   {name:28s} {value:10.1f}", flush=True)


if __name__ == "__main__":
    main()
