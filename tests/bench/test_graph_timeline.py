"""`tools.graph_timeline`'s accounting: each kernel's marginal time in a replay, from a profiler trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ninfer_tools.graph_timeline import (
    by_kernel,
    kernel_events,
    marginal_table,
    print_difference,
    split_replays,
)


def _trace(path: Path, kernels: list[tuple[str, float, float, list[int]]]) -> str:
    events = [
        {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"grid": grid}}
        for name, ts, dur, grid in kernels
    ]
    events.append({"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 99.0})  # not a kernel: ignored
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_marginal_times_sum_to_the_span_and_overlap_is_not_double_counted(tmp_path: Path) -> None:
    """Three kernels: b overlaps a (launched early), c starts after a gap; marginal = end - latest end."""
    path = _trace(tmp_path / "t.json", [
        ("b", 5.0, 10.0, [4, 1, 1]),  # 5..15, listed first: events are sorted by start
        ("a", 0.0, 10.0, [2, 1, 1]),  # 0..10
        ("c", 20.0, 2.0, [2, 1, 1]),  # 20..22 (a gap of 5 after b)
    ])  # fmt: skip
    events = kernel_events(path)
    assert [e["name"] for e in events] == ["a", "b", "c"]
    span, rows = marginal_table(events)
    assert span == 22.0
    assert rows == {
        "a [2, 1, 1]": (1, 10.0, 10.0),
        "b [4, 1, 1]": (1, 10.0, 5.0),
        "c [2, 1, 1]": (1, 2.0, 7.0),
    }
    assert sum(marginal for _, _, marginal in rows.values()) == span


def test_a_kernel_ending_inside_an_earlier_one_costs_nothing_and_replays_split_evenly(tmp_path: Path) -> None:
    path = _trace(tmp_path / "t.json", [
        ("long", 0.0, 10.0, [1, 1, 1]), ("short", 2.0, 3.0, [1, 1, 1]),
        ("long", 20.0, 10.0, [1, 1, 1]), ("short", 22.0, 3.0, [1, 1, 1]),
        ("long", 40.0, 1.0, [1, 1, 1]),  # an incomplete third replay is dropped
    ])  # fmt: skip
    replays = split_replays(kernel_events(path), 2)
    assert len(replays) == 2
    for replay in replays:
        span, rows = marginal_table(replay)
        assert span == 10.0 and rows["short [1, 1, 1]"] == (1, 3.0, 0.0)


def test_kernels_summed_by_name_and_the_difference_of_two_tables(capsys: pytest.CaptureFixture[str]) -> None:
    """`by_kernel` sums every grid of a kernel; `print_difference` lists b - a per kernel [grid], largest
    change first, a kernel only one side ran included, and the total."""
    a = {"gemv [8, 1, 1]": (2, 10.0, 6.0), "gemv [4, 1, 1]": (1, 3.0, 2.0), "norm [1, 1, 1]": (3, 3.0, 1.5)}
    b = {"gemv [8, 1, 1]": (2, 9.0, 5.0), "norm [1, 1, 1]": (3, 3.0, 1.5), "unpack [1, 1, 1]": (1, 2.0, 2.0)}
    assert by_kernel(a) == {"gemv": (8.0, 13.0), "norm": (1.5, 3.0)}

    print_difference(a, b, ("step", "engine"))

    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "marginal us: engine - step (launches step / engine)"
    assert [line.split()[0] for line in lines[1:]] == ["-2.0", "+2.0", "-1.0", "+0.0", "-1.0"]
    assert lines[1].split()[1:] == ["1/0", "gemv", "[4,", "1,", "1]"]
    assert lines[2].split()[1:3] == ["0/1", "unpack"]
    assert lines[-1].split() == ["-1.0", "in", "all"]
