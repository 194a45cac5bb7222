"""`Program[Variant]`: the Qwen3.6 family's physical execution entry (generation purpose).

One instance per Engine, built before the Engine accepts requests: model view, one `StateStore`
(StateImage slots for GDN recurrent + conv state, paged KV for the attention layers), the page and
slot pools, penalty tables and the sampling batch. Requests never allocate tensors of that size.

Mechanisms (ARCHITECTURE.md §4):
- Recurrent state by slot flip: each sequence owns a ring of slots, the committed one and the spare;
  a unit reads the committed slot and writes the spare; `commit` moves the ring on, `abort_pending`
  keeps the old one.
- KV by frontier: the pages for the complete growth reservation are mapped at materialization; a unit
  writes K/V beyond the committed frontier; `commit` advances the frontier, abort leaves it.
- Counter-based sampling: each draw is a function of (seed, position), so the RNG "advances" only by
  the frontier moving on commit, and forced tokens never touch it.
- Decode lookahead (``ProgramConfig.decode_lookahead``): when the Engine expects the same round next
  (``repeat_expected``), `decode` queues, right behind the unit it was asked for, the decode after it,
  fed on the device by the first one's sampled tokens, so the GPU runs it while the Engine previews,
  commits and publishes the first (SGLang's overlap scheduling, vLLM's async scheduling). It is
  provisional state like any unit's: it writes the ring's third slot and K/V beyond the frontier, so a
  commit or an abort of the unit before it still finds everything it may keep intact. The next `decode`
  takes it only when it is exactly that unit (the same rows in the same order, each one position on, fed
  the tokens the Engine committed; rows at their last token are not run ahead at all, so a round that
  loses them by length still matches); anything else drops it unread: every later unit and every later
  write of the Program is queued behind it on the one stream. `release` waits until the device has run
  every unit queued so far, so a sequence's slots and pages change owner only after the units that wrote
  them are stable (the specification's order, not only the stream's).

The contract this implements, rule by rule, is ``ninfer/runtime/contract/types.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from ninfer.core.pools import IndexPool
from ninfer.ops.sampling import SampleResult, SamplingBatch, sample
from ninfer.ops.sampling import SamplingParams as OpsSamplingParams
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
    SamplingParams,
    SequenceHandle,
    StalePlan,
    TokenLogprob,
    validate_decisions,
)
from ninfer.targets.qwen3_6.impl.runtime.graphs import DecodeGraphs
from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.impl.runtime.step import PackedStep, StepBuilder
from ninfer.targets.qwen3_6.kernels import select_kernels
from ninfer.targets.qwen3_6.model import StateStore, forward
from ninfer.targets.qwen3_6.variant import Variant
from ninfer.targets.qwen3_6.view import ModelView

_program_ids = itertools.count(1)


@dataclass(frozen=True)
class ProgramConfig:
    max_concurrency: int
    max_context: int
    page_size: int
    kv_pages: int  # pages in the shared pool (every attention layer has the same page ids)
    device: torch.device
    dtype: torch.dtype
    cuda_graphs: bool = False  # capture the decode unit per exact B (CUDA only)
    kernels: str = "auto"  # op implementations (kernels.select_kernels)
    decode_lookahead: bool = False  # queue the next decode behind each decode (module docstring)

    @property
    def slots_per_sequence(self) -> int:
        """The ring of StateImage slots a sequence holds: committed + spare, + the lookahead's."""
        return 3 if self.decode_lookahead else 2


@dataclass(frozen=True)
class _Reservation:
    """What a sealed materialization plan will take."""

    pages: int
    slots: int


@dataclass(eq=False)
class _Provisional:
    """Program-private part of a PendingBatch: which unit ran, per row."""

    kind: str
    # per row: positions the unit consumed from the committed frontier (prompt chunk or forced inputs)
    consumed: tuple[int, ...]


class _StepRun(NamedTuple):
    """What one step leaves on the device for the sampler."""

    logits: torch.Tensor | None
    step: PackedStep  # the step's packed facts (positions, sequence indices)
    greedy: torch.Tensor | None = None  # each row's argmax token, where a decode graph computed it


@dataclass(eq=False)
class _Queued:
    """A unit's sampled tokens (and log-probs) on their way to the host: the copies are queued on the
    device behind the draw, which is queued behind the step."""

    drawn: torch.Tensor  # [B] the tokens on the device (a lookahead unit's inputs)
    tokens: torch.Tensor  # [B] their host copy
    logprob: torch.Tensor | None  # [B] host copies of the log-probs, where a row wants them
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    done: torch.cuda.Event | None  # recorded after the copies (CUDA); None: they are done

    @classmethod
    def copy_back(cls, drawn: torch.Tensor, result: SampleResult | None, logprob: bool, top: bool) -> _Queued:
        def host(t: torch.Tensor) -> torch.Tensor:
            return t.to("cpu", non_blocking=True)  # into pinned memory from CUDA: queued, not waited on

        done = None
        tokens = host(drawn)
        chosen = host(result.logprob) if result is not None and logprob else None
        top_ids = host(result.top_ids) if result is not None and top else None
        top_lp = host(result.top_logprobs) if result is not None and top else None
        if drawn.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return cls(drawn, tokens, chosen, top_ids, top_lp, done)

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()

    def read(self) -> tuple[list[int], list[float], list[list[int]], list[list[float]]]:
        """Wait for the copies; the rows' tokens, log-probs, top ids and top log-probs (empty lists where
        the unit computed none)."""
        self.wait()

        def host(t: torch.Tensor | None) -> list:
            return t.tolist() if t is not None else []

        return host(self.tokens), host(self.logprob), host(self.top_ids), host(self.top_logprobs)


@dataclass(eq=False)
class _Ahead:
    """The lookahead decode: queued for ``handles`` at ``frontiers``, fed by the tokens ``inputs``."""

    handles: tuple[SequenceHandle, ...]
    frontiers: tuple[int, ...]  # each row's committed frontier the unit assumes
    queued: _Queued
    inputs: tuple[int, ...]  # the unit before's tokens (read back): its inputs


def _gather(tokens: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``tokens[rows]`` on the device, queued behind what computes ``tokens`` (the index goes through
    pinned memory: a copy from pageable memory would wait for the device queue to drain)."""
    index = torch.tensor(rows, dtype=torch.long)
    if tokens.is_cuda:
        index = index.pin_memory().to(tokens.device, non_blocking=True)
    return tokens.index_select(0, index)


def _sampler_params(sampling: SamplingParams) -> OpsSamplingParams:
    """The sampler's params: the contract's value has exactly its fields."""
    return OpsSamplingParams(**{f.name: getattr(sampling, f.name) for f in fields(sampling)})


def _forced_logprobs(logits: torch.Tensor, tokens: tuple[int, ...], top_n: int) -> tuple[TokenLogprob, ...]:
    """Raw log-probs of forced tokens: ``logits[i]`` is the model's prediction for ``tokens[i]``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(tokens, device=logits.device)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    top: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if top_n:
        values, top_ids = logprobs.topk(top_n, dim=-1)
        top = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
    return tuple(TokenLogprob(token_id=t, logprob=c, top=a) for t, c, a in zip(tokens, chosen, top))


class Qwen36Program:
    """The Program for one exact package; generic over its `Variant` (no package branches inside)."""

    def __init__(self, variant: Variant, view: ModelView, config: ProgramConfig) -> None:
        self.variant = variant
        self.view = view
        self.config = config
        self.owner = next(_program_ids)
        self.kernels = select_kernels(config.device, config.kernels)  # once, for the Program's life
        n = config.max_concurrency
        self._max_pages_per_seq = -(-config.max_context // config.page_size)
        slots = config.slots_per_sequence * n
        self._slots = IndexPool(slots, "state slot")
        self._pages = IndexPool(config.kv_pages, "KV page")
        self.store = StateStore.allocate(
            variant, slots, config.kv_pages, config.page_size, config.dtype, config.device
        )
        # penalty tables, one row per sequence index (allocated once; zeroed at materialization)
        vocab = variant.vocab_size
        self._prompt_mask = torch.zeros(n, vocab, dtype=torch.bool, device=config.device)
        self._output_counts = torch.zeros(n, vocab, dtype=torch.int32, device=config.device)
        # block tables are resources built once: one row per sequence index, written at materialization
        self._block_tables = torch.zeros(n, self._max_pages_per_seq, dtype=torch.int32, device=config.device)
        self._steps = StepBuilder(
            config.page_size, self._block_tables, fused_unpack=self.kernels.name == "fast"
        )
        self._sequences: dict[int, SequenceState] = {}
        self._generations = [0] * n
        self._revision = 0
        self._txn_ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._open_txn: RunningTransaction | None = None
        self._open_pending: PendingBatch | None = None
        self._graphs: DecodeGraphs | None = None
        self._sampling: SamplingBatch | None = None  # the last unit's rows' settings (see _sampling_batch)
        self._sampling_rows: tuple[SequenceHandle, ...] = ()
        self._ahead: _Ahead | None = None
        self.lookahead = {"taken": 0, "dropped": 0}  # lookahead units (observability; tests read it)
        if config.cuda_graphs and config.device.type == "cuda":
            self._graphs = DecodeGraphs(
                self._decode_logits, n, config.device, scratch_slot=0, argmax=self.kernels.argmax
            )

    # ---- static facts ---------------------------------------------------------------------------
    @property
    def max_concurrency(self) -> int:
        return self.config.max_concurrency

    @property
    def max_context(self) -> int:
        return self.config.max_context

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def resource_revision(self) -> int:
        return self._revision

    def capacity(self) -> ResourceCapacity:
        return ResourceCapacity(
            max_sequences=self.max_concurrency,
            state_slots=self._slots.size,
            kv_pages=self._pages.size,
            page_size=self.page_size,
            max_context=self.max_context,
        )

    def usage(self) -> ResourceUsage:
        mapped = sum(-(-s.frontier // self.page_size) for s in self._sequences.values())
        return ResourceUsage(
            sequences=len(self._sequences),
            state_slots=self._slots.used_count,
            kv_pages_mapped=mapped,
            kv_pages_reserved=self._pages.used_count,
            open_transactions=int(self._open_txn is not None),
            open_pending_batches=int(self._open_pending is not None),
        )

    # ---- materialization ------------------------------------------------------------------------
    def _reservation(self, request: RequestPlan) -> _Reservation:
        pages = -(-request.max_total_tokens // self.page_size)
        return _Reservation(pages=pages, slots=self.config.slots_per_sequence)

    def plan_materialization(
        self, request: RequestPlan, candidates: Sequence[CheckpointEntry] = ()
    ) -> ResourcePlan | Blocked | Infeasible:
        total = request.max_total_tokens
        if total > self.max_context:
            return Infeasible(
                f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens ({request.max_new_tokens}) = "
                f"{total} exceeds the context limit of {self.max_context} tokens; shorten the prompt or "
                "lower max_tokens"
            )
        need = self._reservation(request)
        if need.pages > self._pages.size:
            return Infeasible(
                f"needs {need.pages * self.page_size} KV positions, the KV pool holds "
                f"{self._pages.size * self.page_size}; lower max_tokens"
            )
        if len(request.prompt_token_ids) < 1:
            return Infeasible("the prompt is empty; give at least one token")
        try:
            _sampler_params(request.sampling).validate()  # refused here, before any resource is taken
        except ValueError as e:
            return Infeasible(f"invalid sampling: {e}")
        if self._free_index() is None or need.slots > self._slots.free_count:
            return Blocked("no free sequence slot")
        if need.pages > self._pages.free_count:
            return Blocked(f"{need.pages} KV pages needed, {self._pages.free_count} free")
        return ResourcePlan(
            owner=self.owner,
            resource_revision=self._revision,
            reserved=ResourceUsage(sequences=1, state_slots=need.slots, kv_pages_reserved=need.pages),
            sealed=(request, need),
        )

    def start(self, plan: ResourcePlan) -> RunningTransaction:
        if plan.owner != self.owner:
            raise ProgramInvariantError("plan from another Program")
        if plan.resource_revision != self._revision:
            raise StalePlan(f"plan sealed at revision {plan.resource_revision}, now {self._revision}")
        if self._open_txn is not None:
            raise ProgramInvariantError("a resource transaction is already open")
        request, need = plan.sealed
        index = self._free_index()
        if index is None or need.slots > self._slots.free_count or need.pages > self._pages.free_count:
            raise ProgramInvariantError("plan at the current revision is no longer feasible")
        slots = self._slots.allocate(need.slots)
        pages = self._pages.allocate(need.pages)
        self._revision += 1
        txn = RunningTransaction(
            owner=self.owner,
            transaction_id=next(self._txn_ids),
            plan=plan,
            sealed=(request, index, slots, pages),
        )
        self._open_txn = txn
        return txn

    def poll(self, txn: RunningTransaction) -> bool:
        self._check_txn(txn)
        return True  # root-source materialization has no copies to wait for

    def finish(self, txn: RunningTransaction) -> ResourceResult:
        self._check_txn(txn)
        request, index, slots, pages = txn.sealed
        sampling = request.sampling  # the contract's value has exactly the sampler's fields
        ops_params = _sampler_params(sampling)  # checked in plan_materialization
        self._generations[index] += 1
        handle = SequenceHandle(owner=self.owner, index=index, generation=self._generations[index])
        self._sequences[index] = SequenceState(
            handle=handle,
            prompt=request.prompt_token_ids,
            max_total=request.max_total_tokens,
            sampling=ops_params,
            seed=sampling.seed,
            logprobs=request.logprobs,
            slots=tuple(slots),
            pages=pages,
        )
        self._block_tables[index].zero_()
        self._block_tables[index, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        if ops_params.penalised:
            self._prompt_mask[index].zero_()
            self._prompt_mask[index, torch.tensor(request.prompt_token_ids, device=self.config.device)] = True
            self._output_counts[index].zero_()
        self._open_txn = None
        self._revision += 1
        return ResourceResult(kind="materialized", resource_revision=self._revision, handle=handle)

    def abort(self, txn: RunningTransaction) -> ResourceResult:
        self._check_txn(txn)
        _, _, slots, pages = txn.sealed
        self._slots.free(slots)
        self._pages.free(pages)
        self._open_txn = None
        self._revision += 1
        return ResourceResult(kind="aborted", resource_revision=self._revision)

    def release(self, handle: SequenceHandle) -> ResourceResult:
        seq = self._sequence(handle)
        self._no_open_pending("release")
        if self._ahead is not None and handle in self._ahead.handles:
            self._drop_ahead()  # no later decode can ask for a released sequence
        if self.config.device.type == "cuda":
            # every unit queued so far (a dropped lookahead, a forced chunk) ends before the handover
            torch.cuda.current_stream(self.config.device).synchronize()
        self._slots.free(list(seq.slots))
        self._pages.free(seq.pages)
        del self._sequences[handle.index]
        self._revision += 1
        return ResourceResult(kind="released", resource_revision=self._revision, handle=handle)

    # ---- execution ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, handle: SequenceHandle, budget_tokens: int) -> PrefillProgress | PendingBatch:
        seq = self._sequence(handle)
        self._no_open_pending("prefill")
        self._drop_ahead()
        if budget_tokens < 1:
            raise ProgramInvariantError(f"prefill budget must be >= 1, got {budget_tokens}")
        remaining = seq.prompt_remaining
        if remaining < 1:
            raise ProgramInvariantError("prefill of a sequence whose prompt is already consumed")
        start = seq.frontier
        if remaining > budget_tokens:
            chunk = seq.prompt[start : start + budget_tokens]
            self._run([seq], [chunk], write_spare=False, logits="none")
            seq.frontier += len(chunk)  # prompt chunks commit directly: the prompt is known
            return PrefillProgress(consumed=len(chunk), remaining=remaining - len(chunk))
        chunk = seq.prompt[start:]
        run = self._run([seq], [chunk], write_spare=True, logits="last")
        return self._pending("prefill", [seq], self._queue([seq], run), consumed=(len(chunk),))

    @torch.inference_mode()
    def decode(
        self,
        handles: Sequence[SequenceHandle],
        budgets: Sequence[int],
        *,
        while_running: Callable[[], None] | None = None,
        repeat_expected: bool = False,
    ) -> PendingBatch:
        self._no_open_pending("decode")
        if not handles or len(handles) > self.max_concurrency or len(budgets) != len(handles):
            raise ProgramInvariantError(f"decode of {len(handles)} rows with {len(budgets)} budgets")
        seqs = [self._sequence(h) for h in handles]
        if len({s.handle.index for s in seqs}) != len(seqs):
            raise ProgramInvariantError("a sequence appears twice in one decode unit")
        for s, b in zip(seqs, budgets):
            if s.pending_input is None or not s.state_valid or b < 1:
                raise ProgramInvariantError(f"sequence {s.handle} is not decode-ready")
            if s.frontier + 1 > s.max_total:
                raise ProgramInvariantError(f"sequence {s.handle} would grow past its reservation")
        queued = self._take_ahead(seqs)
        if queued is None:
            run = self._run(seqs, [(s.pending_input,) for s in seqs], write_spare=True, logits="last")
            queued = self._queue(seqs, run)
        ahead_rows = self._look_ahead_rows(seqs, budgets) if repeat_expected else []
        if ahead_rows:
            # the rows that go on after this unit, fed on the device by its draw
            ahead_seqs = [seqs[i] for i in ahead_rows]
            fed = queued.drawn if len(ahead_rows) == len(seqs) else _gather(queued.drawn, ahead_rows)
            placeholders = [(0,)] * len(ahead_seqs)  # the inputs are ``fed``
            run = self._run(ahead_seqs, placeholders, write_spare=True, logits="last", fed=fed)
            ahead = self._queue(ahead_seqs, run)
        consumed = (1,) * len(seqs)
        # if ``while_running`` raises, the lookahead is forgotten in flight: the Engine then fails, and any
        # later unit would be queued behind it anyway
        pending = self._pending("decode", seqs, queued, consumed=consumed, while_running=while_running)
        if ahead_rows:
            self._ahead = _Ahead(
                handles=tuple(seqs[i].handle for i in ahead_rows),
                frontiers=tuple(seqs[i].frontier + 1 for i in ahead_rows),
                queued=ahead,
                inputs=tuple(pending.rows[i].tokens[0] for i in ahead_rows),
            )
        return pending

    @torch.inference_mode()
    def force(self, handle: SequenceHandle, tokens: Sequence[int]) -> PendingBatch:
        seq = self._sequence(handle)
        self._no_open_pending("force")
        self._drop_ahead()
        tokens = tuple(int(t) for t in tokens)
        if not tokens or seq.pending_input is None or not seq.state_valid:
            raise ProgramInvariantError(f"forced control on {handle} with {len(tokens)} tokens")
        if seq.frontier + len(tokens) > seq.max_total:
            raise ProgramInvariantError(f"forced tokens would grow {handle} past its reservation")
        if any(not 0 <= t < self.variant.vocab_size for t in tokens):
            raise ProgramInvariantError("forced token id outside the vocabulary")
        # the model consumes the pending input and every forced token but the last, which becomes the
        # new pending input: exactly the state after sampling those tokens, with no sampler involved
        inputs = (seq.pending_input, *tokens[:-1])
        want = seq.logprobs.enabled
        logits = self._run([seq], [inputs], write_spare=True, logits="all" if want else "none").logits
        # log-probs the model gave the forced tokens (reported like sampled ones; no sampler, no RNG)
        logprobs = _forced_logprobs(logits, tokens, seq.logprobs.top_n) if want else None
        row = PendingRow(handle=handle, tokens=tokens, base_frontier=seq.frontier, logprobs=logprobs)
        return self._open(
            PendingBatch(
                self.owner, next(self._batch_ids), "force", [row], _Provisional("force", (len(inputs),))
            )
        )

    def commit(self, pending: PendingBatch, decisions: Sequence[RowDecision]) -> None:
        self._check_pending(pending)
        validate_decisions(pending, decisions)  # an illegal disposition leaves the batch open (abortable)
        pending._consume()
        self._open_pending = None
        provisional: _Provisional = pending.provisional
        for row, decision, consumed in zip(pending.rows, decisions, provisional.consumed):
            seq = self._sequence(row.handle)
            accepted = row.tokens[: decision.accepted_tokens]
            if pending.kind == "prefill":
                # the final prompt chunk is committed even for a cancelled row (it is the prompt)
                seq.frontier += consumed
                seq.flip_slots()
            elif decision.accepted_tokens == row.produced and not decision.cancelled:
                seq.frontier += consumed
                seq.flip_slots()
            elif accepted:
                # terminal partial accept: the output keeps the prefix, the model state is not needed
                seq.state_valid = False
            if accepted:
                seq.pending_input = accepted[-1]
                if seq.penalised:
                    ids = torch.tensor(accepted, device=self.config.device)
                    self._output_counts[row.handle.index].index_add_(
                        0, ids, torch.ones_like(ids, dtype=torch.int32)
                    )

    def abort_pending(self, pending: PendingBatch) -> None:
        self._check_pending(pending)
        pending._consume()
        self._open_pending = None
        # nothing to undo: the spare slots and KV beyond the frontier are simply overwritten later

    # ---- internals ------------------------------------------------------------------------------
    def _run(
        self,
        seqs: Sequence[SequenceState],
        inputs: Sequence[Sequence[int]],
        *,
        write_spare: bool,
        logits: str,
        fed: torch.Tensor | None = None,
    ) -> _StepRun:
        """Run one step (a decode of one token per row replays its CUDA graph when there is one).

        ``fed``: the lookahead decode, one position past each row's frontier, whose input tokens are
        this device tensor (the unit before's draw) in place of ``inputs``."""
        step_ahead = int(fed is not None)
        if self._graphs is not None and logits == "last" and all(len(row) == 1 for row in inputs):
            tokens = [row[0] for row in inputs]
            values = self._steps.decode_values(seqs, tokens, write_spare=write_spare, ahead=step_ahead)
            return _StepRun(*self._graphs.run(values, len(seqs), fed))
        packed = self._steps.pack(seqs, inputs, write_spare=write_spare, ahead=step_ahead)
        step = self._steps.to_device(packed)
        if fed is not None:
            step.fields().token_ids.copy_(fed)
        batch = self._steps.unpack(step)
        out = forward(self.view, self.variant, batch, self.store, logits=logits, kernels=self.kernels)
        return _StepRun(out.logits, step)

    def _decode_logits(self, step: PackedStep, feed: torch.Tensor) -> torch.Tensor:
        """The unit a decode graph captures: the packed inputs (one token per row) unpacked, rows with a
        negative token id fed from ``feed`` (`DecodeGraphs`), then the forward to last-token logits."""
        batch = self._steps.unpack(step, feed)
        logits = forward(
            self.view, self.variant, batch, self.store, logits="last", kernels=self.kernels
        ).logits
        assert logits is not None
        return logits

    def _queue(self, seqs: Sequence[SequenceState], run: _StepRun) -> _Queued:
        """Queue the unit's draw (the sampler, or the graph's argmax) and its copy to the host."""
        assert run.logits is not None
        batch = self._sampling_batch(seqs)
        penalised = any(s.penalised for s in seqs)
        want_logprobs = any(s.logprobs.enabled for s in seqs)
        top_n = max((s.logprobs.top_n for s in seqs if s.logprobs.enabled), default=0)
        if run.greedy is not None and batch.all_greedy and not penalised and not want_logprobs:
            result = None  # exactly the sampler's tokens then: the argmax of the raw logits
            drawn = run.greedy
        else:
            fields = run.step.fields()
            index = fields.sequence_index
            result = sample(
                run.logits,
                batch,
                # the counter of a draw is the absolute position of the sampled token: the row's context
                # length after the step (frontier + consumed), already on the device with the step's inputs
                fields.context_lens,
                prompt_mask=self._prompt_mask[index] if penalised else None,
                output_counts=self._output_counts[index] if penalised else None,
                num_logprobs=top_n,
                with_logprob=want_logprobs,
            )
            drawn = result.tokens
        return _Queued.copy_back(drawn, result, want_logprobs, top_n > 0)  # log-probs: only by the sampler

    def _pending(
        self,
        kind: str,
        seqs: Sequence[SequenceState],
        queued: _Queued,
        consumed: tuple[int, ...],
        while_running: Callable[[], None] | None = None,
    ) -> PendingBatch:
        if while_running is not None:
            # the unit (and the sampler, if it runs) is queued: the Engine's host work overlaps it. The
            # callback never runs the Program (the contract)
            while_running()
        tokens, chosen, top_ids, top_lp = queued.read()  # the one host sync of a unit: the Engine needs them
        rows = []
        for i, s in enumerate(seqs):
            lp = None
            if s.logprobs.enabled:
                n = s.logprobs.top_n
                top = tuple(zip(top_ids[i][:n], top_lp[i][:n])) if n else ()
                lp = (TokenLogprob(token_id=tokens[i], logprob=chosen[i], top=top),)
            rows.append(
                PendingRow(handle=s.handle, tokens=(tokens[i],), base_frontier=s.frontier, logprobs=lp)
            )
        return self._open(
            PendingBatch(self.owner, next(self._batch_ids), kind, rows, _Provisional(kind, consumed))
        )

    def _look_ahead_rows(self, seqs: Sequence[SequenceState], budgets: Sequence[int]) -> list[int]:
        """The rows of the decode after this one, worth queueing now: those whose budget holds another
        token (a row at its last one ends here), provided none of them has a sampler reading output
        counts, which only `commit` brings up to date (the next round would hold that row: no lookahead)."""
        if not self.config.decode_lookahead:
            return []
        rows = [i for i, b in enumerate(budgets) if b >= 2]
        if any(seqs[i].penalised or seqs[i].frontier + 2 > seqs[i].max_total for i in rows):
            return []
        return rows

    def _take_ahead(self, seqs: Sequence[SequenceState]) -> _Queued | None:
        """The lookahead unit, when it is exactly the decode asked for: the same rows in the same order,
        each committed one position on, fed the token the Engine committed. Otherwise it is dropped.

        Exactly: a row's logits depend, in their last bits, on which rows share its batch and in which
        order (the kernels' reduction order does), so a unit run for other rows is not the unit plain
        decoding runs, even where each row's state is right."""
        ahead = self._ahead
        if ahead is None:
            return None
        self._ahead = None
        if ahead.handles == tuple(s.handle for s in seqs) and all(
            s.frontier == f and s.pending_input == t for s, f, t in zip(seqs, ahead.frontiers, ahead.inputs)
        ):
            self.lookahead["taken"] += 1
            return ahead.queued
        self.lookahead["dropped"] += 1
        return None

    def _drop_ahead(self) -> None:
        """Forget the lookahead unit: what it writes is provisional, and whatever the Program queues
        next runs after it on the one stream."""
        if self._ahead is not None:
            self._ahead = None
            self.lookahead["dropped"] += 1

    def _sampling_batch(self, seqs: Sequence[SequenceState]) -> SamplingBatch:
        """The rows' sampling settings on the device, rebuilt only when the rows change: a request's
        params and seed are fixed for its life, and steady decode repeats the same rows every step."""
        key = tuple(s.handle for s in seqs)
        if self._sampling_rows != key:
            params, seeds = [s.sampling for s in seqs], [s.seed for s in seqs]
            self._sampling = SamplingBatch.build(params, seeds, self.config.device)
            self._sampling_rows = key
        assert self._sampling is not None
        return self._sampling

    def _open(self, pending: PendingBatch) -> PendingBatch:
        self._open_pending = pending
        return pending

    def _free_index(self) -> int | None:
        return next((i for i in range(self.max_concurrency) if i not in self._sequences), None)

    def _sequence(self, handle: SequenceHandle) -> SequenceState:
        seq = self._sequences.get(handle.index) if handle.owner == self.owner else None
        if seq is None or seq.handle.generation != handle.generation:
            raise ProgramInvariantError(f"stale or foreign sequence handle {handle}")
        return seq

    def _check_txn(self, txn: RunningTransaction) -> None:
        if txn is not self._open_txn:
            raise ProgramInvariantError(f"transaction {txn.transaction_id} is not the open one")

    def _check_pending(self, pending: PendingBatch) -> None:
        if pending.owner != self.owner or pending is not self._open_pending:
            raise ProgramInvariantError(f"{pending!r} is not this Program's open batch")

    def _no_open_pending(self, what: str) -> None:
        if self._open_pending is not None:
            raise ProgramInvariantError(f"{what} while {self._open_pending!r} is unconsumed")
