"""A real, model-free implementation of the Program contract, for Engine tests.

Next token = a hash of (seed, position, previous token) over a small vocabulary (lowercase letters and
an end-of-sequence id), so runs are deterministic and independent of batching. Accounting is real:
sequences, StateImage slots (current + spare per sequence) and KV pages, with complete growth reservation
at plan time and page-level capacity, so blocking and infeasibility happen. Fault switches make a chosen
call raise; hooks let a test act while a unit is "on the GPU" (e.g. cancel a request mid-unit).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ninfer.runtime.contract.constraint import RowConstraint
from ninfer.runtime.contract.types import (
    Blocked,
    CheckpointEntry,
    Infeasible,
    PendingBatch,
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
    StalePlan,
    TokenLogprob,
    WindowScores,
    validate_decisions,
)

EOS = 0
VOCAB: tuple[int, ...] = tuple(range(ord("a"), ord("z") + 1))
SLOTS_PER_SEQUENCE = 2  # current GDN state slot + one spare for the provisional next state
_program_ids = itertools.count(1)


class ScriptedFault(RuntimeError):
    """Raised by an armed fault switch."""


def mix(*values: int) -> int:
    """A small 64-bit mixing hash (splitmix64 finalizer over the folded inputs)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h ^= (v + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h


def next_token(seed: int, position: int, previous: int, eos_period: int) -> int:
    """The scripted model: deterministic in (seed, position, previous token)."""
    h = mix(seed, position, previous)
    if eos_period and h % eos_period == 0:
        return EOS
    return VOCAB[(h >> 8) % len(VOCAB)]


def token_logprob(seed: int, position: int, token: int, top_n: int) -> TokenLogprob:
    lp = -0.01 - (mix(seed, position, token, 7) % 1000) / 100.0
    top = tuple((VOCAB[(token + i) % len(VOCAB)], lp - 0.5 * (i + 1)) for i in range(top_n))
    return TokenLogprob(token, lp, top)


def mask_allows(mask: Any, token: int) -> bool:
    """Whether a bitmask (int32 words, bit t % 32 of word t // 32) allows ``token``."""
    word = token // 32
    return word < len(mask) and bool((int(mask[word]) >> (token % 32)) & 1)


def constrained(tokens: tuple[int, ...], constraint: RowConstraint | None) -> tuple[int, ...]:
    """A unit's tokens under a row's grammar, as a verify would make them: the row's masks for the
    scripted continuation (one ``masks`` call), kept while each token is allowed; the first refused one
    becomes the next allowed token after it (cyclically) and ends the row's tokens."""
    if constraint is None:
        return tokens
    masks = constraint.masks(tokens[:-1])
    out: list[int] = []
    for token, mask in zip(tokens, masks):
        if mask is None or mask_allows(mask, token):
            out.append(token)
            continue
        width = 32 * len(mask)
        allowed = next((t % width for t in range(token, token + width) if mask_allows(mask, t % width)), None)
        if allowed is None:
            raise ProgramInvariantError("a row's mask allows no token")
        out.append(allowed)
        break
    return tuple(out)


@dataclass
class _Sequence:
    handle: SequenceHandle
    plan: RequestPlan
    reserved_pages: int
    frontier: int = 0  # committed positions (prompt + accepted output)
    prompt_consumed: int = 0
    terminal: bool = False
    output: list[int] = field(default_factory=list)  # committed output tokens
    rng_draws: int = 0  # sampled tokens committed (forced tokens never count)

    @property
    def prompt_done(self) -> bool:
        return self.prompt_consumed == len(self.plan.prompt_token_ids)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.plan.prompt_token_ids[-1]


@dataclass
class _Txn:
    plan: ResourcePlan
    polls_left: int


class ScriptedProgram:
    """See module docstring. Also a ``BackfillProver`` when built with ``backfill=True``."""

    def __init__(
        self,
        *,
        max_concurrency: int = 4,
        max_context: int = 256,
        page_size: int = 8,
        kv_pages: int = 64,
        state_slots: int | None = None,
        spec_k: int = 1,
        materialize_polls: int = 0,
        eos_period: int = 16,
        faults: dict[str, int] | None = None,
    ) -> None:
        self.program_id = next(_program_ids)
        self._max_concurrency = max_concurrency
        self._max_context = max_context
        self._page_size = page_size
        self.kv_pages = kv_pages
        self.state_slots = state_slots if state_slots is not None else SLOTS_PER_SEQUENCE * max_concurrency
        self.spec_k = spec_k
        self.materialize_polls = materialize_polls
        self.eos_period = eos_period
        self.faults = dict(faults or {})
        self.force_logprobs = True  # False: force rows carry no logprobs (allowed by the contract)
        self.calls: dict[str, int] = {}
        self.call_log: list[str] = []
        self._revision = 0
        self._generation = [0] * max_concurrency
        self._seqs: dict[int, _Sequence] = {}
        self._txn: tuple[int, _Txn] | None = None
        self._txn_ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._open: PendingBatch | None = None
        # test hooks
        self.on_start: Callable[[RequestPlan], None] | None = None
        self.on_decode: Callable[[Sequence[SequenceHandle]], None] | None = None
        self.on_execute: Callable[[str, Sequence[SequenceHandle]], None] | None = None
        self.on_release: Callable[[_Sequence], None] | None = None
        self.call_while_running = True  # False: a Program that never calls decode's while_running
        self.repeat_hints: list[bool] = []  # decode's repeat_expected, call by call (contract rule 13)
        self.constraint_rounds: list[bool] = []  # whether each decode call carried constraints (rule 15)

    # ---- static facts ----
    @property
    def max_concurrency(self) -> int:
        return self._max_concurrency

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def resource_revision(self) -> int:
        return self._revision

    def capacity(self) -> ResourceCapacity:
        return ResourceCapacity(
            self._max_concurrency, self.state_slots, self.kv_pages, self._page_size, self._max_context
        )

    # ---- accounting ----
    def _pages(self, positions: int) -> int:
        return -(-positions // self._page_size)

    def _reserved(self) -> int:
        held = sum(s.reserved_pages for s in self._seqs.values())
        if self._txn is not None:
            held += self._txn[1].plan.reserved.kv_pages_reserved
        return held

    def _slots_used(self) -> int:
        return SLOTS_PER_SEQUENCE * (len(self._seqs) + (1 if self._txn is not None else 0))

    def usage(self) -> ResourceUsage:
        return ResourceUsage(
            sequences=len(self._seqs),
            state_slots=self._slots_used(),
            kv_pages_mapped=sum(self._pages(s.frontier) for s in self._seqs.values()),
            kv_pages_reserved=self._reserved(),
            open_transactions=1 if self._txn is not None else 0,
            open_pending_batches=1 if self._open is not None else 0,
        )

    def sequences(self) -> list[_Sequence]:
        return list(self._seqs.values())

    # ---- fault switches ----
    def _enter(self, name: str) -> None:
        n = self.calls.get(name, 0) + 1
        self.calls[name] = n
        self.call_log.append(name)
        if self.faults.get(name) == n:
            raise ScriptedFault(f"injected fault in {name} (call {n})")

    def _seq(self, handle: SequenceHandle) -> _Sequence:
        seq = self._seqs.get(handle.index)
        if handle.owner != self.program_id or seq is None or seq.handle != handle:
            raise ProgramInvariantError(f"stale or foreign handle {handle}")
        return seq

    def _no_open_batch(self) -> None:
        if self._open is not None:
            raise ProgramInvariantError("a new unit while a PendingBatch is unconsumed")

    # ---- materialization ----
    def plan_materialization(
        self, request: RequestPlan, candidates: Sequence[CheckpointEntry] = ()
    ) -> ResourcePlan | Blocked | Infeasible:
        self._enter("plan_materialization")
        total = request.max_total_tokens
        need = self._pages(total)
        if total > self._max_context:
            return Infeasible(
                f"needs {total} positions, max_context is {self._max_context}; lower max_tokens"
            )
        if need > self.kv_pages:
            return Infeasible(
                f"needs {need} KV pages for prompt + max_tokens, the pool holds {self.kv_pages}; "
                "lower max_tokens"
            )
        free_seq = len(self._seqs) + (1 if self._txn else 0) < self._max_concurrency
        if not free_seq:
            return Blocked("no free sequence")
        if self.state_slots - self._slots_used() < SLOTS_PER_SEQUENCE:
            return Blocked("no free state slots")
        if self.kv_pages - self._reserved() < need:
            return Blocked(f"needs {need} KV pages, {self.kv_pages - self._reserved()} unreserved")
        reserved = ResourceUsage(sequences=1, state_slots=SLOTS_PER_SEQUENCE, kv_pages_reserved=need)
        return ResourcePlan(self.program_id, self._revision, reserved, sealed=request)

    def start(self, plan: ResourcePlan) -> RunningTransaction:
        self._enter("start")
        if plan.owner != self.program_id:
            raise ProgramInvariantError("foreign plan")
        if plan.resource_revision != self._revision:
            raise StalePlan(f"plan sealed at {plan.resource_revision}, now {self._revision}")
        if self._txn is not None:
            raise ProgramInvariantError("a second open transaction")
        assert isinstance(plan.sealed, RequestPlan)
        if self.on_start is not None:
            self.on_start(plan.sealed)
        txn_id = next(self._txn_ids)
        self._txn = (txn_id, _Txn(plan, self.materialize_polls))
        self._revision += 1
        return RunningTransaction(self.program_id, txn_id, plan)

    def _open_txn(self, txn: RunningTransaction) -> _Txn:
        if self._txn is None or self._txn[0] != txn.transaction_id or txn.owner != self.program_id:
            raise ProgramInvariantError(f"unknown transaction {txn.transaction_id}")
        return self._txn[1]

    def poll(self, txn: RunningTransaction) -> bool:
        state = self._open_txn(txn)
        if state.polls_left > 0:
            state.polls_left -= 1
            return False
        return True

    def finish(self, txn: RunningTransaction) -> ResourceResult:
        self._enter("finish")
        state = self._open_txn(txn)
        if state.polls_left:
            raise ProgramInvariantError("finish before the transaction completed")
        index = next(i for i in range(self._max_concurrency) if i not in self._seqs)
        self._generation[index] += 1
        handle = SequenceHandle(self.program_id, index, self._generation[index])
        request = state.plan.sealed
        assert isinstance(request, RequestPlan)
        self._seqs[index] = _Sequence(handle, request, state.plan.reserved.kv_pages_reserved)
        self._txn = None
        self._revision += 1
        return ResourceResult("materialized", self._revision, handle=handle)

    def abort(self, txn: RunningTransaction) -> ResourceResult:
        self._enter("abort")
        self._open_txn(txn)
        self._txn = None
        self._revision += 1
        return ResourceResult("aborted", self._revision)

    # ---- execution ----
    def _row(self, seq: _Sequence, tokens: tuple[int, ...], base: int) -> PendingRow:
        lp = None
        if seq.plan.logprobs.enabled:
            lp = tuple(
                token_logprob(seq.plan.sampling.seed, base + i, t, seq.plan.logprobs.top_n)
                for i, t in enumerate(tokens)
            )
        return PendingRow(seq.handle, tokens, base, lp)

    def _sample(self, seq: _Sequence, start: int, previous: int, n: int) -> tuple[int, ...]:
        out: list[int] = []
        for i in range(n):
            previous = next_token(seq.plan.sampling.seed, start + i, previous, self.eos_period)
            out.append(previous)
        return tuple(out)

    def prefill(
        self, handle: SequenceHandle, budget_tokens: int, *, constraint: RowConstraint | None = None
    ) -> PrefillProgress | PendingBatch:
        self._enter("prefill")
        self._no_open_batch()
        seq = self._seq(handle)
        prompt_len = len(seq.plan.prompt_token_ids)
        remaining = prompt_len - seq.prompt_consumed
        if remaining <= 0 or seq.terminal:
            raise ProgramInvariantError("prefill of a sequence without prompt left")
        if self.on_execute is not None:
            self.on_execute("prefill", [handle])
        if remaining > budget_tokens:
            seq.prompt_consumed += budget_tokens
            seq.frontier += budget_tokens
            return PrefillProgress(budget_tokens, remaining - budget_tokens)
        tokens = constrained(self._sample(seq, prompt_len, seq.plan.prompt_token_ids[-1], 1), constraint)
        batch = PendingBatch(self.program_id, next(self._batch_ids), "prefill",
                             [self._row(seq, tokens, prompt_len)], provisional={"chunk": remaining})
        self._open = batch
        return batch

    def decode(
        self,
        handles: Sequence[SequenceHandle],
        budgets: Sequence[int],
        *,
        while_running: Callable[[], None] | None = None,
        repeat_expected: bool = False,
        constraints: Sequence[RowConstraint | None] | None = None,
    ) -> PendingBatch:
        self._enter("decode")
        self.repeat_hints.append(repeat_expected)
        self.constraint_rounds.append(constraints is not None)
        if constraints is not None and len(constraints) != len(handles):
            raise ProgramInvariantError("one constraint (or None) per row")
        self._no_open_batch()
        if not handles or len(handles) != len(budgets) or len(set(handles)) != len(handles):
            raise ProgramInvariantError("decode needs distinct handles, one budget each")
        if self.on_decode is not None:
            self.on_decode(handles)
        rows = []
        for i, (handle, budget) in enumerate(zip(handles, budgets)):
            seq = self._seq(handle)
            if not seq.prompt_done or seq.terminal or budget < 1:
                raise ProgramInvariantError(f"decode of a sequence that is not decode-ready: {handle}")
            n = min(self.spec_k, budget)
            tokens = self._sample(seq, seq.frontier, seq.last_token, n)
            if constraints is not None:
                tokens = constrained(tokens, constraints[i])
            rows.append(self._row(seq, tokens, seq.frontier))
        if self.on_execute is not None:
            self.on_execute("decode", handles)
        if while_running is not None and self.call_while_running:
            while_running()  # as the real Program: after the unit is queued, before its tokens exist
        self._open = PendingBatch(self.program_id, next(self._batch_ids), "decode", rows)
        return self._open

    def force(self, handle: SequenceHandle, tokens: Sequence[int]) -> PendingBatch:
        self._enter("force")
        self._no_open_batch()
        seq = self._seq(handle)
        if not seq.prompt_done or seq.terminal or not tokens:
            raise ProgramInvariantError("force on a sequence that cannot take tokens")
        if self.on_execute is not None:
            self.on_execute("force", [handle])
        row = self._row(seq, tuple(tokens), seq.frontier)
        if not self.force_logprobs:
            row = PendingRow(row.handle, row.tokens, row.base_frontier)
        self._open = PendingBatch(self.program_id, next(self._batch_ids), "force", [row])
        return self._open

    def commit(self, pending: PendingBatch, decisions: Sequence[RowDecision]) -> None:
        self._enter("commit")
        if pending is not self._open:
            raise ProgramInvariantError("commit of a batch that is not the open one")
        validate_decisions(pending, decisions)  # an illegal disposition leaves the batch open (abortable)
        pending._consume()
        self._open = None
        for row, decision in zip(pending.rows, decisions):
            seq = self._seq(row.handle)
            if pending.kind == "prefill":
                seq.frontier += pending.provisional["chunk"]
                seq.prompt_consumed = len(seq.plan.prompt_token_ids)
            if seq.frontier != row.base_frontier:
                raise ProgramInvariantError("row base frontier does not match the committed frontier")
            accepted = row.tokens[: decision.accepted_tokens]
            seq.frontier += len(accepted)
            seq.output.extend(accepted)
            if pending.kind != "force":
                seq.rng_draws += len(accepted)
            if self._pages(seq.frontier) > seq.reserved_pages:
                raise ProgramInvariantError("growth beyond the reservation")
            seq.terminal = seq.terminal or decision.terminal

    def abort_pending(self, pending: PendingBatch) -> None:
        self._enter("abort_pending")
        if pending is not self._open:
            raise ProgramInvariantError("abort of a batch that is not the open one")
        pending._consume()
        self._open = None

    def release(self, handle: SequenceHandle) -> ResourceResult:
        self._enter("release")
        seq = self._seq(handle)
        if self._open is not None and any(r.handle == handle for r in self._open.rows):
            raise ProgramInvariantError("release of a sequence inside an unconsumed PendingBatch")
        if self.on_release is not None:
            self.on_release(seq)
        del self._seqs[handle.index]
        self._revision += 1
        return ResourceResult("released", self._revision, handle=handle)


@dataclass(frozen=True)
class ProofAttempt:
    """One ``prove_backfill`` call, by prompts (the tests' request identities)."""

    head: bytes
    donors: tuple[bytes, ...]
    borrower: bytes
    proved: bool


class ProvingProgram(ScriptedProgram):
    """A ScriptedProgram that can prove backfills: while the borrower holds its whole reservation, the
    end of the donors alone must leave room for the head (root source; no cache exists here). Every
    call is logged in ``proofs``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.proofs: list[ProofAttempt] = []

    def prove_backfill(
        self, head: RequestPlan, donors: Sequence[SequenceHandle], borrower: RequestPlan
    ) -> ResourcePlan | None:
        proof = self._prove(head, donors, borrower)
        self.proofs.append(ProofAttempt(
            bytes(head.prompt_token_ids),
            tuple(bytes(self._seq(h).plan.prompt_token_ids) for h in donors),
            bytes(borrower.prompt_token_ids),
            proof is not None,
        ))
        return proof

    def _prove(
        self, head: RequestPlan, donors: Sequence[SequenceHandle], borrower: RequestPlan
    ) -> ResourcePlan | None:
        outcome = self.plan_materialization(borrower)
        if not isinstance(outcome, ResourcePlan):
            return None
        donor_pages = sum(self._seq(h).reserved_pages for h in donors)
        donor_seqs = len(donors)
        borrower_pages = self._pages(borrower.max_total_tokens)
        pages_after = self.kv_pages - self._reserved() - borrower_pages + donor_pages
        seqs_after = self._max_concurrency - len(self._seqs) - 1 + donor_seqs
        if pages_after >= self._pages(head.max_total_tokens) and seqs_after >= 1:
            return outcome
        return None


class ScriptedScoringProgram:
    """ScoringProgram whose numbers encode the in-window context length, so tests can see which window
    produced each value:

    - token at in-window index ``ctx >= 1``: logprob ``-(ctx) - token/1000``; its alternatives are
      ``(token + j, logprob - j)`` for ``j < top_n``, so the token itself is the greedy one and each
      alternative carries the same ``ctx`` as the logprob;
    - after the last of ``n`` tokens: ``(last + 1 + j, -(n) - j)`` for ``j < max(top_n, 1)``.

    ``windows`` logs every window's tokens, ``calls`` every call as ``(token_ids, top_n, predict_next)``.
    """

    def __init__(self, max_context: int = 64) -> None:
        self._max_context = max_context
        self.windows: list[tuple[int, ...]] = []
        self.calls: list[tuple[tuple[int, ...], int, bool]] = []

    @property
    def max_context(self) -> int:
        return self._max_context

    def score_window(
        self, token_ids: Sequence[int], top_n: int = 0, *, predict_next: bool = False
    ) -> WindowScores:
        ids = tuple(token_ids)
        if not 1 <= len(ids) <= self._max_context:
            raise ValueError("window size outside 1..max_context")
        self.windows.append(ids)
        self.calls.append((ids, top_n, predict_next))
        logprobs = tuple(-(float(ctx)) - ids[ctx] / 1000.0 for ctx in range(1, len(ids)))
        top = tuple(
            tuple((ids[ctx] + j, lp - j) for j in range(top_n)) for ctx, lp in enumerate(logprobs, start=1)
        ) if top_n else ()
        next_top = ()
        if predict_next:
            next_top = tuple((ids[-1] + 1 + j, -float(len(ids)) - j) for j in range(max(top_n, 1)))
        return WindowScores(logprobs=logprobs, top=top, next_top=next_top)
