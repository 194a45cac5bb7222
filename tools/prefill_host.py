"""The host cost of one prefill chunk: where a small chunk's time goes when the GPU is not the limit.

    python3 -m tools.prefill_host PACKAGE [--tokens 64,1024] [--context 0] [--kernels fast] [--rows 30]

Random weights of the package's exact dims on CUDA (as `tools.profile_step`). For each chunk size: the
model's eager ``forward`` over one row of ``--tokens`` new tokens after ``--context`` cached positions,
timed three ways (median of 7 calls): the host's enqueue time (the call returning, no sync), the device
time (CUDA events around the call) and the wall time with a sync. Then one call under cProfile: the
functions by own time and by cumulative time (``--rows`` of each). Where the enqueue time is the wall
time, the chunk is host-bound and the profile says which Python pays for it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from ninfer.targets.qwen3_6.model import forward
from tools.profile_step import PAGE_SIZE, make_batch, synthetic_decode_setup


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("package")
    parser.add_argument("--tokens", default="64,1024")
    parser.add_argument("--context", type=int, default=0, help="cached positions before the chunk")
    parser.add_argument("--kernels", default="fast")
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    sizes = [int(n) for n in args.tokens.split(",")]
    device = torch.device("cuda")
    variant, view, kernels, store = synthetic_decode_setup(
        args.package, [1], args.context + max(sizes), args.kernels
    )
    with torch.inference_mode():
        for tokens in sizes:
            batch = make_batch(1, tokens, args.context + tokens, PAGE_SIZE, device)

            def chunk(batch: object = batch) -> None:
                forward(view, variant, batch, store, logits="last", kernels=kernels)

            for _ in range(3):
                chunk()
            torch.cuda.synchronize()
            enqueue, device_ms, wall = [], [], []
            for _ in range(7):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                chunk()
                end.record()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                enqueue.append((t1 - t0) * 1e3)
                wall.append((t2 - t0) * 1e3)
                device_ms.append(start.elapsed_time(end))
            print(
                f"{args.package} prefill {tokens} tokens after {args.context}: enqueue "
                f"{statistics.median(enqueue):.2f} ms, device {statistics.median(device_ms):.2f} ms, "
                f"wall {statistics.median(wall):.2f} ms",
                flush=True,
            )
            profile = cProfile.Profile()
            profile.enable()
            chunk()
            profile.disable()
            torch.cuda.synchronize()
            for order in ("tottime", "cumulative"):
                out = io.StringIO()
                pstats.Stats(profile, stream=out).sort_stats(order).print_stats(args.rows)
                text = out.getvalue()
                print(text[text.find("   ncalls") :], flush=True)


if __name__ == "__main__":
    main()
