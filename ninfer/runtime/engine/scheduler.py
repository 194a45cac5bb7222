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
from operator import attrgetter

from ninfer.runtime.engine.request_record import RequestRecord, RequestState


class UnitKind(enum.Enum):
    PREFILL = "prefill"  # one chunk of the staged prefill
    CONTROL = "control"  # forced-control tokens for one ControlReady request
    DECODE = "decode"  # one compact round of exactly the decode-ready requests


@dataclass(frozen=True, slots=True)
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
        self._decode_first = False  # the last unit was a prefill chunk or forced control
        self._last_nondecode: UnitKind | None = None
        self.protected_head: int | None = None  # request id of a head blocked by active incumbents
        self.donors: frozenset[int] = frozenset()  # incumbents that must end for the head to enter
        # the last decode round built, keyed by the decode-ready requests in the order they were offered
        self._decode_round: tuple[list[RequestRecord], Unit] | None = None

    # ---- FIFO ----
    @property
    def waiting(self) -> tuple[RequestRecord, ...]:
        return tuple(self._waiting)

    @property
    def has_waiting(self) -> bool:
        return bool(self._waiting)

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
    def next_unit(self, laned: Iterable[RequestRecord]) -> Unit | None:
        """Choose at most one execution unit among the requests holding a lane (after cancellations
        froze): the decode-ready and control-ready ones, and the staged prefill.

        Pure: the fairness state moves only when the unit runs (`started`), so a choice the worker
        discards (it re-chooses after a request ended meanwhile) leaves no trace. (The last decode
        round it keeps is only a cache of its own answer, never an input to the choice.)"""
        decode_state, control_state = RequestState.DECODE_READY, RequestState.CONTROL_READY
        decode_ready: list[RequestRecord] = []
        control_ready: list[RequestRecord] = []
        for r in laned:
            state = r.state
            if state is decode_state:
                decode_ready.append(r)
            elif state is control_state:
                control_ready.append(r)
        if not decode_ready:
            self._decode_round = None  # let the last round's (finished) requests go
        staged = self.staged
        prefill = staged if staged is not None and staged.state is RequestState.PREFILL else None
        control = min(control_ready, key=_by_publication) if control_ready else None

        # decode goes first after a prefill or control unit, else only when neither of those waits
        if decode_ready and (self._decode_first or (prefill is None and control is None)):
            # exactly the decode-ready requests, rows in publication order. Steady decode offers the
            # same requests in the same order every round and gets the same, immutable Unit back (the
            # round keeps its records alive, so an identical list means identical requests)
            last = self._decode_round
            if last is not None and last[0] == decode_ready:  # records compare by identity
                return last[1]
            unit = Unit(UnitKind.DECODE, tuple(sorted(decode_ready, key=_by_publication)))
            self._decode_round = (decode_ready, unit)
            return unit
        if prefill is not None and control is not None:
            # alternate the two non-decode kinds so neither starves the other
            if self._last_nondecode is UnitKind.CONTROL:
                return Unit(UnitKind.PREFILL, (prefill,))
            return Unit(UnitKind.CONTROL, (control,))
        if control is not None:
            return Unit(UnitKind.CONTROL, (control,))
        if prefill is not None:
            return Unit(UnitKind.PREFILL, (prefill,))
        return None

    def started(self, unit: Unit) -> None:
        """Record that ``unit`` runs: the fairness gates of the next choice depend on it."""
        self._decode_first = unit.kind is not UnitKind.DECODE
        if self._decode_first:
            self._last_nondecode = unit.kind

    def clear(self) -> list[RequestRecord]:
        """Drop all order state (Engine failure); returns the requests that were waiting."""
        waiting = list(self._waiting)
        self._waiting.clear()
        self.staged = None
        self.clear_protection()
        self._decode_round = None
        return waiting


_by_publication = attrgetter("publication_order")
