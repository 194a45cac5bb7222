"""When the worker attempts an admission, and the (Program-proved) backfill hook.

Admission is re-examined only when a fact that can change its outcome changed: the waiting queue or its
head, a lane release, the staged-prefill gate, a resource transition ending, or the Program's
``resource_revision``. Ordinary decode progress, publication and statistics never re-run planning.
"""

from __future__ import annotations

from collections.abc import Sequence

from ninfer.runtime.contract.types import BackfillProver, RequestPlan, ResourcePlan, SequenceHandle


class AdmissionPolicy:
    """Gate and change tracking for admission attempts (one attempt per worker boundary at most)."""

    def __init__(self, prover: BackfillProver | None) -> None:
        self._prover = prover
        self._dirty = True
        self._blocked_at_revision: int | None = None

    def invalidate(self) -> None:
        """A fact that can change the admission outcome changed (see module docstring)."""
        self._dirty = True

    def should_attempt(
        self,
        *,
        lane_free: bool,
        transition_in_flight: bool,
        staged_prefill_busy: bool,
        resource_revision: int,
    ) -> bool:
        """Gates (the caller has a waiting head): a free lane, no open global transition, no staged
        prefill; then only when something relevant changed since the last blocked attempt."""
        if not lane_free or transition_in_flight or staged_prefill_busy:
            return False
        if self._blocked_at_revision is not None and resource_revision != self._blocked_at_revision:
            self._dirty = True
        return self._dirty

    def attempted(self, *, blocked: bool, resource_revision: int) -> None:
        """Record an attempt: a blocked head waits for the next relevant change."""
        if blocked:
            self._dirty = False
            self._blocked_at_revision = resource_revision
        else:
            self._dirty = True
            self._blocked_at_revision = None

    @property
    def can_backfill(self) -> bool:
        return self._prover is not None

    def prove_backfill(
        self, head: RequestPlan, donors: Sequence[SequenceHandle], borrower: RequestPlan
    ) -> ResourcePlan | None:
        """Ask the Program for a backfill proof; without the capability, backfill is always refused."""
        if self._prover is None:
            return None
        return self._prover.prove_backfill(head, donors, borrower)
