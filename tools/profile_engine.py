"""Where the Engine worker's host time goes between two decode steps: cProfile of the worker thread.

    python3 -m tools.profile_engine PACKAGE [--batch 1] [--context 2048] [--steps 64] [--kernels auto]

Starts the synthetic Engine exactly as `ninfer bench --synthetic PACKAGE` does, submits B requests and,
from an EngineCore observer (which runs on the worker thread before each unit), turns a cProfile on for
``--steps`` decode rounds of all B rows. Prints the unit interval without and with the profiler, then the
functions by own time and by cumulative time, per decode round. The device time of the step is the
replay time `tools.profile_step` reports; what this shows is the host work around it. On Python 3.12
cProfile records every thread, so the main thread's polling (`time.sleep`) appears in the totals too.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from ninfer.bench.startup import start_synthetic
from ninfer.types import EngineConfig, GenerationRequest


class DecodeProfiler:
    """Observer: times every decode round of ``rows`` rows, and profiles rounds skip..skip+steps."""

    def __init__(self, rows: int, skip: int, steps: int) -> None:
        self.rows, self.skip, self.steps = rows, skip, steps
        self.marks: list[float] = []
        self.profile = cProfile.Profile()
        self.profiled_marks: list[float] = []

    def __call__(self, core: object, unit: object) -> None:
        if unit.kind.value != "decode" or len(unit.members) != self.rows:  # type: ignore[attr-defined]
            return
        now = time.perf_counter()
        self.marks.append(now)
        seen = len(self.marks)
        if seen == self.skip:
            self.profile.enable()
        if self.skip <= seen <= self.skip + self.steps:
            self.profiled_marks.append(now)
        if seen == self.skip + self.steps:
            self.profile.disable()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("package")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--kernels", default="auto")
    args = parser.parse_args()
    skip = args.steps  # unprofiled rounds first: the baseline interval
    config = EngineConfig(
        max_concurrency=args.batch,
        queue_capacity=args.batch,
        queue_timeout_s=None,
        max_context=args.context + 3 * args.steps + 8,
        device="auto",
        cuda_graphs=True,
        kernels=args.kernels,  # type: ignore[arg-type]
        warmup=True,
    )
    started = start_synthetic(args.package, config, seed=0)
    engine = started.engine
    profiler = DecodeProfiler(args.batch, skip, args.steps)
    engine.core.observer = profiler
    try:
        gen = torch.Generator().manual_seed(0)
        handles = []
        for _ in range(args.batch):
            prompt = torch.randint(100, 8000, (args.context,), generator=gen).tolist()  # ordinary ids
            request = GenerationRequest(
                prompt=prompt, max_tokens=3 * args.steps + 4, temperature=0.0, ignore_eos=True
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

    baseline = median_ms(profiler.marks[1:skip])
    print(f"{args.package} B={args.batch}: decode round {baseline:.3f} ms unprofiled", flush=True)
    print(f"   profiled: {median_ms(profiler.profiled_marks):.3f} ms", flush=True)
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        stats = pstats.Stats(profiler.profile, stream=out)
        stats.sort_stats(order).print_stats(28)
        print(f"---- by {order} (totals over {args.steps} rounds)\n{out.getvalue()}", flush=True)


if __name__ == "__main__":
    main()
