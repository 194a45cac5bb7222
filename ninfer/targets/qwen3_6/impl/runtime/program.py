"""`Program[Variant]`: the Qwen3.6 family's physical execution entry (generation purpose).

One instance per Engine, built before the Engine accepts requests: the model view, one `StateStore`
(StateImage slots for GDN recurrent + conv state, paged KV for the attention layers), the resource book,
the step executor (and its CUDA graphs), the sampler and the decode backend. Requests never allocate
tensors of that size.

Who does what inside the Program:
- `ResourceBook` (resources.py): pools, reservations, sealed plans, the one open transaction,
  ``resource_revision``; the only physical authority.
- `StepExecutor` (executor.py): runs one step (B rows x T tokens, or ragged prefill rows) over the store,
  replaying a CUDA graph per exact (B, T) where one is captured.
- `Sampler` (draws.py): penalty tables, the rows' sampling settings, draws and their copies back.
- a `DecodeBackend` (backends/): what one decode unit runs: plain decode (with the decode lookahead), a
  known continuation verified K tokens at a time, later MTP and DFlash.
- this class: the contract (ninfer/runtime/contract/types.py, rule by rule): handles, prefill, forced
  control, the one open PendingBatch and its accepted-prefix commit or abort.

Mechanisms (ARCHITECTURE.md section 4):
- Recurrent state by slot selection: each sequence owns a few state slots, its current one and spares; a
  unit reads the current slot and writes spares (one per position it may keep); `commit` makes the slot
  of the accepted position current, `abort_pending` keeps the old one. No state copy, rollback is free.
- KV by frontier: the pages for the complete growth reservation are mapped at materialization; a unit
  writes K/V beyond the committed frontier; `commit` advances the frontier by the accepted prefix,
  abort leaves it.
- Counter-based sampling: each draw is a function of (seed, position), so the RNG "advances" only by
  the frontier moving on commit, and forced tokens never touch it.
- `release` waits until the device has run every unit queued so far (a decode lookahead, a forced
  chunk), so a sequence's slots and pages change owner only after the units that wrote them are stable
  (the specification's order, not only the stream's).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from ninfer.runtime.contract.constraint import RowConstraint
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
    validate_decisions,
)
from ninfer.targets.qwen3_6.impl.runtime.backends import DecodeBackend, RowCommit
from ninfer.targets.qwen3_6.impl.runtime.backends.plain import PlainDecode
from ninfer.targets.qwen3_6.impl.runtime.draws import Sampler, forced_logprobs
from ninfer.targets.qwen3_6.impl.runtime.executor import StepExecutor
from ninfer.targets.qwen3_6.impl.runtime.host_tier import HostTier
from ninfer.targets.qwen3_6.impl.runtime.images import PromptImages, prompt_images
from ninfer.targets.qwen3_6.impl.runtime.prefill_graphs import capacities
from ninfer.targets.qwen3_6.impl.runtime.resources import Copies, ResourceBook
from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.impl.runtime.step import StepBuilder, pinned_ids
from ninfer.targets.qwen3_6.impl.runtime.vision_graphs import VisionTower
from ninfer.targets.qwen3_6.kernels import fla_available, select_kernels
from ninfer.targets.qwen3_6.memory import MemoryPlan
from ninfer.targets.qwen3_6.model import StateStore
from ninfer.targets.qwen3_6.variant import Variant
from ninfer.targets.qwen3_6.view import ModelView
from ninfer.targets.qwen3_6.vision import vision_tokens

_program_ids = itertools.count(1)


@dataclass(frozen=True)
class ProgramConfig:
    max_concurrency: int
    max_context: int
    page_size: int
    kv_pages: int  # pages in the shared pool (every attention layer has the same page ids)
    device: torch.device
    dtype: torch.dtype
    cuda_graphs: bool = False  # capture the decode backend's uniform steps per exact (B, T) (CUDA only)
    # with cuda_graphs and the fast table: one-row prefill chunks of up to this many tokens replay
    # graphs of capacities 64, 128, ... (prefill_graphs.py); 0: every chunk eager
    prefill_graph_tokens: int = 0
    kernels: str = "auto"  # op implementations (kernels.select_kernels)
    decode_lookahead: bool = False  # the plain backend queues the next decode behind each (plain.py)
    max_image_tokens: int = 16384  # image pad tokens one request may carry (the vision workspace's size)
    # with cuda_graphs: image grids (t, h, w patches) whose vision tower is captured at start
    vision_graph_grids: tuple[tuple[int, int, int], ...] = ()
    checkpoint_slots: int = (
        0  # state slots for published checkpoints (the context cache), on top of the lanes'
    )
    host_checkpoint_slots: int = 0  # state slots of the host tier (0: no host tier)
    host_kv_pages: int = 0  # KV pages of the host tier (0: no host tier)
    memory: MemoryPlan | None = None  # how build_program sized the pools (None: given directly, tests)


def prefill_capacities(config: ProgramConfig) -> list[int]:
    """The prefill graphs' capacities: 64, 128, ... up to ``prefill_graph_tokens`` and the context."""
    return capacities(config.prefill_graph_tokens, config.max_context)


class Qwen36Program:
    """The Program for one exact package; generic over its `Variant` (no package branches inside)."""

    def __init__(
        self,
        variant: Variant,
        view: ModelView,
        config: ProgramConfig,
        backend: DecodeBackend | None = None,
    ) -> None:
        """``backend``: the decode backend (default: plain decode, with the lookahead when
        ``config.decode_lookahead``)."""
        self.variant = variant
        self.view = view
        self.config = config
        self.owner = next(_program_ids)
        self.kernels = select_kernels(config.device, config.kernels)  # once, for the Program's life
        self.backend: DecodeBackend = backend or PlainDecode(lookahead=config.decode_lookahead)
        n = config.max_concurrency
        self.book = ResourceBook(
            owner=self.owner,
            max_sequences=n,
            slots_per_sequence=self.backend.slots_per_sequence,
            kv_pages=config.kv_pages,
            page_size=config.page_size,
            max_context=config.max_context,
            extra_tokens=self.backend.extra_tokens,
            checkpoint_slots=config.checkpoint_slots,
            slot_bytes=StateStore.slot_bytes(variant, config.dtype),
            page_bytes=StateStore.page_bytes(
                variant, config.page_size, config.dtype, self.backend.kv_layers, self.backend.kv_head_shape
            ),
            host_slots=config.host_checkpoint_slots,
            host_pages=config.host_kv_pages,
        )
        self.store = StateStore.allocate(
            variant, self.book.slots.size, config.kv_pages, config.page_size, config.dtype, config.device
        )
        # the decode backend's own KV (a drafter's attention layers), in pages of the text model's ids
        layers, pages = self.backend.kv_layers, config.kv_pages
        self.backend_kv = (
            StateStore.allocate_kv(
                variant, layers, pages, config.page_size, config.dtype, config.device,
                self.backend.kv_head_shape,
            )
            if layers
            else None
        )
        # offloaded checkpoints' bytes (pinned on CUDA), only when the book has a host tier
        book = self.book
        self.host_tier = (
            HostTier(self.store, self.backend_kv, book.host_slots.size, book.host_pages.size, config.device)
            if book.host_slots.size
            else None
        )
        self._transfers_done: torch.cuda.Event | None = None  # the open transaction's tier copies
        # block tables are resources built once: one row per sequence index, written at materialization
        self._block_tables = torch.zeros(
            n, self.book.max_pages_per_sequence, dtype=torch.int32, device=config.device
        )
        steps = StepBuilder(config.page_size, self._block_tables, fused_unpack=self.kernels.name == "fast")
        self.sampler = Sampler(n, variant.vocab_size, config.device)
        graphs = config.cuda_graphs and config.device.type == "cuda"
        self.executor = StepExecutor(
            variant,
            view,
            self.store,
            self.kernels,
            steps,
            graph_shapes=self.backend.graph_shapes(n) if graphs else (),
            prefill_capacities=prefill_capacities(config) if graphs and self._fla_prefill() else (),
            scratch_slot=0,
            taps=self.backend.taps,
        )
        self.backend.bind(self.executor, self.sampler, self.backend_kv)
        # the vision tower, with the configured image grids captured as graphs now (before any request)
        self.vision_tower = None
        if view.vision is not None and variant.vision is not None:
            for grid in config.vision_graph_grids:
                tokens = vision_tokens([grid], variant.vision)
                if tokens > config.max_image_tokens:
                    raise ValueError(
                        f"vision graph grid {grid} is {tokens} image tokens, over max_image_tokens "
                        f"{config.max_image_tokens}"
                    )
            self.vision_tower = VisionTower(
                view.vision, variant.vision, self.kernels,
                graph_grids=config.vision_graph_grids if graphs else (),
            )  # fmt: skip
        self._sequences: dict[int, SequenceState] = {}
        self._batch_ids = itertools.count(1)
        self._open_pending: PendingBatch | None = None

    def _fla_prefill(self) -> bool:
        """The op table's GDN prefill is fla's, which a prefill graph's padded chunk needs."""
        return self.kernels.name == "fast" and fla_available()

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
        return self.book.revision

    @property
    def kv_pages_free(self) -> int:
        """KV pages neither a request nor a checkpoint holds (one counter: readable from any thread)."""
        return self.book.pages.free_count

    def capacity(self) -> ResourceCapacity:
        plan = self.config.memory
        if plan is None:
            return self.book.capacity()
        return replace(
            self.book.capacity(), gpu_memory_fraction=plan.gpu_memory_fraction, memory_plan=plan.describe()
        )

    def usage(self) -> ResourceUsage:
        return self.book.usage((s.frontier for s in self._sequences.values()), self._open_pending is not None)

    # ---- materialization ------------------------------------------------------------------------
    @property
    def prefix_salt(self) -> str:
        """What a checkpoint holds besides the tokens: the family's state and the backend's."""
        return f"qwen3_6/{self.backend.name}/{self.backend.extra_tokens}"

    def plan_materialization(
        self,
        request: RequestPlan,
        candidates: Sequence[CheckpointEntry] = (),
        evictable: Sequence[CheckpointEntry] = (),
    ) -> ResourcePlan | Blocked | Infeasible:
        if len(request.prompt_token_ids) < 1:
            return Infeasible("the prompt is empty; give at least one token")
        images = prompt_images(request.prepared_prompt)
        if images:
            if self.view.vision is None:
                return Infeasible(f"the prompt has {len(images)} image(s) but this model has no vision tower")
            tokens = sum(image.num_tokens for image in images)
            limit = self.config.max_image_tokens
            if tokens > limit:
                return Infeasible(
                    f"the prompt's images take {tokens} image tokens, more than the {limit} one request may "
                    "carry (max_image_tokens); send fewer or smaller images"
                )
        if candidates:  # only a checkpoint of exactly this prompt's prefix (tokens, media, salt) is one
            frontiers = [c.frontier_tokens for c in candidates]
            digests = prefix_digests(request.prompt_token_ids, frontiers, request.media, self.prefix_salt)
            candidates = [c for c in candidates if digests.get(c.frontier_tokens) == c.prefix_digest]
        return self.book.plan(request, candidates, evictable)

    def start(self, plan: ResourcePlan) -> RunningTransaction:
        txn, copies = self.book.start(plan)
        self._copy(copies)  # queued on the stream ahead of the sequence's first unit
        if copies.transfers and self.config.device.type == "cuda":
            self._transfers_done = torch.cuda.Event()
            self._transfers_done.record()
        return txn

    def poll(self, txn: RunningTransaction) -> bool:
        """Device copies are ordered ahead of the sequence's units, so only the host tier's transfers
        (an offload or a restore of the plan) are waited for."""
        self.book.claim(txn)
        done = self._transfers_done
        if done is None or done.query():
            self._transfers_done = None
            return True
        return False

    def finish(self, txn: RunningTransaction) -> ResourceResult:
        claim = self.book.claim(txn)
        request = self.book.request(txn)
        seq = SequenceState(
            handle=claim.handle,
            prompt=request.prompt_token_ids,
            max_total=request.max_total_tokens,
            sampling=request.sampling,
            logprobs=request.logprobs,
            slots=claim.slots,
            pages=claim.pages,
            current=claim.slots[0],
            frontier=txn.plan.reused_prefix_tokens,  # a source's positions are committed already
            media=request.media,
        )
        images = prompt_images(request.prepared_prompt)
        if images:  # the Frontend's M-RoPE positions and the decode offset after the images
            seq.images = PromptImages(images)
            seq.prompt_positions = request.prepared_prompt.mrope_positions  # type: ignore[union-attr]
            seq.rope_delta = int(request.prepared_prompt.mrope_delta)  # type: ignore[union-attr]
        index = claim.handle.index
        self._block_tables[index].zero_()
        self._block_tables[index, : len(claim.pages)] = torch.tensor(claim.pages, dtype=torch.int32)
        self.sampler.start(seq)
        result = self.book.finish(txn)
        self._sequences[index] = seq
        self._transfers_done = None
        return result

    def abort(self, txn: RunningTransaction) -> ResourceResult:
        self._transfers_done = None  # the copies stay queued ahead of any later unit
        return self.book.abort(txn)

    def release(self, handle: SequenceHandle) -> ResourceResult:
        self._handover(handle)
        del self._sequences[handle.index]
        return self.book.release(handle)

    # ---- checkpoints (the context cache) --------------------------------------------------------
    def capture(self, handle: SequenceHandle, evictable: Sequence[CheckpointEntry] = ()) -> ResourceResult:
        seq = self._sequence(handle)
        self._no_open_pending("capture")
        digest = self._digest(seq) if seq.state_valid else None
        if digest is None:  # a frontier inside an image's pads, or no usable state: nothing to publish
            self.book.revision += 1
            return ResourceResult(kind="captured", resource_revision=self.book.revision)
        result, copies = self.book.capture(handle, seq.frontier, seq.current, digest, evictable)
        self._copy(copies)
        return result

    def retain(self, handle: SequenceHandle, evictable: Sequence[CheckpointEntry] = ()) -> ResourceResult:
        seq = self._sequence(handle)
        digest = self._digest(seq) if seq.state_valid and seq.frontier > 0 else None
        if digest is None:  # no complete continuation to keep: the deterministic outcome is release
            return self.release(handle)
        self._handover(handle)
        del self._sequences[handle.index]
        return self.book.retain(handle, seq.frontier, seq.current, digest)

    def evict(self, checkpoint_ids: Sequence[int]) -> ResourceResult:
        return self.book.evict(checkpoint_ids)

    def prove_backfill(
        self, head: RequestPlan, donors: Sequence[SequenceHandle], borrower: RequestPlan
    ) -> ResourcePlan | None:
        """A root plan for ``borrower`` when, while it holds its whole reservation, the end of ``donors``
        alone (every checkpoint released) leaves room for ``head`` (`ResourceBook.proves_backfill`)."""
        for donor in donors:
            self._sequence(donor)
        if not self.book.proves_backfill(head, donors, borrower):
            return None
        plan = self.plan_materialization(borrower)
        return plan if isinstance(plan, ResourcePlan) else None

    def _digest(self, seq: SequenceState) -> str | None:
        tokens = (*seq.prompt, *seq.generated)[: seq.frontier]
        return prefix_digests(tokens, [seq.frontier], seq.media, self.prefix_salt).get(seq.frontier)

    def _copy(self, copies: Copies) -> None:
        """A transition's copies: the moves between the tiers first (`Copies`), then the device copies: a
        state slot (recurrent and conv), a KV page (every layer)."""
        store = self.store
        with torch.inference_mode():
            if copies.transfers:
                if self.host_tier is None:
                    raise ProgramInvariantError("a tier transfer without a host tier")
                self.host_tier.run(copies.transfers)
            if copies.state is not None:
                src, dst = copies.state
                store.conv[:, dst].copy_(store.conv[:, src])
                store.rec[:, dst].copy_(store.rec[:, src])
            if copies.page is not None:
                src, dst = copies.page
                for kv in (store, self.backend_kv) if self.backend_kv is not None else (store,):
                    kv.k_pages[:, dst].copy_(kv.k_pages[:, src])
                    kv.v_pages[:, dst].copy_(kv.v_pages[:, src])

    def _handover(self, handle: SequenceHandle) -> None:
        """Before a sequence's slots and pages change owner: no unit of it may still be queued."""
        self._sequence(handle)
        self._no_open_pending("release")
        self.backend.drop(handle)  # no later decode can ask for a released sequence
        if self.config.device.type == "cuda":
            # every unit queued so far (a dropped lookahead, a forced chunk) ends before the handover
            torch.cuda.current_stream(self.config.device).synchronize()

    # ---- execution ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self, handle: SequenceHandle, budget_tokens: int, *, constraint: RowConstraint | None = None
    ) -> PrefillProgress | PendingBatch:
        seq = self._sequence(handle)
        self._no_open_pending("prefill")
        self.backend.drop()
        if budget_tokens < 1:
            raise ProgramInvariantError(f"prefill budget must be >= 1, got {budget_tokens}")
        remaining = seq.prompt_remaining
        if remaining < 1:
            raise ProgramInvariantError("prefill of a sequence whose prompt is already consumed")
        start = seq.frontier
        end = start + min(remaining, budget_tokens)
        chunk = seq.prompt[start:end]
        splice = None
        if seq.images is not None:
            splice = seq.images.splice(start, end, self.vision_tower, self.config.device)
        if remaining > budget_tokens:
            # prompt chunks commit directly (the prompt is known): the state goes back into the current slot
            run = self.executor.ragged([seq], [chunk], state_out=[seq.current], logits="none", splice=splice)
            if self.backend.observes_steps:
                following = pinned_ids(seq.prompt[start + 1 : end + 1], self.config.device)
                self.backend.observe([seq], run, following, drafts=False)
            seq.frontier += len(chunk)
            return PrefillProgress(consumed=len(chunk), remaining=remaining - len(chunk))
        out = seq.spare
        if len(chunk) == 1 and splice is None:  # a decode-shaped step (a graph replay where captured)
            run = self.executor.uniform([seq], chunk, 1, state_in=[seq.current], state_out=[out])
        else:
            run = self.executor.ragged([seq], [chunk], state_out=[out], logits="last", splice=splice)
        masks = None if constraint is None else [constraint.masks(())[0]]
        queued = self.sampler.draw([seq], run, masks)
        if self.backend.observes_steps:
            # the token after each prompt position: the next prompt token, after the last the drawn one
            prompt_after = pinned_ids(seq.prompt[start + 1 : end], self.config.device)
            following = torch.cat((prompt_after, queued.drawn.view(1)))
            self.backend.observe([seq], run, following, drafts=True)
        rows = queued.rows([seq], [RowCommit((out,), consumed=len(chunk))])
        return self._open("prefill", rows)

    @torch.inference_mode()
    def decode(
        self,
        handles: Sequence[SequenceHandle],
        budgets: Sequence[int],
        *,
        while_running: Callable[[], None] | None = None,
        repeat_expected: bool = False,
        constraints: Sequence[RowConstraint | None] | None = None,
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
        if constraints is None:
            rows = self.backend.decode(
                seqs, budgets, while_running=while_running, repeat_expected=repeat_expected
            )
        else:  # structured outputs (contract rule 15)
            if len(constraints) != len(handles):
                raise ProgramInvariantError(f"{len(constraints)} constraints for {len(handles)} rows")
            rows = self.backend.decode(
                seqs, budgets, while_running=while_running, repeat_expected=False, constraints=constraints
            )
        for row, budget in zip(rows, budgets):
            if not 1 <= row.produced <= budget:
                raise ProgramInvariantError(f"the {self.backend.name} backend produced {row.produced} tokens")
        return self._open("decode", rows)

    @torch.inference_mode()
    def force(self, handle: SequenceHandle, tokens: Sequence[int]) -> PendingBatch:
        seq = self._sequence(handle)
        self._no_open_pending("force")
        self.backend.drop()
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
        out = seq.spare
        run = self.executor.ragged([seq], [inputs], state_out=[out], logits="all" if want else "none")
        if self.backend.observes_steps:
            self.backend.observe([seq], run, pinned_ids(tokens, self.config.device), drafts=True)
        logits = run.logits
        # log-probs the model gave the forced tokens (reported like sampled ones; no sampler, no RNG)
        logprobs = forced_logprobs(logits, tokens, seq.logprobs.top_n) if want else None
        row = PendingRow(handle, tokens, seq.frontier, logprobs, RowCommit((out,), consumed=len(inputs)))
        return self._open("force", [row])

    def commit(self, pending: PendingBatch, decisions: Sequence[RowDecision]) -> None:
        self._check_pending(pending)
        validate_decisions(pending, decisions)  # an illegal disposition leaves the batch open (abortable)
        pending._consume()
        self._open_pending = None
        seqs = []
        for row, decision in zip(pending.rows, decisions):
            seq = self._sequence(row.handle)
            seqs.append(seq)
            commit: RowCommit = row.accept_meta
            accepted = decision.accepted_tokens
            if commit.consumed is None:  # decode / verify: one input per accepted token
                if accepted:
                    seq.frontier += accepted
                    seq.current = commit.out_slots[accepted - 1]
            elif pending.kind == "prefill" or (accepted == row.produced and not decision.cancelled):
                # the final prompt chunk commits even for a cancelled row (it is the prompt)
                seq.frontier += commit.consumed
                seq.current = commit.out_slots[0]
            elif accepted:
                # a partial accept of forced tokens: the output keeps the prefix, the state is not needed
                seq.state_valid = False
            if accepted:
                seq.pending_input = row.tokens[accepted - 1]
                seq.generated.extend(row.tokens[:accepted])
                self.sampler.count(seq, row.tokens[:accepted])
        if pending.kind == "decode":
            self.backend.committed(seqs, pending.rows, decisions)

    def abort_pending(self, pending: PendingBatch) -> None:
        self._check_pending(pending)
        pending._consume()
        self._open_pending = None
        # nothing to undo: the spare slots and KV beyond the frontier are simply overwritten later

    # ---- internals ------------------------------------------------------------------------------
    def _open(self, kind: PendingKind, rows: Sequence[PendingRow]) -> PendingBatch:
        pending = PendingBatch(self.owner, next(self._batch_ids), kind, rows)
        self._open_pending = pending
        return pending

    def _sequence(self, handle: SequenceHandle) -> SequenceState:
        seq = self._sequences.get(handle.index) if handle.owner == self.owner else None
        if seq is None or seq.handle.generation != handle.generation:
            raise ProgramInvariantError(f"stale or foreign sequence handle {handle}")
        return seq

    def _check_pending(self, pending: PendingBatch) -> None:
        if pending.owner != self.owner or pending is not self._open_pending:
            raise ProgramInvariantError(f"{pending!r} is not this Program's open batch")

    def _no_open_pending(self, what: str) -> None:
        if self._open_pending is not None:
            raise ProgramInvariantError(f"{what} while {self._open_pending!r} is unconsumed")
