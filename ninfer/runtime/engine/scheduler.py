"""Scheduler: FIFO head, the one staged prefill, the prefill/control/decode fairness gate, compact rounds.

It owns request order only. It never reads resource vectors, allocator state or checkpoint payloads:
whether the head fits is the ResourceManager's question to the Program, and the answer cannot reorder
the FIFO (a blocked head stays the head; a backfill past it needs the Program's proof).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from ninfer.runtime.engine.request_record import RequestRecord, RequestState


class UnitKind(enum.Enum):
    PREFILL = "prefill"  # one chunk of the staged prefill
    CONTROL = "control"  # forced-control tokens for one ControlReady request
    DECODE = "decode"  # one compact round of exactly the decode-ready requests


@dataclass(frozen=True)
class Unit:
    """One model execution unit: what runs and for whom (rows in this order, exact B)."""

    kind: UnitKind
    members: tuple[RequestRecord, ...]


class Scheduler:
    """Request order and round membership (see docs/engine.md, "Scheduler").

    Guarantees: FIFO admission (only the head may be admitted, barring a proven backfill); at most one
    staged-prefill request (from materialization until its prompt is consumed); after a prefill or
    control unit, a decode round runs whenever any request is decode-ready, so decode waits at most one
    unit; a decode round holds all and only the decode-ready requests, never padded.
    """

    def __init__(self) -> None:
        self._waiting: deque[RequestRecord] = deque()
        self.staged: RequestRecord | None = None  # staged-prefill owner: Materializing or Prefill
        self._last_kind: UnitKind | None = None
        self._last_nondecode: UnitKind | None = None
        self.protected_head: int | None = None  # request id of a head blocked by active incumbents
        self.donors: frozenset[int] = frozenset()  # incumbents that must end for the head to enter

    # ---- FIFO ----
    @property
    def waiting(self) -> tuple[RequestRecord, ...]:
        return tuple(self._waiting)

    def enqueue(self, record: RequestRecord) -> None:
        self._waiting.append(record)

    def head(self) -> RequestRecord | None:
        return self._waiting[0] if self._waiting else None

    def behind_head(self) -> RequestRecord | None:
        """The first request after the head: the only backfill candidate (borrowers keep FIFO order)."""
        return self._waiting[1] if len(self._waiting) > 1 else None

    def take(self, record: RequestRecord) -> None:
        """Remove a request leaving Waiting (admitted, rejected, timed out or cancelled)."""
        self._waiting.remove(record)
        if self.protected_head == record.request_id:
            self.clear_protection()

    # ---- staged prefill ----
    def stage(self, record: RequestRecord) -> None:
        if self.staged is not None:
            raise AssertionError(
                f"staged prefill already owned by {self.staged.request_id}, not {record.request_id}"
            )
        self.staged = record

    def unstage(self, record: RequestRecord) -> None:
        if self.staged is record:
            self.staged = None

    # ---- protected head (blocked head bookkeeping) ----
    def protect(self, head: RequestRecord, donors: Iterable[int]) -> None:
        if self.protected_head != head.request_id:
            self.protected_head = head.request_id
            self.donors = frozenset(donors)

    def clear_protection(self) -> None:
        self.protected_head = None
        self.donors = frozenset()

    # ---- execution units ----
    def next_unit(self, active: Iterable[RequestRecord]) -> Unit | None:
        """Choose at most one execution unit among the active requests (after cancellations froze).

        Pure: the fairness state moves only when the unit runs (`started`), so a choice the worker
        discards (it re-chooses after a request ended meanwhile) leaves no trace."""
        decode_ready: list[RequestRecord] = []
        control_ready: list[RequestRecord] = []
        for r in active:
            if r.state is RequestState.DECODE_READY:
                decode_ready.append(r)
            elif r.state is RequestState.CONTROL_READY:
                control_ready.append(r)
        decode_ready.sort(key=lambda r: r.publication_order)
        staged = self.staged
        prefill = staged if staged is not None and staged.state is RequestState.PREFILL else None
        control = min(control_ready, key=lambda r: r.publication_order) if control_ready else None

        if decode_ready and self._last_kind in (UnitKind.PREFILL, UnitKind.CONTROL):
            return Unit(UnitKind.DECODE, tuple(decode_ready))
        if prefill is not None and control is not None:
            # alternate the two non-decode kinds so neither starves the other
            if self._last_nondecode is UnitKind.CONTROL:
                return Unit(UnitKind.PREFILL, (prefill,))
            return Unit(UnitKind.CONTROL, (control,))
        if control is not None:
            return Unit(UnitKind.CONTROL, (control,))
        if prefill is not None:
            return Unit(UnitKind.PREFILL, (prefill,))
        if decode_ready:
            return Unit(UnitKind.DECODE, tuple(decode_ready))
        return None

    def started(self, unit: Unit) -> None:
        """Record that ``unit`` runs: the fairness gates of the next choice depend on it."""
        self._last_kind = unit.kind
        if unit.kind is not UnitKind.DECODE:
            self._last_nondecode = unit.kind

    def clear(self) -> list[RequestRecord]:
        """Drop all order state (Engine failure); returns the requests that were waiting."""
        waiting = list(self._waiting)
        self._waiting.clear()
        self.staged = None
        self.clear_protection()
        return waiting
