"""A/B of a decode step's graph replay under environment settings, in one process on one GPU.

    python3 -m tools.ab_step PACKAGE --env NAME=A,B [--batch 1,8] [--rounds 3] [--context 2048]

Random weights of the package's exact dims (as `tools.profile_step`), bf16. For each round and each B,
every value of NAME is set in turn and the step is captured afresh in a CUDA graph, then its median
replay time printed. NAME must be read while the step is traced: an experiment patches such a switch into
the op it compares (the tree keeps none; docs/benchmarks.md names the ones used), and a setting read once
at import (`NINFER_PDL`) would time the same graph twice, so it is refused. Machines differ by more than
most changes (docs/benchmarks.md), so compare settings only within one run; the rounds interleave them,
odd rounds in reverse order.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from ninfer.targets.qwen3_6.model import StepBatch, forward
from tools.profile_step import PAGE_SIZE, graph_time_ms, make_batch, synthetic_decode_setup

_READ_AT_IMPORT = {"NINFER_PDL"}  # switches fixed when the op modules are imported


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("package")
    parser.add_argument("--env", required=True, help="NAME=A,B: the values of NAME to compare")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context", type=int, default=2048)
    args = parser.parse_args()
    name, _, values = args.env.partition("=")
    settings = values.split(",")
    if name in _READ_AT_IMPORT or len(settings) < 2:
        parser.error(f"--env {args.env!r}: need NAME=A,B with NAME read while tracing ({name} is not)")
    device = torch.device("cuda")
    batches = [int(b) for b in args.batch.split(",")]
    variant, view, kernels, store = synthetic_decode_setup(args.package, batches, args.context)
    times: dict[tuple[int, str], list[float]] = {(b, s): [] for b in batches for s in settings}
    with torch.inference_mode():
        for round_index in range(args.rounds):
            for b in batches:
                batch = make_batch(b, 1, args.context, PAGE_SIZE, device)
                # odd rounds take the settings in reverse: the first of a run measured slower in one
                # machine's A/B of two equal settings (27B B = 8, 14.994 against 14.895 ms)
                for setting in settings[:: -1 if round_index % 2 else 1]:
                    os.environ[name] = setting

                    def step(batch: StepBatch = batch) -> None:
                        forward(view, variant, batch, store, logits="last", kernels=kernels)

                    ms = graph_time_ms(step)
                    times[(b, setting)].append(ms)
                    print(f"B={b} {name}={setting}: {ms:.3f} ms", flush=True)
    for (b, setting), values_ms in times.items():
        print(f"median B={b} {name}={setting}: {statistics.median(values_ms):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
