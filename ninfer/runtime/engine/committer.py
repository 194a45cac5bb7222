"""The commit and publication pipeline of one execution unit (worker boundary steps 8 and 9).

For every unit that yields a `PendingBatch`, in the specification's order:

    Frontend preview (per row)
    -> RowDecision per row -> Program.commit(batch, decisions)   (nothing is visible before this)
    -> terminal rows: the terminal resource transition, adopted; lane Free
    -> budget and scheduler accounting
    -> OutputSession.commit(preview) -> publish the delta; terminal rows: the result

Rows that go on generating finish the last two steps one boundary later, while the next decode unit is
on the device (`publish_committed`, called back by the Program after it queued the unit): the
Frontend's text work and the consumers' wake-ups then overlap the GPU. A request's events keep their
order: any other unit, and a boundary with no unit, publish the deferred rows first, so no request
completes with one unpublished (`EngineCore.finish` checks it).

An exception from one row's OutputSession ends only that request (``RequestFailed``): in preview it
becomes a cancelled row, so the batch is still consumed whole by one commit; in commit it goes
TerminalPending and is released; in finish its resources are already released.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

from ninfer.runtime.contract.frontend import OutputDeltaLike, OutputPreviewLike
from ninfer.runtime.contract.types import PendingBatch, PendingRow, RowDecision, TokenLogprob
from ninfer.runtime.engine.request_record import RequestRecord, RequestState
from ninfer.runtime.engine.resource_manager import EngineInvariantError
from ninfer.types import FinishReason, GenerationDelta, RequestFailed, ToolCallDelta

if TYPE_CHECKING:
    from ninfer.runtime.engine.engine_core import EngineCore

log = logging.getLogger("ninfer.engine")


class Unpublished(NamedTuple):
    """A committed row of a still-generating request whose OutputSession commit and publication wait
    for the next decode unit to be launched. The row accepted all it produced (it is not terminal).
    (A NamedTuple: one is built per row per round, and a frozen dataclass costs about 1 us more.)"""

    record: RequestRecord
    preview: OutputPreviewLike
    row: PendingRow


class _Ending(NamedTuple):
    """A row of a unit whose request ends with it (stop, length, cancel, error): committed, then its
    resources released and its response completed in the same boundary."""

    row: PendingRow
    record: RequestRecord
    preview: OutputPreviewLike | None  # None: a cancelled row (cancellation or an output error)
    reason: FinishReason
    error: RequestFailed | None


class Committer:
    """Steps 8-9 of a worker boundary for the `EngineCore` that owns it."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self.unpublished: list[Unpublished] = []  # see publish_committed

    def commit_unit(self, batch: PendingBatch, members: tuple[RequestRecord, ...]) -> None:
        """Preview -> Program commit -> terminal resources -> budget -> OutputSession commit -> publish.

        The caller checked the rows' membership: one row per member, in order, with its handle."""
        core = self._core
        sampled = batch.kind != "force"
        decisions: list[RowDecision] = []
        # rows that go on generating (they accept all they produced) and rows whose request ends here,
        # both in row order
        continuing: list[Unpublished] = []
        ending: list[_Ending] = []
        for row, record in zip(batch.rows, members):
            preview: OutputPreviewLike | None = None
            error = record.output_error  # a deferred OutputSession commit failed while the unit ran
            if error is None and record.constraint is not None and record.constraint.error is not None:
                error = self.output_error(record, "constraint.masks", record.constraint.error)
            # else a cancellation observed while the unit ran: both make a cancelled row
            if error is None and not record.channel.cancel_requested:
                try:
                    preview = record.session.preview(row.tokens)
                except Exception as exc:  # noqa: BLE001 - a per-request output error, not the Engine's
                    error = self.output_error(record, "preview", exc)
            if preview is None:
                decisions.append(RowDecision(row.handle, 0, terminal=True, cancelled=True))
                cancelled_as: FinishReason = "error" if error is not None else "cancelled"
                ending.append(_Ending(row, record, None, cancelled_as, error))
                continue
            accepted = preview.accepted
            produced = len(row.tokens)
            if not 1 <= accepted <= produced or (accepted < produced and not preview.stop):
                raise EngineInvariantError(
                    f"Frontend preview accepted {accepted} of {produced} tokens (stop={preview.stop})"
                )
            if (
                sampled
                and record.plan.logprobs.enabled
                and (row.logprobs is None or len(row.logprobs) != produced)
            ):
                raise EngineInvariantError("a row of a logprob request lacks one logprob per token")
            reason: FinishReason | None = None
            if preview.stop:
                reason = "stop"
            elif record.generated + accepted >= record.plan.max_new_tokens:
                reason = "length"
            if reason is None:
                decisions.append(RowDecision(row.handle, accepted))
                continuing.append(Unpublished(record, preview, row))
            else:
                boundaries = self._turn_boundaries(record, preview, reason)
                decisions.append(RowDecision(row.handle, accepted, terminal=True, boundaries=boundaries))
                ending.append(_Ending(row, record, preview, reason, None))
        # No validate_decisions here: the Program runs it in commit (contract rules 5-6: a mismatched
        # disposition is its ProgramInvariantError, which fails the Engine), and these decisions are
        # legal by construction: one per row, in row order, with the row's handle; a cancelled row
        # accepts 0 and is terminal; every other row passed the accepted/produced/stop check above, and
        # one that accepts fewer than it produced stops, so it is terminal.

        # Program commits the accepted model state first; nothing is visible before this succeeds.
        core.program.commit(batch, decisions)
        core.open_batch = None
        # structured outputs: a row that goes on moves its grammar matcher by what the Program committed,
        # now (its next unit's mask depends on it; its OutputSession commit may be deferred)
        for record, _preview, row in continuing:
            if record.constraint is not None:
                self._advance_constraint(record, row, forced=not sampled)

        # terminal resource results, adopted before any lane or output change becomes visible
        for end in ending:
            core.enter_terminal(end.record, end.reason)
            core.settle_resources(end.record)

        # generation budget and scheduler accounting
        for end in ending:
            if end.preview is not None:  # a cancelled row accepts nothing
                end.record.generated += end.preview.accepted
                end.record.count_drafts(end.row.drafted, min(end.row.draft_hits, end.preview.accepted))
        for record, preview, row in continuing:
            record.generated += len(row.tokens)
            record.count_drafts(row.drafted, row.draft_hits)
            if record.state is RequestState.PREFILL:
                record.prompt_remaining = 0
                core.prefill_done(record)
            record.control_horizon = getattr(preview, "control_horizon", None)
            force = tuple(preview.force_tokens)[: record.remaining_budget] if preview.force_tokens else ()
            record.pending_force = force
            record.state = RequestState.CONTROL_READY if force else RequestState.DECODE_READY

        # OutputSession commits, then publication: for rows that go on generating, once the next decode
        # unit is on the device (publish_committed)
        self.unpublished.extend(continuing)
        for row, record, preview, reason, error in ending:
            if preview is not None:
                try:
                    out = record.session.commit(preview)
                except Exception as exc:  # noqa: BLE001 - a per-request output error, not the Engine's
                    error = self.output_error(record, "commit", exc)
                    reason = "error"  # a terminal row: its resources are already released above
                else:
                    record.output_touched = True
                    accepted = preview.accepted  # the row was not cancelled: its decision's count
                    logprobs = row_logprobs(record, row, accepted)
                    self.publish_delta(record, out, tuple(row.tokens[:accepted]), logprobs)
            core.finish(record, reason, error)

    def _advance_constraint(self, record: RequestRecord, row: PendingRow, *, forced: bool) -> None:
        """Move the row's matcher by its committed tokens; a failure ends only that request, at its next
        boundary (as a failed deferred OutputSession commit does)."""
        assert record.constraint is not None
        try:
            record.constraint.advance(row.tokens, forced=forced)
        except Exception as exc:  # noqa: BLE001 - a per-request output error, not the Engine's
            record.output_error = self.output_error(record, "constraint.advance", exc)
            self._core.cancellation_may_have_changed()

    def _turn_boundaries(
        self, record: RequestRecord, preview: OutputPreviewLike, reason: FinishReason
    ) -> tuple[int, ...]:
        """The Frontend's reuse boundaries of a turn's last span, asked for only where the context
        cache would retain the turn (they may cost the Frontend a render): checked to lie in the accepted
        span; ``output_reproducible`` when one ends it."""
        if reason != "stop" or not self._core.resources.cache.uses_cache(record):
            return ()
        try:
            boundaries = tuple(getattr(preview, "boundaries", ()))
        except Exception:  # noqa: BLE001 - a hint: without it the turn is only not kept
            log.warning("request %d: the output's reuse boundaries failed", record.request_id, exc_info=True)
            return ()
        if any(not 1 <= b <= preview.accepted for b in boundaries):
            raise EngineInvariantError(
                f"Frontend boundaries {boundaries} outside the accepted span 1..{preview.accepted}"
            )
        record.output_reproducible = preview.accepted in boundaries
        return boundaries

    def publish_committed(self) -> bool:
        """OutputSession commit and publication of the last unit's rows that go on generating; returns
        whether one of those commits failed.

        Runs while the next decode unit is on the device (the Program's ``while_running`` call), else
        before any other unit and when no unit follows. A failing OutputSession commit ends only its
        request: its row in the unit now running cannot be released yet, so the error is kept and the
        request ends as a cancelled row at its next unit or boundary.
        """
        if not self.unpublished:
            return False
        rows, self.unpublished = self.unpublished, []
        failed = False
        for record, preview, row in rows:
            try:
                out = record.session.commit(preview)
            except Exception as exc:  # noqa: BLE001 - a per-request output error, not the Engine's
                record.output_error = self.output_error(record, "commit", exc)
                self._core.cancellation_may_have_changed()
                failed = True
                continue
            record.output_touched = True
            produced = len(row.tokens)  # all of them accepted
            self.publish_delta(record, out, tuple(row.tokens), row_logprobs(record, row, produced))
        return failed

    def holds(self, record: RequestRecord) -> bool:
        """The request has a committed row not yet published."""
        return any(row.record is record for row in self.unpublished)

    @staticmethod
    def output_error(record: RequestRecord, call: str, exc: Exception) -> RequestFailed:
        """The error result of a request whose OutputSession raised (logged with its traceback)."""
        log.error(
            "request %d: OutputSession.%s failed; only this request ends",
            record.request_id,
            call,
            exc_info=exc,
        )
        return RequestFailed(
            f"request {record.request_id} failed while forming its output: OutputSession.{call} raised "
            f"{type(exc).__name__}: {exc}. This is a bug in the package's output handling (e.g. its "
            "tool-call or reasoning parser), not in the request; other requests are unaffected. Retry, or "
            "send the request without tools, and report the bug with this message"
        )

    @staticmethod
    def publish_delta(
        record: RequestRecord,
        out: OutputDeltaLike,
        token_ids: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] | None = None,
    ) -> None:
        """Turn an OutputSession delta into a public ``GenerationDelta``, fold it into the aggregate
        result and publish it."""
        delta = GenerationDelta(
            request_id=record.request_id,
            text=out.text,
            reasoning_text=out.reasoning_text,
            tool_calls=tuple(ToolCallDelta(tc.index, tc.id, tc.name, tc.arguments) for tc in out.tool_calls),
            token_ids=token_ids,
            logprobs=logprobs,
        )
        record.record_delta(delta)
        record.channel.publish(delta)


def row_logprobs(record: RequestRecord, row: PendingRow, accepted: int) -> tuple[TokenLogprob, ...] | None:
    if not record.plan.logprobs.enabled:
        return None
    if row.logprobs is None:  # forced tokens: not sampled
        return tuple(TokenLogprob(t, 0.0) for t in row.tokens[:accepted])
    return tuple(row.logprobs[:accepted])
