"""How a CUDA graph's launch latency grows with its node count, and what splitting it buys.

    python3 -m tools.kernel_bench.graph_launch

A chain of N tiny kernels (Triton, with and without programmatic dependent launch; torch elementwise;
torch with a memset node every 16 kernels) is captured once, then timed two ways: back to back (20
replays between two events: the graph's own device time) and from idle (an event recorded just before
each launch on an idle GPU to the graph's end, median of 20: launch latency + graph). The difference is
what a decode round pays for launching its graph after the host read back the previous tokens. Last, the
same N kernels captured as 4 graphs launched one after the other.
"""

from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl


@triton.jit
def _bump(x_ptr, USE_PDL: tl.constexpr):
    pdl.enter(USE_PDL)
    offs = tl.arange(0, 256)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1.0)


def _chain(kind: str, n: int, x: torch.Tensor) -> None:
    for i in range(n):
        if kind == "triton_pdl":
            _bump[(1,)](x, USE_PDL=True, launch_pdl=True)
        elif kind == "triton":
            _bump[(1,)](x, USE_PDL=False)
        elif kind == "torch_memset" and i % 16 == 0:
            x[:1].zero_()
        else:
            x.add_(1.0)


def _capture(kind: str, n: int, x: torch.Tensor, pieces: int) -> list[torch.cuda.CUDAGraph]:
    _chain(kind, n, x)
    torch.cuda.synchronize()
    graphs = []
    for _ in range(pieces):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            _chain(kind, n // pieces, x)
        graphs.append(g)
    return graphs


def _time(graphs: list[torch.cuda.CUDAGraph]) -> tuple[float, float, float]:
    def launch() -> None:
        for g in graphs:
            g.replay()

    for _ in range(3):
        launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        launch()
    end.record()
    torch.cuda.synchronize()
    back_to_back = start.elapsed_time(end) * 1e3 / 20
    from_idle, host = [], []
    for _ in range(20):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        time.sleep(0.001)
        before.record()
        t0 = time.perf_counter()
        launch()
        host.append((time.perf_counter() - t0) * 1e6)
        after.record()
        torch.cuda.synchronize()
        from_idle.append(before.elapsed_time(after) * 1e3)
    return back_to_back, statistics.median(from_idle), statistics.median(host)


def main() -> None:
    x = torch.zeros(256, device="cuda")
    print(
        f"{'kernels':>22s} {'N':>5s} {'pieces':>6s} {'back-to-back us':>16s} {'from idle us':>13s} "
        f"{'latency us':>11s} {'host launch us':>15s}"
    )
    kinds = (
        ["triton_pdl", "triton", "torch", "torch_memset"]
        if pdl.ENABLED
        else ["triton", "torch", "torch_memset"]
    )
    for kind in kinds:
        for n, pieces in ((100, 1), (700, 1), (700, 4)):
            b2b, idle, host = _time(_capture(kind, n, x, pieces))
            print(
                f"{kind:>22s} {n:5d} {pieces:6d} {b2b:16.1f} {idle:13.1f} {idle - b2b:11.1f} {host:15.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
