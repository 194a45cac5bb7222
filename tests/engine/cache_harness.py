"""A step-driven Engine on `BookProgram` + `CacheFrontend`, with the context cache's invariants checked
after every worker boundary (and inside Program calls), for the cache, fault, backfill and speculative
property suites.

Checked after every boundary (`Harness.check`):
- the Program recorded no violation: every unit read the committed state and KV it expected, wrote
  only at or past its frontier, into its own pages, inside its reservation; every checkpoint was a
  complete continuation when published; a materialization's source was intact when it finished; no
  pinned checkpoint was dropped;
- the ResourceManager's catalog and the book's checkpoints are the same set (ids, frontiers, digests),
  each in the tier the book holds it in (but for the moves of the open transaction, not yet adopted), and
  the cache stats count each tier's entries;
- the book's pools explain themselves: each page's reference count is its number of holders (active
  reservations, the open claim, device checkpoints), used state slots and sequence indices likewise; the
  host tier's slots and pages are exactly those its checkpoints hold, each by one;
- SessionIndex: a bound session maps to a live checkpoint a request of that session published, with
  that request's publication order, and no live checkpoint of the session has a later order; a private
  entry belongs to the session that published it and is offered to no other (checked at planning);
- every plan is offered every catalog entry as evictable; at most one staged prefill; busy lanes equal
  the Program's sequences plus its open transaction;
- a cache reset, once done, left none of the checkpoints that existed when it was asked for.

Checked inside Program calls: a retain only for a request that ends normally (``stop``/``length``, no
output error), a capture only in Prefill of a prompt prefix.

After the drain (`Harness.finish`): every request's tokens are those of the same request run alone on a
cold Engine (no cache, plain decoding); a cancelled one published a prefix of them; published tokens
are the Program's committed ones; an ``infeasible`` rejection is infeasible in an empty Program (root
source, no checkpoint); capacity released once; usage at baseline; every checkpoint intact (in its tier);
then a reset returns every pool (state slots, pages, sequence indices, the host tier's) to its baseline.
"""

from __future__ import annotations

import collections
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from book_program import BookProgram
from cache_frontend import CacheFrontend, assistant_message
from hypothesis import HealthCheck, settings
from hypothesis import event as _event
from hypothesis.control import currently_in_test_context

from ninfer import Engine, EngineConfig, EngineFailed, GenerationRequest, RequestRejected
from ninfer.runtime.contract.types import RequestPlan, ResourcePlan, SequenceHandle
from ninfer.runtime.engine.ingress import CacheReset
from ninfer.runtime.engine.request_record import RequestRecord, RequestState, ResponseChannel
from ninfer.runtime.engine.resource_manager import LaneState
from ninfer.types import GenerationResult

MAX_CONTEXT = 192
EOS_PERIOD = 9
SYSTEMS = (
    "You are a terse assistant.",
    "You answer questions about the weather, briefly and politely, in English.",
    "Reply in one short line. Be helpful, be exact, and never make anything up, please.",
)
DOCUMENT = bytes((ord("a") + (i * 7 + i // 5) % 26) for i in range(160))
# the Program calls a cancellation can be armed for: the request the call concerns is cancelled inside it
CANCEL_POINTS = (
    "now",
    "start",
    "start_src",
    "poll",
    "finish",
    "prefill",
    "capture",
    "decode",
    "decode_b2",
    "force",
    "retain",
)


def property_settings(examples: int = 200) -> settings:
    """The suites' settings: ``examples`` derandomized examples (deterministic CI), or, with
    ``NINFER_PROPERTY_HUNT=N`` in the environment, N random ones (a local bug hunt)."""
    hunt = int(os.environ.get("NINFER_PROPERTY_HUNT", "0"))
    return settings(
        max_examples=hunt or examples,
        deadline=None,
        derandomize=not hunt,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def event(label: str) -> None:
    """A hypothesis coverage event (``--hypothesis-show-statistics``); nothing outside a property test."""
    if currently_in_test_context():
        _event(label)


@dataclass
class Submitted:
    request: GenerationRequest
    handle: Any
    channel: ResponseChannel
    serial: int
    messages: list[dict[str, Any]] | None
    result: GenerationResult | None = None


@dataclass
class Harness:
    program: BookProgram
    frontend: CacheFrontend
    engine: Engine
    fail_ok: bool = False  # a fault suite: the Engine may fail
    submitted: list[Submitted] = field(default_factory=list)
    by_serial: dict[int, Submitted] = field(default_factory=dict)
    armed: list[tuple[str, int]] = field(default_factory=list)
    resets: list[tuple[CacheReset, set[int]]] = field(default_factory=list)
    started: list[int] = field(default_factory=list)  # serials in start order
    steps: int = 0
    on_start: Callable[[Harness, RequestPlan, ResourcePlan], None] | None = None

    @property
    def core(self) -> Any:
        return self.engine.core

    # ---- identities ----
    def serial_of(self, plan: RequestPlan) -> int:
        return plan.prepared_prompt.serial  # type: ignore[union-attr]

    def record_of(self, handle: SequenceHandle) -> RequestRecord:
        return next(r for r in self.core.laned.values() if r.handle == handle)

    def entry_of_record(self, record: RequestRecord) -> Submitted:
        return self.by_serial[record.prompt.serial]  # type: ignore[attr-defined]

    def publisher(self, checkpoint_id: int) -> Submitted:
        seq_handle = self.program.published[checkpoint_id].handle
        return self._published_by[seq_handle]

    # ---- hooks (inside Program calls) ----
    def install(self) -> None:
        self._published_by: dict[SequenceHandle, Submitted] = {}
        p = self.program
        p.hooks["plan_materialization"] = self._on_plan
        p.hooks["start"] = self._on_start
        p.hooks["finish"] = self._on_finish
        p.hooks["abort"] = lambda _p, txn: event(
            "aborted a materialization from " + ("a source" if txn.plan.source_checkpoint else "the root")
        )
        p.hooks["poll"] = lambda _p, txn: self._fire("poll", self._txn_serial(txn))
        p.hooks["prefill"] = lambda _p, h: self._fire("prefill", self._handle_serial(h))
        p.hooks["capture"] = self._on_capture
        p.hooks["retain"] = self._on_retain
        p.hooks["decode"] = self._on_decode
        p.hooks["force"] = lambda _p, h: self._fire("force", self._handle_serial(h))

    def _txn_serial(self, txn: Any) -> int:
        return self.serial_of(txn.plan.sealed[0])

    def _handle_serial(self, handle: SequenceHandle) -> int:
        return self.record_of(handle).prompt.serial  # type: ignore[attr-defined]

    def _fire(self, point: str, serial: int) -> None:
        """Cancel the request a Program call concerns, if a cancellation is armed for that call."""
        for i, (armed, _) in enumerate(self.armed):
            if armed == point:
                del self.armed[i]
                entry = self.by_serial[serial]
                record = self.core.live.get(entry.channel.request_id)
                event(f"cancel inside {point} ({record.state.value if record else 'finished'})")
                entry.channel.cancel()
                return

    def _on_plan(self, _p: BookProgram, arg: Any) -> None:
        request, candidates, evictable = arg
        cache = self.core.resources.cache
        assert {e.checkpoint_id for e in evictable} == set(cache.entries), "a plan not offered every entry"
        session = self.by_serial[self.serial_of(request)].request.session_id
        for c in candidates:
            owner = cache.entries[c.checkpoint_id].session
            assert owner is None or owner == session, "a private checkpoint offered to another session"

    def _on_start(self, _p: BookProgram, plan: ResourcePlan) -> None:
        request = plan.sealed[0]
        serial = self.serial_of(request)
        room = plan.sealed[2]
        if room.drop:
            event("a plan evicted checkpoints")
        if room.offload:
            event("a plan offloaded checkpoints to the host tier")
        source = plan.source_checkpoint
        if source is not None and self.program.book.checkpoints[source].tier == "host":
            event("a plan restores its source from the host tier")
        session = self.by_serial[serial].request.session_id
        if session is not None and any(r.session_id == session for r in self.core.laned.values()):
            event("two turns of one session in flight")
        if self.on_start is not None:
            self.on_start(self, request, plan)
        self.started.append(serial)
        self._fire("start", serial)
        if plan.source_checkpoint is not None:
            event(f"materialization from a source (polls={self.program.materialize_polls})")
            self._fire("start_src", serial)

    def _on_finish(self, _p: BookProgram, txn: Any) -> None:
        self._fire("finish", self._txn_serial(txn))

    def _on_capture(self, _p: BookProgram, handle: SequenceHandle) -> None:
        event("capture")
        record = self.record_of(handle)
        assert record.state is RequestState.PREFILL, f"a capture in {record.state}"
        assert record.output_error is None
        self._published_by[handle] = self.entry_of_record(record)
        self._fire("capture", record.prompt.serial)  # type: ignore[attr-defined]

    def _on_retain(self, _p: BookProgram, handle: SequenceHandle) -> None:
        event("retain")
        record = self.record_of(handle)
        assert record.state is RequestState.TERMINAL_PENDING
        # never a checkpoint from a cancelled, failed or incomplete state
        assert record.finish_reason in ("stop", "length") and record.output_error is None, record
        assert not record.channel.cancel_requested or record.finish_reason != "cancelled"
        self._published_by[handle] = self.entry_of_record(record)
        self._fire("retain", record.prompt.serial)  # type: ignore[attr-defined]

    def _on_decode(self, _p: BookProgram, handles: tuple[SequenceHandle, ...]) -> None:
        event(f"decode B={len(handles)}")
        for i, (armed, which) in enumerate(self.armed):
            if armed == "decode" or (armed == "decode_b2" and len(handles) >= 2):
                del self.armed[i]
                record = self.record_of(handles[which % len(handles)])
                event(f"cancel inside decode (B={len(handles)})")
                record.channel.cancel()
                return

    # ---- actions ----
    def submit(self, request: GenerationRequest, messages: list[dict[str, Any]] | None = None) -> bool:
        try:
            handle = self.engine.submit(request)
        except RequestRejected as err:
            assert err.kind in ("context_too_long", "overload"), err
            return False
        except EngineFailed:
            assert self.fail_ok and self.core.failed
            return False
        serial = max(self.frontend.sessions)
        entry = Submitted(request, handle, handle._channel, serial, messages)
        self.submitted.append(entry)
        self.by_serial[serial] = entry
        return True

    def chat(
        self,
        system: int,
        topic: int,
        max_tokens: int,
        seed: int,
        cache: bool = True,
        thinking: int | None = None,
    ) -> None:
        messages = [
            {"role": "system", "content": SYSTEMS[system % len(SYSTEMS)]},
            {"role": "user", "content": f"topic {topic}?"},
        ]
        extra: dict[str, Any] = {}
        if thinking is not None:  # a thinking budget: forced control after that many tokens
            extra = {"thinking_budget": thinking, "chat_template_kwargs": {"enable_thinking": True}}
        request = chat_request(messages, f"s{len(self.submitted)}", max_tokens, seed, cache, **extra)
        self.submit(request, messages)

    def follow(self, index: int, topic: int, max_tokens: int, seed: int) -> bool:
        done = [e for e in self.submitted if e.messages is not None and e.channel.response_done]
        if not done:
            return False
        entry = done[index % len(done)]
        result = entry.channel.final
        if result is None or result.finish_reason not in ("stop", "length"):
            return False
        messages = [*entry.messages, assistant_message(result), {"role": "user", "content": f"and {topic}?"}]
        request = chat_request(messages, entry.request.session_id, max_tokens, seed, True)
        if len(self.frontend.prepare_chat(messages).token_ids) + max_tokens > MAX_CONTEXT:
            return False
        return self.submit(request, messages)

    def document(self, cut: int, tail: int, max_tokens: int, seed: int) -> None:
        prompt = list(DOCUMENT[:cut]) + [ord("A") + tail % 4] * (1 + tail % 3)
        self.submit(GenerationRequest(prompt=prompt, max_tokens=max_tokens, seed=seed, ignore_eos=False))

    def cancel(self, point: str, index: int) -> None:
        if point == "now":
            if self.submitted:
                entry = self.submitted[index % len(self.submitted)]
                record = self.core.live.get(entry.channel.request_id)
                event(f"cancel now ({record.state.value if record else 'finished or queued'})")
                entry.channel.cancel()
        else:
            self.armed.append((point, index))

    def reset(self) -> None:
        """A cache reset asked for between two boundaries, whatever else arrives for the next one."""
        self.resets.append((self.core.request_cache_reset(), set(self.core.resources.cache.entries)))

    # ---- stepping and checks ----
    def step(self) -> None:
        self.core.step()
        self.steps += 1
        self.check()

    def check(self) -> None:
        core, program, book = self.core, self.program, self.program.book
        if core.failed:
            assert self.fail_ok, core.availability.reason
            return
        assert not program.violations, program.violations
        assert not program.dropped_pinned, f"pinned checkpoints dropped: {program.dropped_pinned}"
        cache = core.resources.cache
        # the victims of an open materialization are gone from the book, and leave the catalog with the
        # transaction's result (finish or abort)
        claim = book.open_txn.sealed if book.open_txn is not None else None
        victims = set(claim.victims) if claim is not None else set()
        moving = {p.checkpoint_id for p in claim.placed} if claim is not None else set()
        assert set(cache.entries) == set(book.checkpoints) | victims, "catalog and Program checkpoints differ"
        assert not victims & set(book.checkpoints)
        for cid, cached in cache.entries.items():
            if cid in victims:
                continue
            checkpoint = book.checkpoints[cid]
            entry = checkpoint.entry
            assert (cached.entry.frontier_tokens, cached.entry.prefix_digest) == (
                entry.frontier_tokens,
                entry.prefix_digest,
            )
            assert cached.tier == checkpoint.tier or cid in moving, f"checkpoint {cid}'s tier differs"
            if cached.session is not None:
                assert self.publisher(cid).request.session_id == cached.session
        # the pools explain themselves
        holders: collections.Counter[int] = collections.Counter()
        slots = indices = 0
        claims = list(book._held.values())
        if book.open_txn is not None:
            claims.append(book.open_txn.sealed)
        for claim in claims:
            holders.update(claim.pages)
            slots += len(claim.slots)
            indices += 1
        hosted = [c for c in book.checkpoints.values() if c.tier == "host"]
        for checkpoint in book.checkpoints.values():
            if checkpoint.tier == "device":
                holders.update(checkpoint.pages)
                slots += 1
        assert book.pages.used_count == len(holders)
        assert all(book.pages.refcount(p) == n for p, n in holders.items()), "a page refcount is wrong"
        assert book.slots.used_count == slots and book.indices.used_count == indices
        host_pages = [p for c in hosted for p in c.pages]
        assert len(set(host_pages)) == len(host_pages) == book.host_pages.used_count, "host pages shared"
        assert len({c.slot for c in hosted}) == len(hosted) == book.host_slots.used_count
        assert not any(c.pinned for c in hosted), "a pinned checkpoint in the host tier"
        stats = cache.stats
        assert stats.checkpoints == len(cache.entries)
        assert stats.host_checkpoints == sum(1 for c in cache.entries.values() if c.tier == "host")
        # SessionIndex: the latest publication order of the session's live checkpoints
        for session, (cid, order) in cache.sessions.items():
            assert cid in cache.entries, "a session bound to a dropped checkpoint"
            assert cid in book.checkpoints or cid in victims
            owner = self.publisher(cid)
            assert owner.request.session_id == session and owner.channel.request_id == order
            for other in cache.entries:
                publisher = self.publisher(other)
                if publisher.request.session_id == session:
                    assert publisher.channel.request_id <= order, (
                        f"session {session} bound to order {order}, a checkpoint of order "
                        f"{publisher.channel.request_id} is live"
                    )
        snap = core.snapshot()
        staging = (RequestState.MATERIALIZING, RequestState.PREFILL)
        staged = [rid for rid, s in snap.states.items() if s in staging]
        assert len(staged) <= 1
        busy = [lane for lane in snap.lanes if lane.state is not LaneState.FREE]
        usage = program.usage()
        assert len(busy) == usage.sequences + usage.open_transactions
        for reset, before in self.resets:
            if reset._event.is_set():
                assert not before & set(cache.entries), "a finished reset left checkpoints behind"

    def drain(self, limit: int = 20_000) -> None:
        n = 0
        while not self.core.idle:
            self.step()
            n += 1
            assert n < limit, "the Engine did not drain"
        for entry in self.submitted:
            entry.result = entry.handle.result(0, raise_on_error=False)
            entry.handle.close()

    def finish(self, cold: Callable[[GenerationRequest], tuple[int, ...]]) -> None:
        """The after-drain checks (module docstring)."""
        self.drain()
        core, program, book = self.core, self.program, self.program.book
        assert not core.failed, core.availability.reason
        for entry in self.submitted:
            result = entry.result
            assert result is not None and entry.channel.capacity_release_count == 1
            event(f"finish {result.finish_reason}")
            if result.usage.reused_prefix_tokens:
                event("reused a checkpoint")
            if result.finish_reason == "error":
                assert result.error is not None and result.error.kind == "infeasible", result.error
                self._infeasible_in_empty_program(entry)
                continue
            expected = cold(entry.request)
            if result.finish_reason == "cancelled":
                assert result.token_ids == expected[: len(result.token_ids)]
            else:
                assert result.finish_reason in ("stop", "length"), result
                assert result.token_ids == expected, (entry.request, result)
                output, _ = program.released[entry.serial]
                assert output == result.token_ids, "published tokens differ from the committed ones"
        assert core.outstanding == 0
        assert program.usage() == core.baseline
        assert all(lane.state is LaneState.FREE for lane in core.resources.lanes)
        for cid in book.checkpoints:
            assert program.checkpoint_intact(cid), f"checkpoint {cid} was overwritten"
        count = len(book.checkpoints)
        reset = core.request_cache_reset()
        self.step()
        assert reset.wait(0) == count
        assert not book.checkpoints and not core.resources.cache.entries and not core.resources.cache.sessions
        assert book.slots.free_count == book.slots.size, "state slots not back at baseline"
        assert book.pages.free_count == book.pages.size, "KV pages not back at baseline"
        assert book.indices.free_count == book.indices.size, "sequence indices not back at baseline"
        assert book.host_slots.free_count == book.host_slots.size, "host slots not back at baseline"
        assert book.host_pages.free_count == book.host_pages.size, "host pages not back at baseline"
        usage = program.usage()
        assert usage == core.baseline and usage.checkpoints == 0 and usage.host_checkpoints == 0
        for r, _ in self.resets:
            assert r.wait(0) >= 0

    def _infeasible_in_empty_program(self, entry: Submitted) -> None:
        """The cache never causes a rejection: an infeasible request does not fit an empty Program."""
        book = self.program.book
        n = len(self.frontend.sessions[entry.serial].prompt.token_ids)
        max_new = entry.request.max_tokens
        assert max_new is not None
        pages = -(-(n + max_new + book.extra_tokens) // book.page_size)
        assert pages > book.pages.size or n + max_new > book.max_context, "a rejection the cache caused"


def chat_request(
    messages: list[dict[str, Any]],
    session: str | None,
    max_tokens: int,
    seed: int,
    cache: bool = True,
    **kw: Any,
) -> GenerationRequest:
    return GenerationRequest(
        messages=list(messages), max_tokens=max_tokens, seed=seed, session_id=session, prefix_cache=cache,
        **kw,
    )  # fmt: skip


def make_harness(
    *,
    mc: int,
    page_size: int,
    kv_pages: int | None,
    checkpoint_slots: int,
    polls: int,
    chunk: int,
    capture_interval: int,
    spec_k: int = 0,
    prefix_cache: bool = True,
    gap: int = 4,
    faults: dict[str, int] | None = None,
    frontend: CacheFrontend | None = None,
    queue: int = 16,
    host_slots: int = 0,
    host_pages: int = 0,
) -> Harness:
    program = BookProgram(
        max_concurrency=mc, max_context=MAX_CONTEXT, page_size=page_size, kv_pages=kv_pages,
        checkpoint_slots=checkpoint_slots, spec_k=spec_k, materialize_polls=polls, eos_period=EOS_PERIOD,
        faults=faults, host_slots=host_slots, host_pages=host_pages,
    )  # fmt: skip
    frontend = frontend or CacheFrontend()
    config = EngineConfig(
        max_concurrency=mc, queue_capacity=queue, prefill_chunk_tokens=chunk, page_size=page_size,
        warmup=False, prefix_cache=prefix_cache, capture_interval=capture_interval,
    )  # fmt: skip
    engine = Engine.from_parts(program, frontend, config, start_worker=False)
    engine.core.resources.cache.min_capture_gap = gap
    h = Harness(program, frontend, engine, fail_ok=bool(faults))
    h.install()
    return h


@functools.cache
def _cold_engine() -> Engine:
    program = BookProgram(
        max_concurrency=1, max_context=MAX_CONTEXT, checkpoint_slots=0, eos_period=EOS_PERIOD
    )
    config = EngineConfig(
        max_concurrency=1,
        prefill_chunk_tokens=64,
        page_size=program.page_size,
        warmup=False,
        prefix_cache=False,
    )
    return Engine.from_parts(program, CacheFrontend(), config, start_worker=False)


_COLD: dict[str, tuple[int, ...]] = {}


def cold_tokens(request: GenerationRequest) -> tuple[int, ...]:
    """The request run alone on a cold Engine: no cache, plain decoding (memoized)."""
    key = repr(
        (
            request.prompt,
            request.messages,
            request.max_tokens,
            request.seed,
            request.stop,
            request.stop_token_ids,
            request.thinking_budget,
            request.chat_template_kwargs,
        )
    )
    if key not in _COLD:
        engine = _cold_engine()
        handle = engine.submit(request)
        while not engine.core.idle:
            engine.core.step()
        _COLD[key] = handle.result(0).token_ids
    return _COLD[key]


def run_actions(h: Harness, actions: list[tuple]) -> None:
    """The shared action language of the property suites."""
    for act in actions:
        kind = act[0]
        if kind == "chat":
            h.chat(*act[1:])
        elif kind == "follow":
            h.follow(*act[1:])
        elif kind == "race":  # two turns of one session in flight at once
            if h.follow(act[1], act[2], act[3], act[4]):
                h.follow(act[1], act[2] + 1, 1 + act[3] // 2, act[4] + 1)
        elif kind == "session_race":  # a turn, then two next turns of its session in flight at once
            _, system, topic, seed = act
            h.chat(system, topic, 10, seed)
            entry = h.submitted[-1]
            for _ in range(80):
                if entry.channel.response_done:
                    break
                h.step()
            done = [e for e in h.submitted if e.messages is not None and e.channel.response_done]
            if entry in done:
                i = done.index(entry)
                if h.follow(i, topic + 1, 12, seed + 1):
                    h.follow(i, topic + 2, 1 + seed % 6, seed + 2)
        elif kind == "document":
            h.document(*act[1:])
        elif kind == "burst":  # several requests at once, long enough to share decode rounds
            for j in range(act[1]):
                prompt = [ord("a") + (act[2] + 3 * j + i) % 26 for i in range(4 + (act[2] >> j) % 24)]
                h.submit(
                    GenerationRequest(
                        prompt=prompt,
                        max_tokens=8 + (act[2] >> (2 * j)) % 24,
                        seed=act[2] + j,
                        ignore_eos=True,
                    )
                )
        elif kind == "step":
            for _ in range(act[1]):
                h.step()
        elif kind == "cancel":
            h.cancel(act[1], act[2])
        elif kind == "reset":
            h.reset()
        elif kind == "submit":
            h.submit(act[1], act[2] if len(act) > 2 else None)
        else:
            raise AssertionError(kind)
