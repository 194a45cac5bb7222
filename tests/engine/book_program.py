"""A model-free Program whose physical resources are the real Qwen3.6 `ResourceBook`, for the context
cache, backfill and speculative property tests.

What is real: the `ResourceBook` of ``ninfer/targets/qwen3_6/impl/runtime/resources.py`` (IndexPool and
RefPool, complete growth reservations, sealed plans bound to ``resource_revision``, the one open
transaction, checkpoints with state slots and reference-counted pages, victims, pins and the backfill
proof), and the Program's use of it, written after `Qwen36Program` call by call: the digest filter of
the candidates, capture/retain/evict, ``prove_backfill``, slot selection on commit and the final
prefill chunk committed even for a cancelled row.

What is simulated: the device. Every StateImage slot holds the tuple of tokens whose state it is, and
every KV page the token written at each of its positions (a second plane for a drafter's own KV). A
unit checks that the state it reads and the KV it reads through the sequence's pages hold exactly the
tokens before its frontier, and the next token is a hash of those tokens and the request's seed (so
a wrong checkpoint, a corrupted shared page or a wrong slot selection changes the output, and is also
recorded in ``violations``). Writes are checked too: never below a row's committed frontier, never
into a page another holder shares, never past the reservation.

``spec_k`` > 0 turns decode into a speculative verify round as MTP's: K drafts per row (right for a
random number of leading positions), K + 1 verify positions and K - 1 more drafter positions written
past the frontier (so reservations carry ``2K`` extra positions), up to ``min(accepted drafts + 1,
budget)`` tokens produced per row, each state after a position in its own spare slot (K + 2 slots per
sequence), committed by slot selection. Its tokens are plain decoding's, whatever the drafts.

The host tier (``host_slots``, ``host_pages``: the book's, off by default) is simulated alike: host slots
and pages hold what an offload copied there, a restore copies them back, and a checkpoint is intact only
if the planes of its tier hold its tokens. The transfers run when the book moved the checkpoints (at
``start`` and ``capture``, as the Program queues them), the device copies of a materialization at
``finish``. ``offload`` and ``restore`` are fault points of their own: each transfer of that direction is
a call, so ``faults={"restore": 1}`` raises inside the first restore, after the book moved it.

Fault switches (``faults={"capture": 2}``: the second call of ``capture`` raises `ScriptedFault`; a
``name:after`` key raises after the call changed the book) and ``hooks`` (``hooks["capture"] = f``,
called with the Program and the call's argument at entry; ``hooks["start:after"]`` with its result)
let tests act "while the unit runs".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ninfer.runtime.contract.identity import prefix_digests
from ninfer.runtime.contract.types import (
    Blocked,
    CheckpointEntry,
    Infeasible,
    PendingBatch,
    PendingKind,
    PendingRow,
    PrefillProgress,
    ProgramInvariantError,
    RequestPlan,
    ResourceCapacity,
    ResourcePlan,
    ResourceResult,
    ResourceUsage,
    RowDecision,
    RunningTransaction,
    SequenceHandle,
    TokenLogprob,
    validate_decisions,
)
from ninfer.targets.qwen3_6.impl.runtime.resources import Copies, ResourceBook

EOS = 0
VOCAB: tuple[int, ...] = tuple(range(ord("a"), ord("z") + 1))
SLOT_BYTES = 1000
PAGE_BYTES = 100
_owners = itertools.count(1)


class ScriptedFault(RuntimeError):
    """Raised by an armed fault switch."""


def mix(*values: int) -> int:
    h = 0x9E3779B97F4A7C15
    for v in values:
        h ^= (v + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h


@dataclass(frozen=True)
class State:
    """A simulated StateImage: the tokens it is the state after, and their hash chain."""

    tokens: tuple[int, ...] = ()
    chain: int = 0

    def then(self, inputs: Sequence[int]) -> State:
        chain = self.chain
        for t in inputs:
            chain = mix(chain, t)
        return State(self.tokens + tuple(inputs), chain)


def model_token(seed: int, state: State, eos_period: int) -> int:
    """The scripted model's (greedy) next token after ``state``."""
    h = mix(seed, state.chain, len(state.tokens))
    if eos_period and h % eos_period == 0:
        return EOS
    return VOCAB[(h >> 8) % len(VOCAB)]


def model_logprob(seed: int, state: State, token: int, top_n: int) -> TokenLogprob:
    lp = -0.01 - (mix(seed, state.chain, token, 7) % 1000) / 100.0
    top = tuple((VOCAB[(token + i) % len(VOCAB)], lp - 0.5 * (i + 1)) for i in range(top_n))
    return TokenLogprob(token, lp, top)


@dataclass
class Seq:
    """One active sequence (after `Qwen36Program`'s SequenceState)."""

    handle: SequenceHandle
    plan: RequestPlan
    slots: tuple[int, ...]
    pages: list[int]
    current: int
    frontier: int
    pending_input: int | None = None
    state_valid: bool = True
    generated: list[int] = field(default_factory=list)
    rng_draws: int = 0  # sampled tokens committed (forced ones never count)

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.plan.prompt_token_ids

    @property
    def tokens(self) -> tuple[int, ...]:
        return (*self.prompt, *self.generated)

    def spares(self, count: int) -> tuple[int, ...]:
        free = [s for s in self.slots if s != self.current]
        if count > len(free):
            raise ProgramInvariantError(f"{self.handle} holds {len(self.slots)} slots, {count} spares wanted")
        return tuple(free[:count])


@dataclass(frozen=True)
class Commit:
    """``PendingRow.accept_meta``: the slot after each position run, and (prefill/force) the inputs the
    unit commits whole."""

    out_slots: tuple[int, ...]
    consumed: int | None = None


@dataclass
class Published:
    """What the test knows about a published checkpoint: its tokens, and the request that made it."""

    tokens: tuple[int, ...]
    kind: str  # "captured" | "retained"
    handle: SequenceHandle


class BookProgram:
    """See the module docstring. A Program, a CheckpointProgram and a BackfillProver."""

    def __init__(
        self,
        *,
        max_concurrency: int = 2,
        max_context: int = 128,
        page_size: int = 8,
        kv_pages: int | None = None,
        checkpoint_slots: int = 4,
        spec_k: int = 0,
        materialize_polls: int = 0,
        host_slots: int = 0,
        host_pages: int = 0,
        eos_period: int = 9,
        draft_hit_rate: int = 3,  # drafts are right with probability about (rate - 1) / rate
        faults: dict[str, int] | None = None,
    ) -> None:
        self.owner = next(_owners)
        self.spec_k = spec_k
        self.slots_per_sequence = 2 if spec_k == 0 else spec_k + 2
        extra = 2 * spec_k
        lane_pages = -(-(max_context + extra) // page_size)
        self.book = ResourceBook(
            owner=self.owner,
            max_sequences=max_concurrency,
            slots_per_sequence=self.slots_per_sequence,
            kv_pages=kv_pages if kv_pages is not None else 2 * lane_pages * max_concurrency,
            page_size=page_size,
            max_context=max_context,
            extra_tokens=extra,
            checkpoint_slots=checkpoint_slots,
            slot_bytes=SLOT_BYTES,
            page_bytes=PAGE_BYTES,
            host_slots=host_slots,
            host_pages=host_pages,
        )
        self._max_concurrency = max_concurrency
        self.materialize_polls = materialize_polls
        self.eos_period = eos_period
        self.draft_hit_rate = draft_hit_rate
        self.faults = dict(faults or {})
        self.hooks: dict[str, Callable[[BookProgram, Any], None]] = {}
        self.calls: dict[str, int] = {}
        self.call_log: list[str] = []
        # the simulated device
        self.slot_data: dict[int, State] = {}
        self.kv: dict[int, dict[int, int]] = {}  # page -> offset -> token (the text model's layers)
        self.drafter_kv: dict[int, dict[int, int]] = {}  # page -> offset -> position (a drafter's layer)
        # the host tier's planes, by host slot and host page id
        self.host_slot_data: dict[int, State] = {}
        self.host_kv: dict[int, dict[int, int]] = {}
        self.host_drafter_kv: dict[int, dict[int, int]] = {}
        self.violations: list[str] = []
        self.published: dict[int, Published] = {}
        self.dropped_pinned: list[int] = []
        self.released: dict[int, tuple[tuple[int, ...], int]] = {}  # publication serial -> (output, rng)
        self.decisions: list[tuple[PendingKind, PendingRow, RowDecision]] = []
        self.polls_left = 0
        self._pending_copies: Copies | None = None
        self._seqs: dict[int, Seq] = {}
        self._batch_ids = itertools.count(1)
        self._open: PendingBatch | None = None
        self._wrap_drop()

    def _wrap_drop(self) -> None:
        """Record every checkpoint the book drops while a materialization pins it (never allowed)."""
        book = self.book
        inner = book._drop

        def drop(checkpoint_id: int) -> None:
            checkpoint = book.checkpoints.get(checkpoint_id)
            if checkpoint is not None and checkpoint.pinned:
                self.dropped_pinned.append(checkpoint_id)
            inner(checkpoint_id)

        book._drop = drop  # type: ignore[method-assign]

    # ---- static facts -------------------------------------------------------------------------
    @property
    def max_concurrency(self) -> int:
        return self._max_concurrency

    @property
    def max_context(self) -> int:
        return self.book.max_context

    @property
    def page_size(self) -> int:
        return self.book.page_size

    @property
    def resource_revision(self) -> int:
        return self.book.revision

    @property
    def prefix_salt(self) -> str:
        return f"book/{'mtp' if self.spec_k else 'plain'}/{2 * self.spec_k}"

    def capacity(self) -> ResourceCapacity:
        return self.book.capacity()

    def usage(self) -> ResourceUsage:
        return self.book.usage((s.frontier for s in self._seqs.values()), self._open is not None)

    def sequences(self) -> list[Seq]:
        return list(self._seqs.values())

    def sequence(self, handle: SequenceHandle) -> Seq:
        return self._sequence(handle)

    # ---- fault switches and hooks ---------------------------------------------------------------
    def _enter(self, name: str, arg: Any = None) -> None:
        n = self.calls.get(name, 0) + 1
        self.calls[name] = n
        self.call_log.append(name)
        hook = self.hooks.get(name)
        if hook is not None:
            hook(self, arg)
        if self.faults.get(name) == n:
            raise ScriptedFault(f"injected fault in {name} (call {n})")

    def _after(self, name: str, value: Any = None) -> None:
        hook = self.hooks.get(f"{name}:after")
        if hook is not None:
            hook(self, value)
        if self.faults.get(f"{name}:after") == self.calls.get(name):
            raise ScriptedFault(f"injected fault after {name} changed the book (call {self.calls[name]})")

    # ---- the simulated device -------------------------------------------------------------------
    def _read(self, seq: Seq, upto: int) -> tuple[int, ...]:
        """The text-model KV of positions 0..upto-1 through the sequence's pages."""
        ps = self.page_size
        return tuple(self.kv.get(seq.pages[p // ps], {}).get(p % ps, -1) for p in range(upto))

    def _write(self, seq: Seq, position: int, token: int, plane: dict[int, dict[int, int]]) -> None:
        ps = self.page_size
        if position < seq.frontier:
            self.violations.append(f"{seq.handle}: a write at {position}, below the frontier {seq.frontier}")
            return
        if position >= len(seq.pages) * ps:
            self.violations.append(f"{seq.handle}: a write at {position}, past its reservation")
            return
        page = seq.pages[position // ps]
        if self.book.pages.refcount(page) != 1:
            self.violations.append(f"{seq.handle}: a write into page {page}, shared by another holder")
        plane.setdefault(page, {})[position % ps] = token

    def _run(self, seq: Seq, inputs: Sequence[int], out_slots: Sequence[int] | None) -> list[State]:
        """Run ``inputs`` at positions frontier.. from the current state: check what it reads, write
        their KV; each state after a position goes to ``out_slots`` (None: the current slot, the last)."""
        state = self.slot_data.get(seq.current, State())
        if len(state.tokens) != seq.frontier or state.tokens != seq.tokens[: seq.frontier]:
            self.violations.append(f"{seq.handle}: the current slot does not hold the committed state")
        if self._read(seq, seq.frontier) != state.tokens:
            self.violations.append(f"{seq.handle}: the KV before the frontier differs from its state")
        states = []
        for i, t in enumerate(inputs):
            self._write(seq, seq.frontier + i, t, self.kv)
            state = state.then((t,))
            states.append(state)
        if out_slots is None:
            self.slot_data[seq.current] = state
        else:
            assert len(out_slots) == len(states)
            for slot, s in zip(out_slots, states):
                self.slot_data[slot] = s
        return states

    def _transfer(self, copies: Copies) -> None:
        """The moves between the tiers, in order (offloads before a restore)."""
        for transfer in copies.transfers:
            self._enter("offload" if transfer.to_host else "restore", transfer)
            src, dst = transfer.state
            if transfer.to_host:
                self.host_slot_data[dst] = self.slot_data.get(src, State())
            else:
                self.slot_data[dst] = self.host_slot_data.get(src, State())
            for src, dst in transfer.pages:
                if transfer.to_host:
                    self.host_kv[dst] = dict(self.kv.get(src, {}))
                    self.host_drafter_kv[dst] = dict(self.drafter_kv.get(src, {}))
                else:
                    self.kv[dst] = dict(self.host_kv.get(src, {}))
                    self.drafter_kv[dst] = dict(self.host_drafter_kv.get(src, {}))

    def _copy(self, copies: Copies) -> None:
        if copies.state is not None:
            src, dst = copies.state
            self.slot_data[dst] = self.slot_data.get(src, State())
        if copies.page is not None:
            src, dst = copies.page
            self.kv[dst] = dict(self.kv.get(src, {}))
            self.drafter_kv[dst] = dict(self.drafter_kv.get(src, {}))

    def checkpoint_intact(self, checkpoint_id: int) -> bool:
        """The published checkpoint's slot and pages (in its tier) still hold exactly the tokens it was
        published at."""
        checkpoint = self.book.checkpoints[checkpoint_id]
        want = self.published[checkpoint_id].tokens
        ps = self.page_size
        host = checkpoint.tier == "host"
        planes, slots = (self.host_kv, self.host_slot_data) if host else (self.kv, self.slot_data)
        kv = tuple(planes.get(checkpoint.pages[p // ps], {}).get(p % ps, -1) for p in range(len(want)))
        return slots.get(checkpoint.slot) == State().then(want) and kv == want

    # ---- materialization (after Qwen36Program) --------------------------------------------------
    def plan_materialization(
        self,
        request: RequestPlan,
        candidates: Sequence[CheckpointEntry] = (),
        evictable: Sequence[CheckpointEntry] = (),
    ) -> ResourcePlan | Blocked | Infeasible:
        self._enter("plan_materialization", (request, candidates, evictable))
        if candidates:
            frontiers = [c.frontier_tokens for c in candidates]
            digests = prefix_digests(request.prompt_token_ids, frontiers, request.media, self.prefix_salt)
            candidates = [c for c in candidates if digests.get(c.frontier_tokens) == c.prefix_digest]
        return self.book.plan(request, candidates, evictable)

    def start(self, plan: ResourcePlan) -> RunningTransaction:
        self._enter("start", plan)
        txn, copies = self.book.start(plan)
        self._transfer(copies)  # the tier moves are queued at start, as the Program does
        # the copies run while the transaction is open: the test reads the source at finish, so a source
        # that changed meanwhile shows
        self._pending_copies = copies
        self.polls_left = self.materialize_polls
        self._after("start", txn)
        return txn

    def poll(self, txn: RunningTransaction) -> bool:
        self._enter("poll", txn)
        self.book.claim(txn)
        if self.polls_left > 0:
            self.polls_left -= 1
            return False
        return True

    def finish(self, txn: RunningTransaction) -> ResourceResult:
        self._enter("finish", txn)
        claim = self.book.claim(txn)
        if self.polls_left:
            raise ProgramInvariantError("finish before the transaction's copies completed")
        request = self.book.request(txn)
        source = claim.source
        if source is not None and (source not in self.book.checkpoints or not self.checkpoint_intact(source)):
            self.violations.append(f"materialization source {source} changed while it was pinned")
        if self._pending_copies is not None:
            self._copy(self._pending_copies)
            self._pending_copies = None
        reused = txn.plan.reused_prefix_tokens
        seq = Seq(claim.handle, request, claim.slots, claim.pages, claim.slots[0], reused)
        if reused == 0:
            self.slot_data[seq.current] = State()
        result = self.book.finish(txn)
        self._seqs[claim.handle.index] = seq
        self._after("finish")
        return result

    def abort(self, txn: RunningTransaction) -> ResourceResult:
        self._enter("abort", txn)
        self._pending_copies = None
        self.polls_left = 0
        return self.book.abort(txn)

    def release(self, handle: SequenceHandle) -> ResourceResult:
        self._enter("release", handle)
        seq = self._handover(handle)
        del self._seqs[handle.index]
        self._record_release(seq)
        return self.book.release(handle)

    def _record_release(self, seq: Seq) -> None:
        serial = getattr(seq.plan.prepared_prompt, "serial", None)
        if serial is not None:
            self.released[serial] = (tuple(seq.generated), seq.rng_draws)

    # ---- checkpoints ----------------------------------------------------------------------------
    def _digest(self, seq: Seq) -> str | None:
        tokens = seq.tokens[: seq.frontier]
        return prefix_digests(tokens, [seq.frontier], seq.plan.media, self.prefix_salt).get(seq.frontier)

    def _check_published(self, result: ResourceResult, seq: Seq) -> None:
        for entry in result.published:
            tokens = seq.tokens[: entry.frontier_tokens]
            self.published[entry.checkpoint_id] = Published(tokens, result.kind, seq.handle)
            if entry.frontier_tokens != seq.frontier or not self.checkpoint_intact(entry.checkpoint_id):
                self.violations.append(f"checkpoint {entry.checkpoint_id} is not a complete continuation")

    def capture(self, handle: SequenceHandle, evictable: Sequence[CheckpointEntry] = ()) -> ResourceResult:
        self._enter("capture", handle)
        seq = self._sequence(handle)
        self._no_open_pending("capture")
        digest = self._digest(seq) if seq.state_valid else None
        if digest is None:
            self.book.revision += 1
            return ResourceResult(kind="captured", resource_revision=self.book.revision)
        result, copies = self.book.capture(handle, seq.frontier, seq.current, digest, evictable)
        self._transfer(copies)
        self._copy(copies)
        self._check_published(result, seq)
        self._after("capture")
        return result

    def retain(self, handle: SequenceHandle, evictable: Sequence[CheckpointEntry] = ()) -> ResourceResult:
        self._enter("retain", handle)
        seq = self._sequence(handle)
        digest = self._digest(seq) if seq.state_valid and seq.frontier > 0 else None
        if digest is None:
            seq = self._handover(handle)
            del self._seqs[handle.index]
            self._record_release(seq)
            return self.book.release(handle)
        self._handover(handle)
        del self._seqs[handle.index]
        self._record_release(seq)
        result = self.book.retain(handle, seq.frontier, seq.current, digest)
        self._check_published(result, seq)
        self._after("retain")
        return result

    def evict(self, checkpoint_ids: Sequence[int]) -> ResourceResult:
        self._enter("evict", tuple(checkpoint_ids))
        result = self.book.evict(checkpoint_ids)
        self._after("evict")
        return result

    def prove_backfill(
        self, head: RequestPlan, donors: Sequence[SequenceHandle], borrower: RequestPlan
    ) -> ResourcePlan | None:
        self._enter("prove_backfill", (head, tuple(donors), borrower))
        for donor in donors:
            self._sequence(donor)
        if not self.book.proves_backfill(head, donors, borrower):
            return None
        plan = self.book.plan(borrower)
        return plan if isinstance(plan, ResourcePlan) else None

    # ---- execution ------------------------------------------------------------------------------
    def _handover(self, handle: SequenceHandle) -> Seq:
        seq = self._sequence(handle)
        self._no_open_pending("release")
        return seq

    def _row(self, seq: Seq, tokens: tuple[int, ...], states: Sequence[State], meta: Commit) -> PendingRow:
        lp = None
        if seq.plan.logprobs.enabled:
            seed = seq.plan.sampling.seed or 0
            lp = tuple(model_logprob(seed, s, t, seq.plan.logprobs.top_n) for s, t in zip(states, tokens))
        return PendingRow(seq.handle, tokens, seq.frontier, lp, meta)

    def _next(self, seq: Seq, state: State) -> int:
        return model_token(seq.plan.sampling.seed or 0, state, self.eos_period)

    def prefill(self, handle: SequenceHandle, budget_tokens: int) -> PrefillProgress | PendingBatch:
        self._enter("prefill", handle)
        seq = self._sequence(handle)
        self._no_open_pending("prefill")
        remaining = len(seq.prompt) - seq.frontier
        if budget_tokens < 1 or remaining < 1:
            raise ProgramInvariantError(f"prefill of {handle}: budget {budget_tokens}, {remaining} left")
        start = seq.frontier
        chunk = seq.prompt[start : start + min(remaining, budget_tokens)]
        if remaining > budget_tokens:
            self._run(seq, chunk, None)
            seq.frontier += len(chunk)
            return PrefillProgress(consumed=len(chunk), remaining=remaining - len(chunk))
        out = seq.spares(1)[0]
        (state,) = self._run(seq, chunk, [out] * len(chunk))[-1:]
        token = self._next(seq, state)
        row = self._row(seq, (token,), [state], Commit((out,), consumed=len(chunk)))
        return self._open_batch("prefill", [row])

    def decode(
        self,
        handles: Sequence[SequenceHandle],
        budgets: Sequence[int],
        *,
        while_running: Callable[[], None] | None = None,
        repeat_expected: bool = False,
    ) -> PendingBatch:
        self._enter("decode", tuple(handles))
        self._no_open_pending("decode")
        if not handles or len(handles) > self.max_concurrency or len(budgets) != len(handles):
            raise ProgramInvariantError(f"decode of {len(handles)} rows with {len(budgets)} budgets")
        seqs = [self._sequence(h) for h in handles]
        if len({s.handle.index for s in seqs}) != len(seqs):
            raise ProgramInvariantError("a sequence appears twice in one decode unit")
        rows = []
        for seq, budget in zip(seqs, budgets):
            if seq.pending_input is None or not seq.state_valid or budget < 1:
                raise ProgramInvariantError(f"{seq.handle} is not decode-ready")
            if seq.frontier + 1 > seq.plan.max_total_tokens:
                raise ProgramInvariantError(f"{seq.handle} would grow past its reservation")
            rows.append(self._decode_row(seq, budget))
        if while_running is not None:
            while_running()
        return self._open_batch("decode", rows)

    def _decode_row(self, seq: Seq, budget: int) -> PendingRow:
        assert seq.pending_input is not None
        k = self.spec_k
        if k == 0:
            out = seq.spares(1)
            (state,) = self._run(seq, [seq.pending_input], out)
            return self._row(seq, (self._next(seq, state),), [state], Commit(out))
        # a verify round: the inputs are the pending token and K drafts, right for a while
        base = self.slot_data.get(seq.current, State())
        truth: list[int] = []
        s = base.then((seq.pending_input,))
        for _ in range(k):
            truth.append(self._next(seq, s))
            s = s.then((truth[-1],))
        drafts = []
        for i, t in enumerate(truth):
            right = mix(seq.plan.sampling.seed or 0, seq.frontier, i, 3) % self.draft_hit_rate != 0
            drafts.append(t if right else VOCAB[(VOCAB.index(t) + 1) % len(VOCAB)] if t != EOS else VOCAB[0])
        inputs = [seq.pending_input, *drafts]
        out = seq.spares(k + 1)
        states = self._run(seq, inputs, out)
        for p in range(seq.frontier, seq.frontier + 2 * k):  # the drafter's chain: K - 1 positions more
            self._write(seq, p, p, self.drafter_kv)
        produced: list[int] = []
        for i, state in enumerate(states):
            token = self._next(seq, state)
            produced.append(token)
            if len(produced) >= budget or i >= k or drafts[i] != token:
                break
        hits = next((i for i, (a, b) in enumerate(zip(produced, drafts)) if a != b), min(len(produced), k))
        row = self._row(seq, tuple(produced), states[: len(produced)], Commit(out))
        return row._replace(drafted=k, draft_hits=hits)

    def force(self, handle: SequenceHandle, tokens: Sequence[int]) -> PendingBatch:
        self._enter("force", handle)
        seq = self._sequence(handle)
        self._no_open_pending("force")
        tokens = tuple(int(t) for t in tokens)
        if not tokens or seq.pending_input is None or not seq.state_valid:
            raise ProgramInvariantError(f"forced control on {handle} with {len(tokens)} tokens")
        if seq.frontier + len(tokens) > seq.plan.max_total_tokens:
            raise ProgramInvariantError(f"forced tokens would grow {handle} past its reservation")
        inputs = (seq.pending_input, *tokens[:-1])
        out = seq.spares(1)[0]
        states = self._run(seq, inputs, [out] * len(inputs))
        row = self._row(seq, tokens, states, Commit((out,), consumed=len(inputs)))
        return self._open_batch("force", [row])

    def commit(self, pending: PendingBatch, decisions: Sequence[RowDecision]) -> None:
        self._enter("commit", (pending, tuple(decisions)))
        self._check_pending(pending)
        validate_decisions(pending, decisions)
        pending._consume()
        self._open = None
        for row, decision in zip(pending.rows, decisions):
            self.decisions.append((pending.kind, row, decision))
            seq = self._sequence(row.handle)
            commit: Commit = row.accept_meta
            accepted = decision.accepted_tokens
            if commit.consumed is None:
                if accepted:
                    seq.frontier += accepted
                    seq.current = commit.out_slots[accepted - 1]
            elif pending.kind == "prefill" or (accepted == row.produced and not decision.cancelled):
                seq.frontier += commit.consumed
                seq.current = commit.out_slots[0]
            elif accepted:
                seq.state_valid = False
            if accepted:
                seq.pending_input = row.tokens[accepted - 1]
                seq.generated.extend(row.tokens[:accepted])
                if pending.kind != "force":
                    seq.rng_draws += accepted
            state = self.slot_data.get(seq.current, State())
            if seq.state_valid and state.tokens != seq.tokens[: seq.frontier]:
                self.violations.append(f"{seq.handle}: commit selected a slot of another state")

    def abort_pending(self, pending: PendingBatch) -> None:
        self._enter("abort_pending", pending)
        self._check_pending(pending)
        pending._consume()
        self._open = None

    # ---- internals ------------------------------------------------------------------------------
    def _open_batch(self, kind: PendingKind, rows: Sequence[PendingRow]) -> PendingBatch:
        pending = PendingBatch(self.owner, next(self._batch_ids), kind, rows)
        self._open = pending
        return pending

    def _sequence(self, handle: SequenceHandle) -> Seq:
        seq = self._seqs.get(handle.index) if handle.owner == self.owner else None
        if seq is None or seq.handle.generation != handle.generation:
            raise ProgramInvariantError(f"stale or foreign sequence handle {handle}")
        return seq

    def _check_pending(self, pending: PendingBatch) -> None:
        if pending.owner != self.owner or pending is not self._open:
            raise ProgramInvariantError(f"{pending!r} is not this Program's open batch")

    def _no_open_pending(self, what: str) -> None:
        if self._open is not None:
            raise ProgramInvariantError(f"{what} while {self._open!r} is unconsumed")
