"""The ResourceManager's logical context cache: the checkpoint catalog, the prefix candidate index, the
SessionIndex, retention and hit observations, and the policy of where to capture.

Everything here is logical. Each checkpoint is an entry the Program published in a `ResourceResult`;
its slots, pages and bytes are the Program's, and an entry leaves the catalog only by a result that
removes it. Lookup is content-addressed: a checkpoint continues exactly the token ids (and media) before
its frontier, so a prompt can continue it only if the prompt's prefix of that length has the same digest
(`ninfer.runtime.contract.identity`), whatever a session key says. A session key is a hint that finds
the session's latest continuation first (private entries are offered to their session only).

Policy (docs/resources-and-context-cache.md):
- capture inside a prompt at the Frontend's first and last reuse boundaries (the system + tools
  preamble, the start of the reply) and every ``capture_interval`` prompt tokens (`capture_points`);
- retain a finished turn as a checkpoint when the Frontend says the history renderer reproduces its
  output (its last committed span ends at a reuse boundary): private to its session when it has one;
- evict the least recently used shared entries first, session continuations last; the same order is
  the host tier's (a Program with one offloads a device victim there instead of dropping it, making host
  room by dropping host entries that come before it), so the tier keeps the most valuable of what left
  the device.

An entry's tier (device, or the Program's host tier) is what the last result that placed it said, and
its bytes what that result said it holds there: a logical fact for the stats and the policy, not a
mirror of the Program's pools.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ninfer.runtime.contract.identity import prefix_digests
from ninfer.runtime.contract.types import CheckpointEntry, CheckpointTier, ResourceResult
from ninfer.runtime.engine.request_record import RequestRecord

MAX_CANDIDATES = 4  # sources offered to one plan, best first
MIN_CAPTURE_GAP = 64  # prompt tokens a capture must add over the checkpoint before it


@dataclass
class CatalogEntry:
    entry: CheckpointEntry
    session: str | None  # private to this session; None: shared by every matching prefix
    publication_order: int  # of the request whose transition published it
    last_used: int  # the catalog clock when it was published or last continued
    hits: int = 0
    tier: CheckpointTier = "device"  # where the last result that placed it put it
    nbytes: int = -1  # bytes only it holds in its tier, as the last placement said (-1: as published)
    publisher_session: str | None = None  # the session of the request that published it (shared ones too)

    @property
    def held_bytes(self) -> int:
        return self.entry.nbytes if self.nbytes < 0 else self.nbytes

    @property
    def checkpoint_id(self) -> int:
        return self.entry.checkpoint_id


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache's counters (the worker replaces it after each change; any thread reads)."""

    enabled: bool = False
    checkpoints: int = 0  # every tier
    checkpoint_bytes: int = 0  # every tier: device bytes of device entries, host bytes of host entries
    host_checkpoints: int = 0  # of them, in the host tier
    host_checkpoint_bytes: int = 0
    sessions: int = 0
    queries: int = 0  # admissions that looked for a source (the cache on for the request)
    hits: int = 0  # admissions that continued a checkpoint
    hit_tokens: int = 0  # prompt tokens those admissions did not prefill
    captures: int = 0  # checkpoints captured inside prompts
    retains: int = 0  # finished turns kept as checkpoints
    evictions: int = 0  # checkpoints dropped from the catalog (pressure, a full host tier, or reset)
    offloads: int = 0  # checkpoints moved from the device to the host tier
    restores: int = 0  # checkpoints moved back from the host tier to continue them

    @property
    def device_checkpoints(self) -> int:
        return self.checkpoints - self.host_checkpoints

    @property
    def device_checkpoint_bytes(self) -> int:
        return self.checkpoint_bytes - self.host_checkpoint_bytes


class ContextCache:
    """See the module docstring. ``salt`` is the Program's ``prefix_salt``."""

    def __init__(
        self, *, enabled: bool, salt: str, capture_interval: int, min_capture_gap: int = MIN_CAPTURE_GAP
    ) -> None:
        self.enabled = enabled
        self.salt = salt
        self.capture_interval = capture_interval
        self.min_capture_gap = min_capture_gap
        self.entries: dict[int, CatalogEntry] = {}
        self._shared: dict[int, dict[str, int]] = {}  # frontier -> digest -> checkpoint id
        self.sessions: dict[str, tuple[int, int]] = {}  # session -> (checkpoint id, publication order)
        self._clock = 0
        self._counts = {
            "queries": 0, "hits": 0, "hit_tokens": 0, "captures": 0, "retains": 0, "evictions": 0,
            "offloads": 0, "restores": 0,
        }  # fmt: skip
        self.stats = CacheStats(enabled=enabled)

    def uses_cache(self, record: RequestRecord) -> bool:
        return self.enabled and record.prefix_cache

    # ---- lookup ---------------------------------------------------------------------------------
    def candidates(self, record: RequestRecord) -> tuple[CheckpointEntry, ...]:
        """Sources the request's prompt can continue, best first: its session's continuation, then the
        longest shared prefixes."""
        if not self.uses_cache(record) or not self.entries:
            return ()
        plan = record.plan
        prompt = plan.prompt_token_ids
        found: list[CheckpointEntry] = []
        bound = self.sessions.get(record.session_id) if record.session_id is not None else None
        lengths = {f for f in self._shared if f < len(prompt)}
        if bound is not None and bound[0] in self.entries:
            lengths.add(self.entries[bound[0]].entry.frontier_tokens)
        digests = prefix_digests(prompt, lengths, plan.media, self.salt)
        if bound is not None and bound[0] in self.entries:
            entry = self.entries[bound[0]].entry
            if digests.get(entry.frontier_tokens) == entry.prefix_digest:
                found.append(entry)
        for frontier in sorted((f for f in self._shared if f < len(prompt)), reverse=True):
            checkpoint_id = self._shared[frontier].get(digests.get(frontier, ""))
            if checkpoint_id is not None and all(e.checkpoint_id != checkpoint_id for e in found):
                found.append(self.entries[checkpoint_id].entry)
            if len(found) >= MAX_CANDIDATES:
                break
        return tuple(found)

    def evictable(self) -> tuple[CheckpointEntry, ...]:
        """Every inactive checkpoint, least valuable first: shared entries by last use, then session
        continuations by last use."""
        bound = {checkpoint_id for checkpoint_id, _ in self.sessions.values()}
        order = sorted(
            self.entries.values(), key=lambda c: (c.checkpoint_id in bound, c.last_used, c.checkpoint_id)
        )
        return tuple(c.entry for c in order)

    def capture_points(self, record: RequestRecord, reused: int) -> list[int]:
        """Prompt positions past ``reused`` to capture at, ascending, less those the catalog holds: the
        first and the last of the Frontend's boundaries (the end of the system preamble, shared by every
        conversation that opens with it; the start of the reply, which the next turn reuses even when the
        template drops this turn's reasoning) and every ``capture_interval`` tokens. Each costs a prefill
        unit of its own, which few tokens do not repay: the preamble is kept ``min_capture_gap`` tokens or
        more past ``reused``, an interval point as far from the points before and after it."""
        if not self.uses_cache(record):
            return []
        length = len(record.plan.prompt_token_ids)
        gap = self.min_capture_gap
        boundaries = [b for b in getattr(record.prompt, "boundaries", ()) if reused < b < length]
        chosen = set(boundaries[-1:])
        if boundaries and boundaries[0] - reused >= gap:
            chosen.add(boundaries[0])
        for point in range(self.capture_interval, length, self.capture_interval):
            before = max([reused, *(c for c in chosen if c < point)])
            after = min([c for c in chosen if c > point], default=None)
            if point - before >= gap and (after is None or after - point >= gap):
                chosen.add(point)
        digests = prefix_digests(record.plan.prompt_token_ids, chosen, record.plan.media, self.salt)
        return sorted(p for p, d in digests.items() if d not in self._shared.get(p, {}))

    # ---- adoption -------------------------------------------------------------------------------
    def adopt(
        self, result: ResourceResult, record: RequestRecord | None = None, *, private: bool = False
    ) -> None:
        """The catalog changes of one adopted result: removals, placements, then publications (bound to
        ``record``'s session when ``private``; a later request's binding is never replaced by an earlier
        one)."""
        for checkpoint_id in result.removed:
            self._remove(checkpoint_id)
        if result.removed:
            self._counts["evictions"] += len(result.removed)
        for placement in result.placed:
            cached = self.entries[placement.checkpoint_id]
            cached.tier, cached.nbytes = placement.tier, placement.nbytes
            self._counts["offloads" if placement.tier == "host" else "restores"] += 1
        for entry in result.published:
            self._clock += 1
            order = record.publication_order if record is not None else 0
            session = record.session_id if record is not None and private else None
            publisher = record.session_id if record is not None else None
            self.entries[entry.checkpoint_id] = CatalogEntry(
                entry, session, order, self._clock, publisher_session=publisher
            )
            if session is None:
                self._shared.setdefault(entry.frontier_tokens, {})[entry.prefix_digest] = entry.checkpoint_id
            if record is not None and record.session_id is not None:
                # a private turn that a later request of its session overtook stays private and unbound:
                # nothing continues it, and it is among the first evicted
                self.bind(record, entry.checkpoint_id)
            self._counts["retains" if result.kind == "retained" else "captures"] += 1
        self._publish_stats()

    def bind(self, record: RequestRecord, checkpoint_id: int) -> None:
        """SessionIndex: the session's latest continuation, replaced only by a later request's."""
        session = record.session_id
        if session is None or checkpoint_id not in self.entries:
            return
        current = self.sessions.get(session)
        if current is None or current[1] <= record.publication_order:
            self.sessions[session] = (checkpoint_id, record.publication_order)

    def admitted(self, record: RequestRecord, checkpoint_id: int | None, tokens: int) -> None:
        """An admission of ``record`` looked for a source (counted once, however often its plan was
        made while it waited) and continued ``checkpoint_id`` for ``tokens`` prompt tokens, or none."""
        if not self.uses_cache(record):
            return
        self._counts["queries"] += 1
        if tokens and checkpoint_id is not None and checkpoint_id in self.entries:
            self._clock += 1
            cached = self.entries[checkpoint_id]
            cached.last_used = self._clock
            cached.hits += 1
            self._counts["hits"] += 1
            self._counts["hit_tokens"] += tokens
        self._publish_stats()

    def _remove(self, checkpoint_id: int) -> None:
        cached = self.entries.pop(checkpoint_id, None)
        if cached is None:
            return
        if cached.session is None:
            frontier = self._shared.get(cached.entry.frontier_tokens, {})
            if frontier.get(cached.entry.prefix_digest) == checkpoint_id:
                del frontier[cached.entry.prefix_digest]
            if not frontier:
                self._shared.pop(cached.entry.frontier_tokens, None)
        for session, (bound, _) in list(self.sessions.items()):
            if bound == checkpoint_id:
                # the session's latest continuation is gone: its latest live one takes its place, so a
                # turn its session overtook cannot bind over a later turn's surviving checkpoint
                del self.sessions[session]
                live = [c for c in self.entries.values() if c.publisher_session == session]
                if live:
                    latest = max(live, key=lambda c: (c.publication_order, c.last_used))
                    self.sessions[session] = (latest.checkpoint_id, latest.publication_order)

    def all_ids(self) -> Sequence[int]:
        return list(self.entries)

    def clear(self) -> None:
        """Forget every entry (Engine failure: the Program's state is no longer trusted)."""
        self.entries.clear()
        self._shared.clear()
        self.sessions.clear()
        self._publish_stats()

    def tier(self, checkpoint_id: int) -> CheckpointTier:
        return self.entries[checkpoint_id].tier

    def _publish_stats(self) -> None:
        host = [c for c in self.entries.values() if c.tier == "host"]
        self.stats = CacheStats(
            enabled=self.enabled,
            checkpoints=len(self.entries),
            checkpoint_bytes=sum(c.held_bytes for c in self.entries.values()),
            host_checkpoints=len(host),
            host_checkpoint_bytes=sum(c.held_bytes for c in host),
            sessions=len(self.sessions),
            **self._counts,
        )
