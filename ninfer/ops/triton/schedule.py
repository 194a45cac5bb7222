"""The PDL schedule of a step, recorded launch by launch, and the check of its memory ordering.

Under programmatic dependent launch (`pdl`) a kernel's code before its ``griddepcontrol.wait`` runs while
earlier kernels may still run, so what it reads there must have been written by kernels that are already
complete. Which kernels those are follows from the launch flags alone; this module records the flags and
the tensors of every launch and checks the reads against them.

The rule (launches numbered 0, 1, ... in stream order):

- Every kernel waits (``pdl.wait``) before anything but its early reads: the wait returns once launch
  i - 1 is complete and its writes are visible. So launch i completes only after launch i - 1 did: the
  complete launches are always a prefix 0 .. m.
- Launch i lets launch i + 1 start (``pdl.launch_dependents``) either after its wait (``pdl.enter``: i - 1
  is complete by then) or, with ``launch_next_early``, at its own start (``pdl.launch_next``), before its
  wait.
- When launch j's code before its wait runs, launch j - 1 has let it start. If j - 1 let it start after
  its own wait, launch j - 2 is complete. If j - 1 launched it early, j - 1 has only started, which it
  did once j - 2 let it: the same question one launch further back. So with g the latest launch before j
  that lets its successor start only after its own wait, every launch up to g - 1 is complete, and
  launches g .. j - 1 may still be running (none such g in the schedule: none of its launches is assumed
  complete).
- A read before j's wait is a race if its memory range overlaps what any of launches g .. j - 1 writes.
  Without early launches a kernel may read early what was written two launches back; each early launch
  in a row right before it adds one launch (three back after one early launch, as `norm`'s residual after
  the MoE block's early down launch: four back).

Overlap is by memory range (``data_ptr`` to the end of the tensor's hull: a strided view covers its gaps),
not by tensor identity, so views, aliases and reused allocations are caught. One read is of a pool of
which the step writes only part: the decode attention reads the K/V pages of every position before its
wait except each query's newest one (`KvPositions.ALL_BUT_NEWEST`), while the attention prologue writes
each of the step's tokens' own position (`KvPositions.STEP_TOKENS`). The two are disjoint exactly when
the step has one token per row (``tokens_per_row == 1``: each sequence's only new position is its
query's newest); with T > 1 a query's early positions include the T - 1 tokens of its row written before
it in the same step, so the attention must not read K/V early (`ninfer.ops.pdl_policy`). The check
needs the step's ``tokens_per_row`` for that; without it any such pair counts as a race.

Kernels outside PDL (cuBLAS, torch) start only once the kernel before them is complete and let the next
one start only when they finish. A composition may record them (`record_plain`); the check treats them as
kernels that launch their successor after their wait and read nothing early, which assumes less than
they guarantee. Unrecorded ones are invisible: the launches counted back from a read are then fewer
than ran, which only shrinks what the check assumes complete, and their writes are complete before the
next kernel starts, so no early read can race them. Work queued before the schedule opened is assumed
complete (a CUDA graph's first node waits for it).

Recording is active only inside `recorded_schedule` / `checked_schedule`, on the thread that opened it;
elsewhere a launch wrapper pays one module-attribute check (``if schedule.recording:``). The flags are
recorded as the wrappers pass them whether or not PDL is on (``pdl.ENABLED``), so a schedule recorded
on CPU under the Triton interpreter checks the same decisions the GPU runs.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

__all__ = [
    "KvPositions",
    "Launch",
    "Part",
    "PdlScheduleError",
    "Region",
    "Schedule",
    "check_schedule",
    "checked_schedule",
    "record",
    "record_plain",
    "recorded_schedule",
    "recording",
]

# True while a schedule is open on some thread: the launch wrappers' only work when nothing records
recording: bool = False
_open_count = 0
_count_lock = threading.Lock()
_local = threading.local()  # .stack: the schedules open on this thread, innermost last


class KvPositions(enum.Enum):
    """The part of a paged K/V pool an access touches (its byte range is the whole pool's)."""

    ALL_BUT_NEWEST = "every position but each query's newest"  # the decode attention's early loads
    STEP_TOKENS = "each step token's own position"  # the attention prologue's K/V writes


class Part(NamedTuple):
    """A tensor of which an access touches only `positions` (a value of `record`'s mappings)."""

    tensor: torch.Tensor
    positions: KvPositions


@dataclass(frozen=True)
class Region:
    """One tensor argument's memory: bytes [start, stop) (its hull), and the part touched if not all."""

    name: str
    start: int
    stop: int
    positions: KvPositions | None = None

    def describe(self) -> str:
        part = f", {self.positions.value}" if self.positions is not None else ""
        return f"`{self.name}` (bytes {self.start:#x}..{self.stop:#x}{part})"


@dataclass(frozen=True)
class Launch:
    """One recorded launch: what it reads before its PDL wait and what it writes (after the wait)."""

    index: int
    kernel: str
    launch_next_early: bool  # lets the next launch start before its own wait
    early_reads: tuple[Region, ...] = ()
    writes: tuple[Region, ...] = ()
    pdl: bool = True  # False: a kernel outside PDL (cuBLAS, torch) that a composition recorded


class PdlScheduleError(AssertionError):
    """A kernel reads before its PDL wait memory that a launch not yet complete may still be writing."""

    def __init__(self, reader: Launch, read: Region, writer: Launch, write: Region, gate: int) -> None:
        self.reader, self.read, self.writer, self.write = reader, read, writer, write
        self.distance = reader.index - writer.index
        j = reader.index
        back = f"{self.distance} launch{'es' if self.distance > 1 else ''} back"
        complete = f"launches 0..{gate - 1} are" if gate > 0 else "no launch of the schedule is"
        if gate < 0:
            why = f"every launch before {j} lets its successor start before its own wait"
        elif gate == j - 1:
            why = f"launch {gate} lets it start after its own wait"
        else:
            why = f"launch {gate} lets its successor start after its wait, {gate + 1}..{j - 1} before theirs"
        super().__init__(
            f"launch {j} `{reader.kernel}` reads {read.describe()} before its PDL wait, but launch "
            f"{writer.index} `{writer.kernel}` ({back}) writes {write.describe()} and may still be running: "
            f"{why}, so only {complete} complete when launch {j} starts"
        )


@dataclass
class Schedule:
    """The launches recorded while it was open; ``tokens_per_row``: the step's T, when uniform."""

    tokens_per_row: int | None = None
    launches: list[Launch] = field(default_factory=list)

    def check(self) -> None:
        """Raise `PdlScheduleError` at the first early read that a still-running launch may write."""
        check_schedule(self.launches, tokens_per_row=self.tokens_per_row)


def _hull(name: str, value: torch.Tensor | Part) -> Region | None:
    tensor, positions = (value.tensor, value.positions) if isinstance(value, Part) else (value, None)
    if tensor.numel() == 0:
        return None
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return Region(name, start, start + extent * tensor.element_size(), positions)


def _regions(accesses: Mapping[str, torch.Tensor | Part | None]) -> tuple[Region, ...]:
    regions = (_hull(name, value) for name, value in accesses.items() if value is not None)
    return tuple(region for region in regions if region is not None)


def record(
    kernel: str,
    *,
    launch_next_early: bool = False,
    early_reads: Mapping[str, torch.Tensor | Part | None] | None = None,
    writes: Mapping[str, torch.Tensor | Part | None] | None = None,
    pdl: bool = True,
) -> None:
    """Append one launch to this thread's innermost open schedule (none open: nothing happens).

    early_reads: every tensor the kernel reads before its PDL wait, by argument name; writes: every tensor
    it writes. None values are skipped (optional arguments). Call it only under ``if schedule.recording:``.
    """
    stack: list[Schedule] | None = getattr(_local, "stack", None)
    if not stack:
        return
    launches = stack[-1].launches
    launches.append(
        Launch(
            index=len(launches),
            kernel=kernel,
            launch_next_early=launch_next_early,
            early_reads=_regions(early_reads or {}),
            writes=_regions(writes or {}),
            pdl=pdl,
        )
    )


def record_plain(kernel: str, writes: Mapping[str, torch.Tensor | Part | None]) -> None:
    """Record a kernel outside PDL (a cuBLAS GEMM, a torch op) that a composition launches."""
    record(kernel, writes=writes, pdl=False)


def _overlap(read: Region, write: Region, tokens_per_row: int | None) -> bool:
    if read.start >= write.stop or write.start >= read.stop:
        return False
    # a query's early positions miss only its newest, the step writes its tokens': apart at one per row
    parts = (read.positions, write.positions) == (KvPositions.ALL_BUT_NEWEST, KvPositions.STEP_TOKENS)
    return not (parts and tokens_per_row == 1)


def check_schedule(launches: list[Launch], *, tokens_per_row: int | None = None) -> None:
    """Raise `PdlScheduleError` at the first read before a PDL wait that may race a running launch (the
    module docstring's rule); ``tokens_per_row``: the step's T (see `KvPositions`)."""
    gate = -1  # the latest launch so far that lets its successor start only after its own wait
    for j, launch in enumerate(launches):
        # launches 0 .. gate - 1 are complete when launch j starts; gate .. j - 1 may still run
        for read in launch.early_reads:
            for writer in launches[max(gate, 0) : j]:
                for write in writer.writes:
                    if _overlap(read, write, tokens_per_row):
                        raise PdlScheduleError(launch, read, writer, write, gate)
        if not launch.launch_next_early:
            gate = j


def _open(schedule: Schedule) -> None:
    global recording, _open_count
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(schedule)
    with _count_lock:
        _open_count += 1
        recording = True


def _close(schedule: Schedule) -> None:
    global recording, _open_count
    _local.stack.remove(schedule)
    with _count_lock:
        _open_count -= 1
        recording = _open_count > 0


@contextmanager
def recorded_schedule(*, tokens_per_row: int | None = None) -> Iterator[Schedule]:
    """Record every PDL launch (and the plain launches the compositions record) of this thread inside the
    block into the yielded `Schedule`, without checking it."""
    schedule = Schedule(tokens_per_row=tokens_per_row)
    _open(schedule)
    try:
        yield schedule
    finally:
        _close(schedule)


@contextmanager
def checked_schedule(*, tokens_per_row: int | None = None) -> Iterator[Schedule]:
    """`recorded_schedule`, then `Schedule.check` when the block ends without an exception: wrap a step's
    capture (or an eager step) to assert its launch distances. ``tokens_per_row``: the step's T when every
    row has T tokens (decode 1, a verify K + 1), else None."""
    with recorded_schedule(tokens_per_row=tokens_per_row) as schedule:
        yield schedule
    schedule.check()
