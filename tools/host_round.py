"""The worker's host time between two decode steps, phase by phase (no profiler: perf_counter stamps).

    python3 -m tools.host_round PACKAGE [--batch 1] [--context 2048] [--rounds 64] [--device auto]
                                [--kernels auto] [--no-cuda-graphs] [--no-decode-lookahead]
                                [--gc default|freeze|off]

On the GPU the time from reading one round's tokens back to launching the next round is all GPU idle
time (`tools.profile_engine` measures it with CUDA events: 0.47-0.62 ms per 27B round at B = 1 on the
H200). This splits it along the Program's calls, wrapped on the synthetic Engine exactly as
`ninfer bench --synthetic` starts it:

    read        tokens read back (the end of the unit's one `tolist`)
    <decode     Program.decode returned (the pending rows built, its inference-mode exit)
    commit>     the Engine's checks and Frontend previews done, Program.commit called
    <commit     Program.commit returned
    decode>     the rest of the Engine's commit, the next boundary and the Scheduler: next decode call
    uniform>    decode's validation done, the backend asks the executor for the step
    packed      the step packed (`StepBuilder.uniform_values`); the input copy and the launch follow

and prints the median of every consecutive pair over the timed rounds. CPU numbers are only a relative
guide (the CPU's own forward pass between rounds evicts the caches this code runs from).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ninfer.bench.startup import start_synthetic
from ninfer.types import EngineConfig, GenerationRequest


class PhaseStamps:
    """Wraps the Program's phase boundaries with host time stamps."""

    def __init__(self, core: Any) -> None:
        self.stamps: list[tuple[str, float]] = []
        program = core.program
        for name in ("decode", "commit"):
            self._wrap(program, name, before=f"{name}>", after=f"<{name}")
        self._wrap(program.executor, "uniform", before="uniform>", after="<uniform")
        self._wrap(program.executor.steps, "uniform_values", before=None, after="packed")
        if program.executor.graphs is not None:
            self._wrap(program.executor.graphs, "run", before="replay>", after="<replay")
        # the Engine's side: its commit, the deferred publication, the next boundary and its choice
        for name in ("commit_unit", "publish_committed"):
            self._wrap(core.committer, name, before=f"{name}>", after=f"<{name}")
        self._wrap(core, "boundary", before="boundary>", after=None)
        self._wrap(core.scheduler, "next_unit", before=None, after="chosen")
        original_tolist = torch.Tensor.tolist

        def tolist(tensor: torch.Tensor) -> Any:
            out = original_tolist(tensor)
            self.stamps.append(("read", time.perf_counter()))
            return out

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]

    def _wrap(self, owner: Any, name: str, before: str | None, after: str | None) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                self.stamps.append((before, time.perf_counter()))
            out = original(*args, **kwargs)
            if after is not None:
                self.stamps.append((after, time.perf_counter()))
            return out

        setattr(owner, name, wrapped)

    def medians(self, skip: int) -> dict[str, tuple[int, float]]:
        spans: dict[str, list[float]] = {}
        for (a, ta), (b, tb) in zip(self.stamps, self.stamps[1:]):
            spans.setdefault(f"{a} -> {b}", []).append((tb - ta) * 1e6)
        return {k: (len(v), statistics.median(v[skip:])) for k, v in spans.items() if len(v) > 2 * skip}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("package")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--no-decode-lookahead", action="store_true")
    parser.add_argument("--gc", choices=("default", "freeze", "off"), default="default")
    args = parser.parse_args()
    config = EngineConfig(
        max_concurrency=args.batch,
        queue_capacity=args.batch,
        queue_timeout_s=None,
        max_context=args.context + args.rounds + 8,
        device=args.device,
        cuda_graphs=not args.no_cuda_graphs,
        decode_lookahead=False if args.no_decode_lookahead else None,
        kernels=args.kernels,  # type: ignore[arg-type]
        warmup=True,
    )
    engine = start_synthetic(args.package, config, seed=0).engine
    if args.gc == "freeze":
        gc.freeze()
    elif args.gc == "off":
        gc.disable()
    if not torch.cuda.is_available() or args.device == "cpu":
        torch.set_num_threads(1)  # idle intra-op threads spinning after the forward would steal the core
    stamps = PhaseStamps(engine.core)
    unit_starts: list[float] = []  # decode units of all B rows: the round as `ninfer bench` times it
    engine.core.observer = lambda core, unit: (
        unit_starts.append(time.perf_counter())
        if unit.kind.value == "decode" and len(unit.members) == args.batch
        else None
    )
    try:
        gen = torch.Generator().manual_seed(0)
        handles = [
            engine.submit(
                GenerationRequest(
                    prompt=torch.randint(100, 8000, (args.context,), generator=gen).tolist(),
                    max_tokens=args.rounds + 1,
                    temperature=0.0,
                    ignore_eos=True,
                )
            )
            for _ in range(args.batch)
        ]
        while not all(h.done for h in handles):
            time.sleep(0.005)
    finally:
        engine.close()
    rounds = [(b - a) * 1e3 for a, b in zip(unit_starts, unit_starts[1:])][16:]
    round_ms = statistics.median(rounds) if rounds else float("nan")
    print(f"{args.package} B={args.batch}: decode round {round_ms:.3f} ms (median, after the first 16)")
    print(f"{args.package} B={args.batch}: host time per phase (medians over the rounds after the first 16)")
    for span, (count, median) in stamps.medians(skip=16).items():
        print(f"   {span:28s} {median:9.1f} us   ({count} spans)")


if __name__ == "__main__":
    main()
