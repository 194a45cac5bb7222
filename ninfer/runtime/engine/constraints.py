"""The Engine's side of structured outputs: a constrained request's matcher, guarded.

A request whose OutputSession has a ``constraint`` (``SessionConstraintLike``) gets a `RowGuard` on its
record. The Engine hands the guard to the Program with every unit of the request (the Program asks it
for the row's bitmasks right before it samples: ``RowConstraint``) and calls ``advance`` with the tokens
the Program committed, right after ``Program.commit``. An exception from the Frontend's matcher is the
request's own output error (``RequestFailed``), never the Engine's: ``masks`` records it and answers "no
mask" (the row's tokens are then discarded as a cancelled row of that unit), ``advance`` raises it to the
Committer, which ends only that request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ninfer.runtime.contract.constraint import SessionConstraintLike


class RowGuard:
    """A `RowConstraint` over one request's session constraint that never raises (see module doc)."""

    __slots__ = ("_constraint", "error")

    def __init__(self, constraint: SessionConstraintLike) -> None:
        self._constraint = constraint
        self.error: Exception | None = None

    def masks(self, drafts: Sequence[int]) -> Sequence[Any | None]:
        if self.error is None:
            try:
                masks = self._constraint.masks(drafts)
                if len(masks) == len(drafts) + 1:
                    return masks
                raise RuntimeError(f"masks({len(drafts)} drafts) gave {len(masks)} bitmasks")
            except Exception as exc:  # noqa: BLE001 - the request's output error, reported at commit
                self.error = exc
        return (None,) * (len(drafts) + 1)

    def advance(self, token_ids: Sequence[int], *, forced: bool = False) -> None:
        self._constraint.advance(token_ids, forced=forced)


def row_guard(session: object) -> RowGuard | None:
    """The guard of a session that has a constraint, else None."""
    constraint = getattr(session, "constraint", None)
    return None if constraint is None else RowGuard(constraint)
