"""The package-neutral Program contract: the only way the Engine touches physical model state.

The Engine (``ninfer/runtime/engine``) owns request order, lifecycle and publication; the Program
(``ninfer/targets/qwen3_6/impl/runtime``, instantiated per package) owns every physical fact: active
sequences, State/KV stores, allocators, reservations, provisional model state, RNG, workspaces and graphs.
This module is what they share: a ``Program`` Protocol plus plain, immutable values. It imports neither
torch nor a target, so the Engine stays model-free (see docs/engine.md, docs/resources-and-context-cache.md).

Rules every Program implementation must keep (each method's docstring repeats the local ones):

1. **Single thread.** Only the Engine worker thread calls a Program. No method is re-entrant; the Program
   needs no locks for the Engine's sake.
2. **No request knowledge.** The Program never sees FIFO position, session keys, users or request ids.
   It sees ``RequestPlan`` (what to materialize), ``SequenceHandle`` (which active sequence) and
   ``CheckpointEntry`` (which cache candidate), nothing else.
3. **Complete growth reservation.** A ``ResourcePlan`` reserves everything the request can ever need:
   ``len(prompt) + max_new_tokens`` KV positions (rounded up to pages), its state slots and spares, its
   execution row. Once ``finish`` returns a sequence, no other request or inactive cache can take away
   its ability to finish. ``plan_materialization`` never over-commits.
4. **Sealed plans, one transition at a time.** A plan is bound to the ``resource_revision`` it was made
   at. ``start`` of a plan whose revision is stale raises ``StalePlan`` with *no side effect* (the Engine
   re-plans). Every transition that changes global allocation (start, finish, abort, release, capture,
   placement) advances ``resource_revision``. Once started, a transaction cannot change source, victims
   or stage order; it ends in exactly one of ``finish`` or ``abort``, both returning a complete
   ``ResourceResult``.
5. **Move-only PendingBatch.** ``prefill`` (final chunk), ``decode`` and ``force`` return a
   ``PendingBatch`` holding provisional state only: the committed frontier, recurrent state, KV
   frontier, RNG and speculative state of every member are unchanged until ``commit``. Exactly one of
   ``commit(pending, decisions)`` or ``abort_pending(pending)`` consumes it whole; a second consumption,
   a decision list that does not match the frozen membership, or a new execution unit while a batch is
   unconsumed is a ``ProgramInvariantError``. (Provisional device work the Program queues on its own,
   rule 13's lookahead, is not an execution unit: it changes nothing committed and reaches the Engine
   only as the unit it later asks for.) ``abort_pending`` leaves every member exactly as before
   the unit.
6. **Accepted-prefix commit.** ``commit`` commits, atomically per batch, the accepted prefix of every
   row: Main KV frontier, backend KV, recurrent/conv state of the accepted position, RNG and speculative
   state. Rules on decisions (checked by ``validate_decisions``): a non-cancelled row has
   ``1 <= accepted <= produced``; a nonterminal row has ``accepted == produced``; a cancelled row has
   ``accepted == 0`` and is terminal. A terminal row stays an active sequence until ``release``.
7. **Forced control.** ``force(handle, tokens)`` runs the given tokens (from the Frontend) through the
   model exactly like sampled tokens, but calls no sampler and never advances the sampling RNG, neither
   on execution nor on commit.
8. **Sampling RNG advances only on commit**, and only for sampled tokens. Seeded sampling must be
   reproducible regardless of which other rows share a batch (e.g. counter-based: seed x position).
9. **Handles are checked.** Every method taking a ``SequenceHandle`` verifies ``owner`` (this Program
   instance) and ``generation`` (the sequence slot has not been released and reused since); a mismatch
   raises ``ProgramInvariantError``.
10. **Exact B.** ``decode`` receives exactly the rows to run (``B = len(handles)``, 1..max_concurrency),
    never padding; the Program may pick a graph by exact ``B`` but request identity and page ids are data.
11. **Failure.** Any exception other than ``StalePlan`` (from ``start``) means the Program can no longer
    vouch for its shared state: the Engine fails as a whole, calls ``abort_pending``/``abort``/``release``
    best-effort for cleanup, and never calls the Program again. Request-level problems are reported as
    values (``Infeasible``), never raised.
12. **The decode overlap hook.** ``decode(..., while_running=f)`` calls ``f`` at most once, synchronously
    on the calling thread, after the unit is queued on the device and before its tokens are read back,
    and never keeps it. ``f`` is the Engine's own host work and never calls the Program (rule 1); an
    exception from it propagates out of ``decode`` with no PendingBatch opened (the Engine then fails).
13. **The repeat hint.** ``decode(..., repeat_expected=True)`` says the Engine expects its next unit to be
    this decode round again, less the rows it ends by length, unless a row ends early or asks for forced
    control (no prefill is staged, no request waits for a lane a row frees). A Program may then queue
    that round behind this one before it is committed (the decode lookahead: provisional state only,
    rules 5 and 6 unchanged, dropped unread unless the next call is exactly that round). The hint only
    saves or wastes device time; it never changes a token.
14. **Usage is truthful.** ``usage()`` reports what is actually held (sequences, state slots, mapped and
    reserved pages, open transactions, open pending batches); after every request has ended it must
    equal the baseline taken after construction/warmup (checkpoints aside).
15. **Constrained rows** (structured outputs). ``prefill(..., constraint=c)`` and ``decode(...,
    constraints=[c or None per row])`` carry a row's `RowConstraint`: before it samples a row's tokens the
    Program calls ``c.masks(drafts)`` once (``drafts`` empty for one-token decoding, a speculative unit's
    drafts otherwise) and samples each position from the logits with the disallowed tokens at -inf (the
    greedy choice, the sampled draw, the verify's acceptance and the reported log-probs all of that
    masked distribution). A ``None`` mask leaves the position unconstrained. The Program never keeps a
    constraint past the call, queues no lookahead past a constrained row, and the Engine advances the
    row's matcher only after ``commit``, so ``abort_pending`` or a partial accept needs nothing undone. A
    call without constraints is exactly the unconstrained unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol, runtime_checkable

from ninfer.runtime.contract.constraint import RowConstraint

# ---------------------------------------------------------------------------------------------------
# Errors a Program raises (anything else it raises is also an Engine-wide failure)
# ---------------------------------------------------------------------------------------------------


class StalePlan(Exception):
    """``start`` was given a plan sealed at an older ``resource_revision``; nothing changed, re-plan."""


class ProgramInvariantError(RuntimeError):
    """The Program detected a contract break (bad handle, double consumption, mismatched decisions).

    The Engine treats it as an Engine-wide failure: shared physical state can no longer be explained.
    """


# ---------------------------------------------------------------------------------------------------
# Identities and summaries
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SequenceHandle:
    """Opaque name of one active sequence inside one Program.

    ``owner`` identifies the Program instance that issued it, ``index`` is a Program-private slot number
    and ``generation`` changes every time that slot is released and reused, so a stale handle is caught.
    The Engine never derives a lane, a state slot, a KV row or a batch row from a handle: they are
    different identities (a batch row is only a position in the current ``PendingBatch``).
    """

    owner: int
    index: int
    generation: int


@dataclass(frozen=True, slots=True)
class ResourceCapacity:
    """Static facts fixed when the Program is built (before the Engine accepts requests)."""

    max_sequences: int  # concurrently active sequences (control/state/table resources), >= max_concurrency
    state_slots: int  # StateImage slots in the pool (current + spares for every sequence)
    kv_pages: int  # pages in the shared paged KV pool(s), counted in pages of `page_size` positions
    page_size: int  # KV positions per page
    max_context: int  # longest sequence (prompt + generated) one request may reach
    kv_page_bytes: int = 0  # device bytes of one page id in every KV pool (0: not said)
    host_state_slots: int = 0  # state slots of the host tier for offloaded checkpoints (0: no tier)
    host_kv_pages: int = 0  # KV pages of the host tier
    gpu_memory_fraction: float | None = None  # the device-memory share the pools were sized under, if so
    memory_plan: str = ""  # one line: how the Program divided the memory ("" when it does not say)


@dataclass(frozen=True, slots=True)
class ResourceUsage:
    """What the Program holds right now; compared against the idle baseline by tests and the Engine.

    The first six fields count active work (sequences, open transactions and batches): after every
    request has ended they equal the baseline. What published checkpoints hold is reported apart, in the
    last five fields (device and host tier), which equality ignores ("checkpoints aside", rule 14): after
    the cache is cleared they are 0.
    """

    sequences: int = 0  # active sequences (materialized, not yet released)
    state_slots: int = 0  # StateImage slots owned by active sequences or transactions
    kv_pages_mapped: int = 0  # pages that hold written KV positions of active sequences
    kv_pages_reserved: int = 0  # pages promised to active sequences / transactions (includes mapped ones)
    open_transactions: int = 0  # started resource transactions not yet finished or aborted
    open_pending_batches: int = 0  # PendingBatches not yet committed or aborted (0 or 1)
    checkpoints: int = field(default=0, compare=False)  # published checkpoints held (every tier)
    checkpoint_state_slots: int = field(default=0, compare=False)  # device slots only checkpoints hold
    checkpoint_kv_pages: int = field(default=0, compare=False)  # device pages only checkpoints hold
    host_checkpoints: int = field(default=0, compare=False)  # checkpoints in the host tier
    host_kv_pages: int = field(default=0, compare=False)  # host-tier pages they hold


# ---------------------------------------------------------------------------------------------------
# Checkpoints (the context cache): the Program publishes them, the ResourceManager catalogs them
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    """One immutable, complete checkpoint the Program published: the State, Main KV and backend state of
    a sequence at one frontier, plus the identity of the prefix it continues.

    ``prefix_digest`` is `identity.prefix_digest` of the token ids before ``frontier_tokens`` (with the
    media inside them and the Program's ``prefix_salt``): a request whose prompt starts with the same
    prefix can continue from it. ``shared``: any matching request may use it, or only the session bound
    to it. ``nbytes``: device memory only this checkpoint holds (what evicting it frees), for the
    ResourceManager's value policy. The ResourceManager keeps these in its logical catalog and offers
    them back as candidate sources or eviction victims; the Program alone knows their slots and pages.
    """

    checkpoint_id: int
    prefix_digest: str
    frontier_tokens: int
    shared: bool = True
    nbytes: int = 0


CheckpointTier = Literal["device", "host"]


@dataclass(frozen=True, slots=True)
class CheckpointPlacement:
    """A checkpoint a transition moved between tiers: ``tier`` is where it is now (``host``: offloaded
    from the device to the Program's host-memory tier; ``device``: restored from it), ``nbytes`` the
    memory of that tier only it holds now. A checkpoint is published on the device; it keeps its id and
    identity in every tier, and only a device checkpoint can be continued (a plan restores a host one
    first)."""

    checkpoint_id: int
    tier: CheckpointTier
    nbytes: int = 0


# ---------------------------------------------------------------------------------------------------
# Materialization: RequestPlan -> ResourcePlan -> RunningTransaction -> ResourceResult
# ---------------------------------------------------------------------------------------------------


_PENALTY_LIMIT = 2.0  # OpenAI / vLLM range for presence and frequency penalties
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One request's resolved sampling settings (OpenAI / vLLM meanings), as the Program and the sampler
    use them.

    ``temperature == 0`` means greedy. ``top_k == 0`` disables top-k, ``top_p == 1`` and ``min_p == 0``
    disable theirs, penalties at their neutral values (0, 0, 1) are off; the repetition penalty (HF/vLLM)
    divides positive and multiplies negative logits of seen tokens. ``seed`` is always set in a
    `RequestPlan`: the Engine draws one when the user gave none, so every request is reproducible from
    its plan. The Engine checks the request's values (``GenerationRequest.problems``, the model's defaults
    in ``Engine._plan``) before it builds one; `validate` is the sampler's own argument check.
    """

    seed: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs added to the logits after the penalties (OpenAI ``logit_bias``, -100..100)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # ``min_tokens_ids`` (end-of-sequence and stop token ids) cannot be drawn for the first ``min_tokens``
    # output tokens: output token k is drawn at absolute position len(prompt) + k
    min_tokens: int = 0
    min_tokens_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def biased(self) -> bool:
        """A logit bias or a min_tokens hold: the sampler adds a bias row (no graph argmax shortcut)."""
        return bool(self.logit_bias) or (self.min_tokens > 0 and bool(self.min_tokens_ids))

    @property
    def penalised(self) -> bool:
        """Any penalty away from neutral: the sampler needs the prompt mask and output counts."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and its allowed range."""
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -_PENALTY_LIMIT <= value <= _PENALTY_LIMIT:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        for pair in self.logit_bias:
            if (
                not isinstance(pair, tuple)
                or len(pair) != 2
                or not _is_int(pair[0])
                or pair[0] < 0
                or not _is_number(pair[1])
                or not -LOGIT_BIAS_LIMIT <= pair[1] <= LOGIT_BIAS_LIMIT
            ):
                raise ValueError(
                    f"logit_bias entries must be (token id >= 0, bias in [-100, 100]), got {pair!r}"
                )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if any(not _is_int(t) or t < 0 for t in self.min_tokens_ids):
            raise ValueError(f"min_tokens_ids must be token ids >= 0, got {self.min_tokens_ids!r}")
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64 - 1], got {self.seed!r}")


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class LogprobParams:
    """Whether rows carry the chosen token's logprob, and how many top alternatives (0..20)."""

    enabled: bool = False
    top_n: int = 0

    def validate(self) -> None:
        """Raise ValueError unless top_n is an integer in 0..20 (and 0 when log-probs are off)."""
        if not _is_int(self.top_n) or not 0 <= self.top_n <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_n!r}"
            )
        if self.top_n and not self.enabled:
            raise ValueError("top log-probs need log-probs enabled")


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """Everything the Program needs to materialize and run one request; nothing about who or when.

    ``prepared_prompt`` is the Frontend's owning prepared prompt, opaque to the Engine: the Program of
    the same family may read family-specific parts (vision pixels, MRoPE positions) from it. The plan's
    ``prompt_token_ids`` are authoritative for the text stream.
    """

    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    logprobs: LogprobParams
    content_digest: str  # prefix identity of the prompt (tokens + media), from the Frontend
    prepared_prompt: object | None = None
    # (token offset, token count, media digest) of each media item in the prompt: part of every prefix
    # identity (`identity.prefix_digests`)
    media: tuple[tuple[int, int, str], ...] = ()

    @property
    def max_total_tokens(self) -> int:
        """The complete growth a materialization must reserve: prompt plus every allowed new token."""
        return len(self.prompt_token_ids) + self.max_new_tokens


@dataclass(frozen=True, slots=True, eq=False)
class ResourcePlan:
    """A sealed, opaque materialization plan, bound to the Program's ``resource_revision``.

    Only the Program that made it may start it (``owner``), and only while ``resource_revision`` is
    unchanged. ``reserved`` states the reservation the plan will hold (for diagnostics);
    ``reused_prefix_tokens`` the prompt positions a cache source will provide (0 without cache);
    ``sealed`` is the Program's private payload, never read by the Engine.
    """

    owner: int
    resource_revision: int
    reserved: ResourceUsage
    reused_prefix_tokens: int = 0
    source_checkpoint: int | None = None  # CheckpointEntry.checkpoint_id, None for root (empty) source
    sealed: object = None


@dataclass(frozen=True, slots=True)
class Blocked:
    """Feasible in principle, not now: active incumbents hold what the request needs.

    The request stays at the FIFO head; the Engine retries when a lane is released, a transition ends
    or ``resource_revision`` changes. ``reason`` names the missing resource (for logs).
    """

    reason: str


@dataclass(frozen=True, slots=True)
class Infeasible:
    """The request can never run, even from the root source with every inactive cache released.

    The Engine rejects only this request; ``reason`` must say what the user can change
    (e.g. "needs 5000 KV positions, the KV pool holds 4096; lower max_tokens").
    """

    reason: str


@dataclass(frozen=True, slots=True, eq=False)
class RunningTransaction:
    """A started resource transition (today only materialization); ends in one ``finish`` or ``abort``.

    Until it ends, the source named by the plan stays valid and the claim is held. ``sealed`` is private
    to the Program.
    """

    owner: int
    transaction_id: int
    plan: ResourcePlan
    sealed: object = None


ResultKind = Literal["materialized", "aborted", "released", "retained", "captured", "evicted"]


@dataclass(frozen=True, slots=True)
class ResourceResult:
    """The complete physical outcome of one transition, which the ResourceManager adopts as a whole.

    - ``materialized``: ``handle`` is the new active sequence, ``reused_prefix_tokens`` prompt positions
      came from a checkpoint (the remaining prompt suffix still needs prefill). It is always
      ``< len(prompt)``: at least the last prompt token is prefilled, so the final prefill chunk can
      sample the first token.
    - ``aborted``: the transaction ended without a sequence; every claim and pin is released.
    - ``released``: ``handle``'s sequence and its whole reservation are gone.
    - ``retained``: the terminal sequence became the ``published`` checkpoint (its reservation is gone).
    - ``captured``: an active sequence's state at its frontier was published as a checkpoint (``published``
      empty: nothing fitted, even after the evictions offered).
    - ``evicted``: the ``removed`` checkpoints and everything only they held are gone.
    ``published``/``removed`` list the catalog changes of any transition (a plan's eviction victims
    appear in ``removed`` of the transition that carries the plan out); ``placed`` the checkpoints it
    moved between the device and the host tier (a plan's or a capture's victims offloaded instead of
    dropped, a plan's host source restored), in the order it moved them. A checkpoint is in at most one
    of ``published``, ``removed`` and ``placed``.
    ``resource_revision`` is the Program's revision after the transition.
    """

    kind: ResultKind
    resource_revision: int
    handle: SequenceHandle | None = None
    reused_prefix_tokens: int = 0
    published: tuple[CheckpointEntry, ...] = ()
    removed: tuple[int, ...] = ()
    placed: tuple[CheckpointPlacement, ...] = ()


# ---------------------------------------------------------------------------------------------------
# Execution: PrefillProgress | PendingBatch -> RowDecision[] -> commit / abort_pending
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Logprob of one produced token, plus the top-n alternatives ``((token_id, logprob), ...)``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    """An intermediate prefill chunk: ``consumed`` prompt positions were committed directly (the prompt
    is known, nothing is provisional); ``remaining`` prompt positions are still to prefill."""

    consumed: int
    remaining: int


class PendingRow(NamedTuple):
    """One row of a PendingBatch: provisional tokens of one sequence.

    ``tokens`` are the produced (provisional) tokens, ``produced == len(tokens) >= 1``;
    ``base_frontier`` is the committed position the tokens start at (the Program turns Frontend-relative
    boundary positions into absolute ones with it); ``logprobs`` has one entry per produced token when
    the request asked for logprobs, else ``None`` (a ``force`` row may leave it ``None``: forced tokens
    were not sampled, and the Engine reports them with logprob 0.0); ``accept_meta`` is Program-private
    per-position metadata for the accepted-prefix commit (e.g. which speculative state to select);
    ``drafted`` and ``draft_hits`` count a speculative unit's drafts (observability: the Engine sums the
    hits among the tokens it accepts).

    A NamedTuple, as ``RowDecision``: the Program builds one per row of every unit, on the host path
    between two decode steps, where a frozen dataclass costs about 1 us more to build. It is immutable
    all the same; only the Program builds rows and only the Engine reads them, by field name.
    """

    handle: SequenceHandle
    tokens: tuple[int, ...]
    base_frontier: int
    logprobs: tuple[TokenLogprob, ...] | None = None
    accept_meta: object = None
    drafted: int = 0  # draft tokens a speculative unit proposed for the row
    draft_hits: int = 0  # how many of the leading ``tokens`` are drafts the verify accepted

    @property
    def produced(self) -> int:
        return len(self.tokens)


PendingKind = Literal["prefill", "decode", "force"]


class PendingBatch:
    """Move-only result of one execution unit: frozen membership + provisional state.

    Consumed whole by exactly one ``Program.commit(pending, decisions)`` or ``Program.abort_pending``;
    the Program calls ``_consume()`` first thing in both, which raises on a second consumption. The
    Engine never drops a row or keeps a batch across worker boundaries. ``provisional`` is the Program's
    private provisional state (scratch slots, KV extents, RNG draws).
    """

    __slots__ = ("owner", "batch_id", "kind", "rows", "provisional", "_consumed")

    def __init__(
        self,
        owner: int,
        batch_id: int,
        kind: PendingKind,
        rows: Sequence[PendingRow],
        provisional: object = None,
    ) -> None:
        if not rows:
            raise ProgramInvariantError("a PendingBatch has at least one row")
        self.owner = owner
        self.batch_id = batch_id
        self.kind: PendingKind = kind
        self.rows: tuple[PendingRow, ...] = tuple(rows)
        self.provisional = provisional
        self._consumed = False

    @property
    def consumed(self) -> bool:
        return self._consumed

    def _consume(self) -> None:
        """Mark the batch consumed; the Program calls this at the start of commit/abort_pending."""
        if self._consumed:
            raise ProgramInvariantError(f"PendingBatch {self.batch_id} consumed twice")
        self._consumed = True

    def __repr__(self) -> str:
        return (
            f"PendingBatch(id={self.batch_id}, kind={self.kind}, B={len(self.rows)}, "
            f"consumed={self._consumed})"
        )


class RowDecision(NamedTuple):
    """The Engine's disposition of one PendingBatch row, in row order.

    ``accepted_tokens`` is the committed prefix length. ``terminal`` means the request ends after this
    commit (stop, length, cancel); its sequence stays active until ``release``. ``cancelled`` rows accept
    0 tokens and are terminal. ``boundaries`` are Frontend-marked reconstructible prefix boundaries,
    relative to the row's ``base_frontier`` and within ``[1, accepted_tokens]`` (context cache seam).

    A NamedTuple: the Engine builds one per row of every unit on the host path between two decode
    steps, where a frozen dataclass costs about 1 us more to build. It is immutable all the same; only
    the Engine builds decisions and only the Program reads them, by field name.
    """

    handle: SequenceHandle
    accepted_tokens: int
    terminal: bool = False
    cancelled: bool = False
    boundaries: tuple[int, ...] = ()


def validate_decisions(pending: PendingBatch, decisions: Sequence[RowDecision]) -> None:
    """Raise ``ProgramInvariantError`` unless ``decisions`` is a legal disposition of ``pending``.

    The Program runs it in ``commit`` before consuming the batch, so an illegal disposition leaves the
    batch open for the Engine's failure path to abort (the Engine's decisions are legal by construction,
    see ``Committer.commit_unit``). It runs on every unit, so the row's name for a message is only
    formed when a check fails.
    """
    rows = pending.rows
    if len(decisions) != len(rows):
        raise ProgramInvariantError(
            f"batch {pending.batch_id}: {len(decisions)} decisions for {len(rows)} rows"
        )
    for i, (row, decision) in enumerate(zip(rows, decisions)):
        accepted = decision.accepted_tokens
        # identity first: the Engine passes the row's own handle, and handle equality is a Python call
        if decision.handle is not row.handle and decision.handle != row.handle:
            raise ProgramInvariantError(
                f"{_row_name(pending, i)}: decision for {decision.handle}, row is {row.handle}"
            )
        if decision.cancelled:
            if accepted != 0 or not decision.terminal:
                raise ProgramInvariantError(
                    f"{_row_name(pending, i)}: a cancelled row accepts 0 tokens and is terminal"
                )
        else:
            produced = len(row.tokens)
            if not 1 <= accepted <= produced:
                raise ProgramInvariantError(
                    f"{_row_name(pending, i)}: accepted {accepted} outside 1..{produced}"
                )
            if not decision.terminal and accepted != produced:
                raise ProgramInvariantError(
                    f"{_row_name(pending, i)}: a nonterminal row must accept all produced tokens"
                )
        for b in decision.boundaries:
            if not 1 <= b <= accepted:
                raise ProgramInvariantError(
                    f"{_row_name(pending, i)}: boundary {b} outside the accepted span"
                )


def _row_name(pending: PendingBatch, i: int) -> str:
    return f"batch {pending.batch_id} row {i}"


# ---------------------------------------------------------------------------------------------------
# The Program protocol (generation purpose) and the scoring protocol (causal_scoring purpose)
# ---------------------------------------------------------------------------------------------------


@runtime_checkable
class Program(Protocol):
    """The physical execution entry of one exact target package (generation purpose).

    Everything large (weights, State/KV pools, block tables, workspace, graphs) exists before the
    Engine calls any method here. See the module docstring for the rules.
    """

    @property
    def max_concurrency(self) -> int:
        """Active sequences the Program was built for (the Engine's lanes; 1..8)."""
        ...

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + generated tokens) the Program can hold for one request."""
        ...

    @property
    def page_size(self) -> int:
        """KV positions per page (fixed at start)."""
        ...

    @property
    def resource_revision(self) -> int:
        """Advances on every transition that changes global allocation or topology."""
        ...

    def capacity(self) -> ResourceCapacity:
        """Static capacity summary."""
        ...

    def usage(self) -> ResourceUsage:
        """What is held right now (truthful; see rule 12)."""
        ...

    def plan_materialization(
        self,
        request: RequestPlan,
        candidates: Sequence[CheckpointEntry] = (),
        evictable: Sequence[CheckpointEntry] = (),
    ) -> ResourcePlan | Blocked | Infeasible:
        """Decide, without side effects, whether ``request`` can be materialized now.

        Returns a sealed plan that reserves the request's complete growth (rule 3), ``Blocked`` when only
        active incumbents stand in the way, or ``Infeasible`` when not even an empty Program (root source,
        all inactive cache released) could run it. ``candidates`` are checkpoint sources the
        ResourceManager offers, best first (the plan names the one it continues, ``source_checkpoint``,
        and pins it until finish or abort); ``evictable`` are the inactive checkpoints it may evict to
        make room, in the order the ResourceManager would rather lose them (the plan seals its victims).
        With a host tier (`CheckpointPlacement`) the order is also the host tier's: a device victim is
        offloaded instead of dropped when the host has room for it, or gets it by dropping host
        checkpoints that come before it in the order; a candidate in the host tier is restored to the
        device as a stage of the plan, which must then fit its pages and state slot too (else the plan
        falls back to the next candidate, then the root).
        """
        ...

    def start(self, plan: ResourcePlan) -> RunningTransaction:
        """Begin the transition: take the claim and reservation. Raises ``StalePlan`` (no side effect) if
        ``plan.resource_revision`` is not current. At most one transaction is open at a time."""
        ...

    def poll(self, txn: RunningTransaction) -> bool:
        """True once ``finish(txn)`` will not block (copies/transfers done). Never mutates claims."""
        ...

    def finish(self, txn: RunningTransaction) -> ResourceResult:
        """Complete the transition: returns ``materialized`` with the new ``SequenceHandle`` (frontier =
        ``reused_prefix_tokens``; the rest of the prompt still to prefill)."""
        ...

    def abort(self, txn: RunningTransaction) -> ResourceResult:
        """Abandon the transition; returns ``aborted`` with every claim, pin and reservation undone."""
        ...

    def prefill(
        self, handle: SequenceHandle, budget_tokens: int, *, constraint: RowConstraint | None = None
    ) -> PrefillProgress | PendingBatch:
        """Consume up to ``budget_tokens`` of the sequence's remaining prompt.

        ``constraint``: the row's grammar, for the first sampled token of the final chunk (rule 15).

        If the rest of the prompt does not fit, commit a chunk of exactly ``budget_tokens`` positions
        directly and return ``PrefillProgress``. Otherwise run the final chunk and return a one-row
        ``PendingBatch`` (kind ``prefill``) whose single token is the first sampled token; the final
        chunk's prompt positions are part of its provisional state (commit keeps them even for a
        cancelled row; abort_pending rolls the frontier back to before the chunk).
        """
        ...

    def decode(
        self,
        handles: Sequence[SequenceHandle],
        budgets: Sequence[int],
        *,
        while_running: Callable[[], None] | None = None,
        repeat_expected: bool = False,
        constraints: Sequence[RowConstraint | None] | None = None,
    ) -> PendingBatch:
        """Run one decode unit for exactly these rows (``B = len(handles)``, no padding).

        ``budgets[i] >= 1`` caps the tokens row ``i`` may produce (remaining max_new_tokens); an ordinary
        decode produces 1, a speculative backend up to ``min(K + 1, budget)``.
        ``while_running``: the Engine's host work that touches no Program state, called once after the
        unit is queued on the device and before its tokens are read back, so the two overlap (rule 12).
        ``repeat_expected``: the Engine's next unit is likely this round again (rule 13).
        ``constraints``: one entry per row, the row's grammar or None (rule 15); None: no row has one.
        """
        ...

    def force(self, handle: SequenceHandle, tokens: Sequence[int]) -> PendingBatch:
        """Run Frontend-supplied tokens through the model for one sequence (kind ``force``): the row's
        ``tokens`` equal ``tokens``, no sampler runs, the sampling RNG does not advance (rule 7)."""
        ...

    def commit(self, pending: PendingBatch, decisions: Sequence[RowDecision]) -> None:
        """Consume ``pending`` and commit each row's accepted prefix atomically (rules 5, 6)."""
        ...

    def abort_pending(self, pending: PendingBatch) -> None:
        """Consume ``pending`` and roll every row back to its state before the unit (rule 5)."""
        ...

    def release(self, handle: SequenceHandle) -> ResourceResult:
        """End an active sequence: free its state slots, pages and reservation; ``released``."""
        ...


@runtime_checkable
class CheckpointProgram(Protocol):
    """Optional Program capability: publish checkpoints (the context cache). Each call is one complete
    resource transition (device copies are queued on the Program's stream, ahead of any later unit),
    made only when no other transition is open, and returns a complete `ResourceResult`."""

    @property
    def prefix_salt(self) -> str:
        """What the Program's checkpoints hold besides tokens (its package and decode backend): the salt
        of every prefix digest it publishes (`identity.prefix_digests`)."""
        ...

    def capture(self, handle: SequenceHandle, evictable: Sequence[CheckpointEntry] = ()) -> ResourceResult:
        """Publish the active sequence's state at its committed frontier (``captured``), evicting from
        ``evictable`` in order what it must to fit (offloading to the host tier as a plan does); nothing
        is published when even that does not fit."""
        ...

    def retain(self, handle: SequenceHandle, evictable: Sequence[CheckpointEntry] = ()) -> ResourceResult:
        """End a terminal sequence by turning it into a checkpoint (``retained``, the sequence and the
        rest of its reservation gone); a sequence that cannot form a complete continuation is released
        instead (the result then says ``released``)."""
        ...

    def evict(self, checkpoint_ids: Sequence[int]) -> ResourceResult:
        """Remove inactive checkpoints of any tier (``evicted``) and free what only they held."""
        ...


@runtime_checkable
class BackfillProver(Protocol):
    """Optional Program capability: prove a backfill past a blocked FIFO head is safe.

    Without it the Engine never backfills. A proof must show that while ``borrower`` holds its complete
    active reservation, the end of ``donors`` alone still lets ``head`` enter from the root source with all
    inactive cache released; no timing assumption ("borrower finishes first") is allowed. The proof is
    bound to the current ``resource_revision``; return ``None`` to refuse.
    """

    def prove_backfill(
        self, head: RequestPlan, donors: Sequence[SequenceHandle], borrower: RequestPlan
    ) -> ResourcePlan | None: ...


TopLogprobs = tuple[tuple[int, float], ...]
"""The most likely tokens at one position, ``((token_id, logprob), ...)``, best first."""


@dataclass(frozen=True, slots=True)
class WindowScores:
    """What ``ScoringProgram.score_window`` returns for one window of ``n`` tokens.

    - ``logprobs``: ``n - 1`` entries; entry ``i`` is log p(token_ids[i+1] | token_ids[:i+1]).
    - ``top``: ``n - 1`` entries when ``top_n > 0``, else empty; entry ``i`` holds exactly ``top_n``
      pairs from the same position as ``logprobs[i]``.
    - ``next_top``: when ``predict_next``, the ``max(top_n, 1)`` most likely tokens at position ``n``
      (after the last token; entry 0 is the greedy next token), else empty.

    Every value comes from the same fp32 logits and the same arithmetic (logit minus log-sum-exp), so a
    token that is the most likely one has ``logprobs[i] == top[i][0][1]`` exactly: OpenAI-style clients
    (lm-eval-harness' ``is_greedy``) compare these floats with ``==``.
    """

    logprobs: tuple[float, ...]
    top: tuple[TopLogprobs, ...] = ()
    next_top: TopLogprobs = ()


@runtime_checkable
class ScoringProgram(Protocol):
    """The Program side of the causal_scoring purpose (CausalScoreCore calls it serially).

    Each call runs one window on temporary, empty State and Main KV: no request, continuation,
    checkpoint or cache entry survives it, and nothing the generation path uses is touched.
    """

    @property
    def max_context(self) -> int:
        """Longest window the Program can score."""
        ...

    def score_window(
        self, token_ids: Sequence[int], top_n: int = 0, *, predict_next: bool = False
    ) -> WindowScores:
        """Score one window of ``1..max_context`` tokens on fresh, empty state (see ``WindowScores``).

        Entry ``i`` of ``logprobs`` is log p(token_ids[i+1] | token_ids[:i+1]); with ``top_n`` (0..20)
        each entry also carries the ``top_n`` most likely tokens at that position; with ``predict_next``
        the result carries the ``max(top_n, 1)`` most likely tokens after the last token. Never
        materialises all ``[len(token_ids), vocab]`` logits at once.
        """
        ...
