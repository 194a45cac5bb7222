"""Where the time of the serving workload goes inside the Engine: a timeline of its execution units.

    python3 -m tools.serving_timeline PACKAGE [--concurrency 4] [--prompt-tokens 1024] [--max-tokens 128]
                                      [--requests 2] [--json FILE] [BENCH FLAGS...]

Every flag but PACKAGE and ``--json`` is `ninfer bench`'s; ``--concurrency`` and ``--requests``
default to 4 and 2 here.

Runs ``ninfer bench --synthetic PACKAGE --concurrency ...`` in-process (the serving workload of
`ninfer.bench.serving`, the same Engine settings), with an EngineCore observer that stamps every unit
as the worker starts it (kind, rows, prefill tokens). A unit's interval is the time to the next unit's
stamp: its own time plus the boundary after it, and any idle wait. Beside the units it records the
Python garbage collector's pauses (``gc.callbacks``) and the Triton kernels compiled meanwhile (files
the run added to ``$TRITON_CACHE_DIR``, stamped by their modification time, i.e. when a compile ended).

Prints, per phase (the warm-up and each concurrency level): the units by kind and rows (count, total,
mean, p50, max), then the slowest units with the compiles and collections that fell inside them, then
the levels' TTFT/TPOT. ``--json`` writes every unit, pause and compile.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

SLOWEST = 25  # the slowest units listed
GC_PAUSE_S = 0.001  # collections shorter than this are only counted


@dataclass
class UnitStamp:
    t: float  # perf_counter when the worker started the unit
    phase: str
    kind: str
    rows: int
    record: Any = None  # the prefill's RequestRecord (its remaining prompt is read at the next stamp)
    remaining_before: int = 0
    tokens: int = 0  # prefill tokens the unit consumed
    interval_s: float = 0.0


@dataclass
class Timeline:
    phase: str = "start"
    units: list[UnitStamp] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)
    gc_pauses: list[tuple[float, float, int]] = field(default_factory=list)  # (start, seconds, generation)
    gc_count: int = 0
    _gc_start: float = 0.0

    def observe(self, _core: object, unit: Any) -> None:
        now = time.perf_counter()
        self._settle_last()
        stamp = UnitStamp(now, self.phase, unit.kind.value, len(unit.members))
        if stamp.kind == "prefill":
            stamp.record = unit.members[0]
            stamp.remaining_before = unit.members[0].prompt_remaining
        self.units.append(stamp)

    def _settle_last(self) -> None:
        if self.units and self.units[-1].record is not None:
            last = self.units[-1]
            last.tokens = last.remaining_before - last.record.prompt_remaining
            last.record = None

    def log(self, line: str) -> None:
        print(f"serving_timeline: {line}", file=sys.stderr, flush=True)
        if line.startswith("warm-up"):
            self.phase = "warm-up"
        elif "stream(s)" in line:
            self.phase = "C=" + line.split()[0]
        self.marks.append((time.perf_counter(), self.phase))

    def gc_callback(self, event: str, info: dict[str, int]) -> None:
        if event == "start":
            self._gc_start = time.perf_counter()
            return
        self.gc_count += 1
        took = time.perf_counter() - self._gc_start
        if took >= GC_PAUSE_S:
            self.gc_pauses.append((self._gc_start, took, info.get("generation", -1)))

    def close(self, end: float) -> None:
        self._settle_last()
        for unit, after in zip(self.units, self.units[1:]):
            unit.interval_s = after.t - unit.t
        if self.units:
            self.units[-1].interval_s = end - self.units[-1].t


def compiled_since(wall_start: float, perf_start: float) -> list[tuple[float, str]]:
    """(perf_counter time, kernel name) of every Triton kernel compiled since ``wall_start``."""
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    found = []
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".json") or name.startswith("__grp__"):
                continue
            mtime = os.path.getmtime(os.path.join(folder, name))
            if mtime >= wall_start:
                found.append((perf_start + (mtime - wall_start), name.removesuffix(".json")))
    return sorted(found)


def _ms(values: list[float]) -> str:
    mean, median, top = statistics.fmean(values), statistics.median(values), max(values)
    return f"{mean * 1e3:9.2f} {median * 1e3:9.2f} {top * 1e3:9.2f}"


def render(timeline: Timeline, compiles: list[tuple[float, str]], t0: float) -> list[str]:
    lines = []
    groups: dict[tuple[str, str, int], list[UnitStamp]] = defaultdict(list)
    for unit in timeline.units:
        groups[(unit.phase, unit.kind, unit.rows)].append(unit)
    lines.append(
        f"{'phase':>8} {'kind':>8} {'rows':>4} {'count':>6} {'total s':>8} {'mean ms':>9} "
        f"{'p50 ms':>9} {'max ms':>9} {'tokens':>7}"
    )
    for (phase, kind, rows), units in groups.items():
        intervals = [u.interval_s for u in units]
        lines.append(
            f"{phase:>8} {kind:>8} {rows:>4} {len(units):>6} {sum(intervals):>8.3f} {_ms(intervals)} "
            f"{sum(u.tokens for u in units):>7}"
        )
    lines.append(f"slowest {SLOWEST} units (offset from the first unit; compiles and GC pauses inside):")
    for unit in sorted(timeline.units, key=lambda u: -u.interval_s)[:SLOWEST]:
        end = unit.t + unit.interval_s
        inside = [name for at, name in compiles if unit.t <= at < end]
        pauses = [round(s * 1e3, 1) for at, s, _ in timeline.gc_pauses if unit.t <= at < end]
        lines.append(
            f"  +{unit.t - t0:8.3f}s {unit.phase:>8} {unit.kind:>8} rows={unit.rows} tokens={unit.tokens:<5} "
            f"{unit.interval_s * 1e3:9.2f} ms compiles={len(inside)} {sorted(set(inside))[:6]} gc_ms={pauses}"
        )
    pauses = [s for _, s, _ in timeline.gc_pauses]
    lines.append(
        f"gc: {timeline.gc_count} collections, {len(pauses)} >= {GC_PAUSE_S * 1e3:.0f} ms, "
        f"{sum(pauses) * 1e3:.1f} ms in those, max {max(pauses, default=0) * 1e3:.1f} ms"
    )
    by_phase: dict[str, int] = defaultdict(int)
    for at, _ in compiles:
        phase = "start"
        for mark_t, mark in timeline.marks:
            if mark_t <= at:
                phase = mark
        by_phase[phase] += 1
    lines.append(f"triton compiles by phase: {dict(by_phase)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    from ninfer.bench.serving import run_engine
    from ninfer.cli.bench_serving import engine_options, flag_problem, serving_plan
    from ninfer.cli.main import build_parser

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("package")
    p.add_argument("--json", default=None, help="write every unit, GC pause and compile here")
    a, flags = p.parse_known_args(argv)  # the rest: `ninfer bench` serving and Engine flags
    # this tool's defaults first: a flag given again later wins
    bench_argv = ["bench", "--synthetic", a.package, "--concurrency", "4", "--requests", "2", *flags]
    args = build_parser(only="bench").parse_args(bench_argv)
    problem = flag_problem(args)
    if problem is not None:
        raise SystemExit(f"serving_timeline: {problem}")
    plan = serving_plan(args)
    timeline = Timeline()
    wall_start, perf_start = time.time(), time.perf_counter()

    def attach(engine: Any) -> None:
        engine.core.observer = timeline.observe

    gc.callbacks.append(timeline.gc_callback)
    try:
        report = run_engine(engine_options(args, plan), plan, log=timeline.log, on_start=attach)
    finally:
        gc.callbacks.remove(timeline.gc_callback)
    timeline.close(time.perf_counter())
    compiles = compiled_since(wall_start, perf_start)
    t0 = timeline.units[0].t if timeline.units else perf_start
    for line in render(timeline, compiles, t0):
        print(line)
    for level in report.to_json()["levels"]:
        print(
            f"C={level['concurrency']}: {level['output_tok_s']} tok/s, "
            f"TTFT p50 {level['ttft_ms']['p50']} ms, "
            f"TPOT p50 {level['tpot_ms']['p50']} ms, ITL p99 {level['itl_ms']['p99']} ms"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "report": report.to_json(),
                    "units": [
                        [round(u.t - t0, 6), u.phase, u.kind, u.rows, u.tokens, round(u.interval_s, 6)]
                        for u in timeline.units
                    ],
                    "gc_pauses": [[round(t - t0, 6), round(s, 6), g] for t, s, g in timeline.gc_pauses],
                    "compiles": [[round(t - t0, 6), name] for t, name in compiles],
                },
                f,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
