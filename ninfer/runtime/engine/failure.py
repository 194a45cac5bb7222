"""Engine-wide failure cleanup, in the specification's order.

When shared physical state can no longer be explained (any Program exception but ``StalePlan``, a
contract break, a broken Engine invariant), the Engine fails as a whole:

1. the rows the Program committed are still published (best effort);
2. open Program transactions end: ``abort_pending`` of an unconsumed batch, ``abort`` of an open
   resource transaction;
3. active state is released (``release`` of every held sequence);
4. the ResourceManager and the Scheduler forget every logical claim;
5. every outstanding response completes with ``EngineFailed``.

The Program is no longer trusted, so every cleanup call is best effort and its errors are only logged.
Internal invariant errors are never turned into a cache miss, a wait or a retry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ninfer.runtime.engine.request_record import RequestState
from ninfer.types import EngineFailed

if TYPE_CHECKING:
    from ninfer.runtime.engine.engine_core import EngineCore

log = logging.getLogger("ninfer.engine")


def _best_effort(what: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001
        log.warning("cleanup after Engine failure: %s failed", what, exc_info=True)


def fail_engine(core: EngineCore, reason: str) -> None:
    """Fail ``core`` (once): see the module docstring for the order."""
    arrived = core.ingress.fail(reason)
    if arrived is None:
        return
    for record in arrived:
        core.live[record.request_id] = record
    committer, program = core.committer, core.program
    _best_effort("publish committed rows", committer.publish_committed)
    committer.unpublished.clear()
    batch = core.open_batch
    core.open_batch = None
    if batch is not None and not batch.consumed:
        _best_effort("abort_pending", lambda: program.abort_pending(batch))
    owner = core.resources.transition
    if owner is not None and owner.txn is not None:
        txn = owner.txn
        _best_effort("abort transaction", lambda: program.abort(txn))
    for record in list(core.laned.values()):
        handle = record.handle
        if handle is not None:
            _best_effort("release", lambda h=handle: program.release(h))
    core.resources.clear()
    core.scheduler.clear()
    core.laned.clear()
    error = EngineFailed(f"the Engine failed and serves no more requests: {reason}")
    for record in sorted(core.live.values(), key=lambda r: r.publication_order):
        record.finish_reason = "error"
        record.error = error
        record.state = RequestState.FINISHED
        if not record.channel.response_done:
            _best_effort("publish", lambda r=record: r.channel.publish(r.result()))
    core.live.clear()
