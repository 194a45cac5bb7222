"""Drawing a step's tokens and bringing them to the host: the Program's sampling glue.

`Sampler` owns the per-sequence penalty tables (prompt mask, output counts: one row per sequence index,
allocated once) and the device copy of the rows' sampling settings (rebuilt only when the rows change:
steady decode repeats the same rows every step). `Sampler.draw` queues the draw (the sampler, or a step
graph's argmax where that is exactly the sampler's draw) and the copies of its results to pinned host
memory behind the step, without waiting; `Queued.read` waits and returns them. A unit's one host sync is
that read.

Every draw is counter-based (`ninfer.ops.sampling`): the randomness of a token is a function of the
request's seed and the token's absolute position, so a row's draw does not depend on the batch it runs
in, and the "RNG" advances only when a position is committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ninfer.ops.sampling import SampleResult, SamplingBatch, sample
from ninfer.ops.speculative import verify_drafts
from ninfer.runtime.contract.types import PendingRow, SequenceHandle, TokenLogprob
from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.impl.runtime.step import PackedStep


class StepRun(NamedTuple):
    """What one step leaves on the device."""

    logits: torch.Tensor | None  # [rows, V] fp32: each row's last token, or every token of a uniform step
    step: PackedStep  # the step's packed facts, on the device (positions, sequence indices)
    greedy: torch.Tensor | None = None  # the argmax of ``logits``, where a step graph computed it
    hidden: torch.Tensor | None = None  # [N, H] after the final norm


@dataclass(eq=False)
class Queued:
    """A unit's drawn tokens (and log-probs) on their way to the host: the copies are queued on the
    device behind the draw, which is queued behind the step."""

    drawn: torch.Tensor  # [B] the tokens on the device (a lookahead unit's inputs)
    tokens: torch.Tensor  # [B] their host copy
    logprob: torch.Tensor | None  # [B] host copies of the log-probs, where a row wants them
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    done: torch.cuda.Event | None  # recorded after the copies (CUDA); None: they are done

    @classmethod
    def copy_back(cls, drawn: torch.Tensor, result: SampleResult | None, logprob: bool, top: bool) -> Queued:
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

    def read(self) -> tuple[list[int], list[float], list[list[int]], list[list[float]]]:
        """Wait for the copies; the rows' tokens, log-probs, top ids and top log-probs (empty lists where
        the unit computed none)."""
        if self.done is not None:
            self.done.synchronize()

        def host(t: torch.Tensor | None) -> list:
            return t.tolist() if t is not None else []

        return host(self.tokens), host(self.logprob), host(self.top_ids), host(self.top_logprobs)

    def rows(self, seqs: Sequence[SequenceState], metas: Sequence[object]) -> list[PendingRow]:
        """One-token pending rows of ``seqs`` (read back first), each with its commit metadata."""
        tokens, chosen, top_ids, top_lp = self.read()  # the one host sync of a unit: the Engine needs them
        rows = []
        for i, s in enumerate(seqs):
            lp = None
            if s.logprobs.enabled:
                n = s.logprobs.top_n
                top = _finite_top(top_ids[i][:n], top_lp[i][:n]) if n else ()
                lp = (TokenLogprob(token_id=tokens[i], logprob=chosen[i], top=top),)
            rows.append(PendingRow(s.handle, (tokens[i],), s.frontier, lp, metas[i]))
        return rows


class Sampler:
    """Penalty tables and the rows' sampling settings on the device; draws tokens from a step's logits."""

    def __init__(self, max_sequences: int, vocab_size: int, device: torch.device) -> None:
        self.device = device
        # one row per sequence index (allocated once; written at materialization and commit)
        self.prompt_mask = torch.zeros(max_sequences, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(max_sequences, vocab_size, dtype=torch.int32, device=device)
        self._batch: SamplingBatch | None = None  # the last draw's rows' settings (see `settings`)
        self._rows: tuple[SequenceHandle, ...] = ()
        # logit bias and min_tokens holds, one row per sequence index: allocated at the first biased
        # sequence, read only by draws that hold a biased row (the others keep the graph argmax)
        self._max_sequences, self._vocab_size = max_sequences, vocab_size
        self.bias: torch.Tensor | None = None  # [S, V] float32, the request's logit_bias
        self.held: torch.Tensor | None = None  # [S, V] bool, the ids min_tokens holds back
        self.held_until: torch.Tensor | None = None  # [S] int64: positions before it hold them back

    def start(self, seq: SequenceState) -> None:
        """A new sequence at its index: its penalty rows from its prompt (only when it is penalised)."""
        if seq.penalised:
            index = seq.handle.index
            self.prompt_mask[index].zero_()
            self.prompt_mask[index, torch.tensor(seq.prompt, device=self.device)] = True
            self.output_counts[index].zero_()

        if seq.sampling.biased or self.bias is not None:  # a plain row's index may hold an old bias
            self._start_bias(seq)

    def _start_bias(self, seq: SequenceState) -> None:
        if self.bias is None:
            shape, device = (self._max_sequences, self._vocab_size), self.device
            self.bias = torch.zeros(shape, dtype=torch.float32, device=device)
            self.held = torch.zeros(shape, dtype=torch.bool, device=device)
            self.held_until = torch.zeros(self._max_sequences, dtype=torch.int64, device=device)
        assert self.held is not None and self.held_until is not None
        index, sampling = seq.handle.index, seq.sampling
        self.bias[index].zero_()
        if sampling.logit_bias:
            ids, values = zip(*sampling.logit_bias)
            self.bias[index, torch.tensor(ids, device=self.device)] = torch.tensor(
                values, dtype=torch.float32, device=self.device
            )
        self.held[index].zero_()
        self.held_until[index] = 0
        if sampling.min_tokens and sampling.min_tokens_ids:
            self.held[index, torch.tensor(sampling.min_tokens_ids, device=self.device)] = True
            self.held_until[index] = len(seq.prompt) + sampling.min_tokens

    def logit_bias(
        self, seqs: Sequence[SequenceState], index: torch.Tensor, positions: torch.Tensor, tokens: int = 1
    ) -> torch.Tensor | None:
        """The rows' bias [B * tokens, V] for draws at ``positions`` (the first of each row's ``tokens``
        positions, [B]), or ``None`` when no row is biased: a logit_bias, and ``-inf`` on the held ids at
        positions before ``held_until`` (min_tokens). ``None`` costs the plain rows nothing."""
        if not any(_biased(s) for s in seqs):
            return None
        assert self.bias is not None and self.held is not None and self.held_until is not None
        bias, held, until = self.bias[index], self.held[index], self.held_until[index]
        if tokens > 1:
            bias, held, until = (t.repeat_interleave(tokens, dim=0) for t in (bias, held, until))
            offsets = torch.arange(tokens, device=positions.device).repeat(len(seqs))
            positions = positions.repeat_interleave(tokens) + offsets
        if any(s.sampling.min_tokens > len(s.generated) for s in seqs):
            bias = bias.masked_fill(held & (positions < until).unsqueeze(1), float("-inf"))
        return bias

    def count(self, seq: SequenceState, tokens: Sequence[int]) -> None:
        """Committed output tokens join the sequence's output counts (penalised sequences only)."""
        if seq.penalised and tokens:
            ids = torch.tensor(tokens, device=self.device)
            self.output_counts[seq.handle.index].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def settings(self, seqs: Sequence[SequenceState]) -> SamplingBatch:
        """The rows' sampling settings on the device, rebuilt only when the rows change: a request's
        params and seed are fixed for its life."""
        key = tuple(s.handle for s in seqs)
        if self._rows != key:
            params = [s.sampling for s in seqs]
            self._batch = SamplingBatch.build(params, [s.sampling.seed or 0 for s in seqs], self.device)
            self._rows = key
        assert self._batch is not None
        return self._batch

    def draw(
        self, seqs: Sequence[SequenceState], run: StepRun, masks: Sequence[np.ndarray | None] | None = None
    ) -> Queued:
        """Queue one token per row from ``run``'s logits (the sampler, or the graph's argmax) and its copy
        to the host. ``masks``: per row, the allowed-token bitmask of a constrained row (structured
        outputs) or None; the row then draws from its masked logits (`masked_logits`)."""
        assert run.logits is not None
        batch = self.settings(seqs)
        penalised = any(s.penalised for s in seqs)
        want_logprobs = any(s.logprobs.enabled for s in seqs)
        top_n = max((s.logprobs.top_n for s in seqs if s.logprobs.enabled), default=0)
        biased = any(_biased(s) for s in seqs)
        logits = run.logits if masks is None else masked_logits(run.logits, masks)
        if (
            run.greedy is not None
            and batch.all_greedy
            and not (penalised or want_logprobs or biased)
            and logits is run.logits
        ):
            result = None  # exactly the sampler's tokens then: the argmax of the raw logits
            drawn = run.greedy
        else:
            fields = run.step.fields()
            index = fields.sequence_index
            result = sample(
                logits,
                batch,
                # the counter of a draw is the absolute position of the sampled token: the row's context
                # length after the step (frontier + consumed), already on the device with the step's inputs
                fields.context_lens,
                prompt_mask=self.prompt_mask[index] if penalised else None,
                output_counts=self.output_counts[index] if penalised else None,
                num_logprobs=top_n,
                with_logprob=want_logprobs,
                logit_bias=self.logit_bias(seqs, index, fields.context_lens) if biased else None,
            )
            drawn = result.tokens
        return Queued.copy_back(drawn, result, want_logprobs, top_n > 0)  # log-probs: only by the sampler

    def verify(
        self,
        seqs: Sequence[SequenceState],
        run: StepRun,
        drafts: Sequence[Sequence[int]],
        masks: Sequence[np.ndarray | None] | None = None,
    ) -> QueuedVerify:
        """Queue the exact acceptance of each row's deterministic drafts over a verify step's logits (T =
        len(drafts[r]) + 1 tokens per row, `ninfer.ops.speculative.verify_drafts`) and the copies back.
        ``masks``: one bitmask or None per verified position (row-major, B x T): each position's target
        distribution is masked, so the rule stays exact for constrained rows."""
        assert run.logits is not None
        logits = run.logits if masks is None else masked_logits(run.logits, masks)
        batch = self.settings(seqs)
        tokens_per_row = len(drafts[0]) + 1
        penalised = any(s.penalised for s in seqs)
        want_logprobs = any(s.logprobs.enabled for s in seqs)
        top_n = max((s.logprobs.top_n for s in seqs if s.logprobs.enabled), default=0)
        fields = run.step.fields()
        index = fields.sequence_index
        draft_ids = torch.tensor([list(d) for d in drafts], dtype=torch.long)
        if self.device.type == "cuda":
            draft_ids = draft_ids.pin_memory()
        draft_ids = draft_ids.to(self.device, non_blocking=True)
        first = fields.context_lens - (tokens_per_row - 1)  # each row's first produced position: frontier + 1
        result = verify_drafts(
            logits,
            draft_ids.view(len(seqs), tokens_per_row - 1),
            batch,
            first,
            prompt_mask=self.prompt_mask[index] if penalised else None,
            output_counts=self.output_counts[index] if penalised else None,
            num_logprobs=top_n,
            with_logprob=want_logprobs,
            logit_bias=self.logit_bias(seqs, index, first, tokens_per_row),
        )

        def host(t: torch.Tensor) -> torch.Tensor:
            return t.to("cpu", non_blocking=True)

        queued = QueuedVerify(
            result.tokens, result.accepted, host(result.tokens), host(result.accepted),
            host(result.logprob) if want_logprobs else None,
            host(result.top_ids) if top_n else None, host(result.top_logprobs) if top_n else None, None,
        )  # fmt: skip
        if logits.is_cuda:
            queued.done = torch.cuda.Event()
            queued.done.record()
        return queued


@dataclass(eq=False)
class QueuedVerify:
    """A verify unit's tokens at every position, accepted counts and log-probs on their way to the host."""

    drawn: torch.Tensor  # [B, T] the tokens on the device (a drafter's next inputs)
    drawn_accepted: torch.Tensor  # [B] the accepted draft counts on the device
    tokens: torch.Tensor  # [B, T] host copy
    accepted: torch.Tensor  # [B]
    logprob: torch.Tensor | None  # [B, T]
    top_ids: torch.Tensor | None  # [B, T, n]
    top_logprobs: torch.Tensor | None
    done: torch.cuda.Event | None

    def read(self) -> tuple[list[list[int]], list[int], list[list[float]], list[list[list[int]]], list]:
        if self.done is not None:
            self.done.synchronize()

        def host(t: torch.Tensor | None) -> list:
            return t.tolist() if t is not None else []

        return (
            host(self.tokens), host(self.accepted), host(self.logprob), host(self.top_ids),
            host(self.top_logprobs),
        )  # fmt: skip


def _biased(seq: SequenceState) -> bool:
    """The row needs a bias now: a logit_bias, or min_tokens not yet reached (by the committed count, which
    may lag a queued lookahead; the device test by position is exact)."""
    sampling = seq.sampling
    return bool(sampling.logit_bias) or (
        bool(sampling.min_tokens_ids) and sampling.min_tokens > len(seq.generated)
    )


def masked_logits(logits: torch.Tensor, masks: Sequence[np.ndarray | None]) -> torch.Tensor:
    """A copy of ``logits`` [N, V] with each row's disallowed tokens at -inf (structured outputs).

    ``masks[i]``: row i's bitmask (int32 words, bit ``t % 32`` of word ``t // 32`` set: token ``t``
    allowed; tokens past its words never are) or None (the row is left as it is). The words go to the
    device packed (V / 8 bytes a row) and are unpacked there."""
    rows, vocab = logits.shape
    if len(masks) != rows:
        raise ValueError(f"{len(masks)} masks for {rows} logit rows")
    words = (vocab + 31) // 32
    host = np.full((rows, words), -1, dtype=np.int32)
    for i, mask in enumerate(masks):
        if mask is not None:
            n = min(len(mask), words)
            host[i, :n] = mask[:n]
            host[i, n:] = 0
    packed = torch.from_numpy(host)
    if logits.is_cuda:
        packed = packed.pin_memory().to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).view(rows, words * 32)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def gather_rows(tokens: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``tokens[rows]`` on the device, queued behind what computes ``tokens`` (the index goes through
    pinned memory: a copy from pageable memory would wait for the device queue to drain)."""
    index = torch.tensor(rows, dtype=torch.long)
    if tokens.is_cuda:
        index = index.pin_memory().to(tokens.device, non_blocking=True)
    return tokens.index_select(0, index)


def _finite_top(ids: Sequence[int], values: Sequence[float]) -> tuple[tuple[int, float], ...]:
    """Top alternatives, less the tokens a constrained row's mask ruled out (log-prob -inf)."""
    return tuple((t, v) for t, v in zip(ids, values) if v != float("-inf"))


def forced_logprobs(logits: torch.Tensor, tokens: tuple[int, ...], top_n: int) -> tuple[TokenLogprob, ...]:
    """Raw log-probs of forced tokens: ``logits[i]`` is the model's prediction for ``tokens[i]``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(tokens, device=logits.device)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    top: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if top_n:
        values, top_ids = logprobs.topk(top_n, dim=-1)
        top = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
    return tuple(TokenLogprob(token_id=t, logprob=c, top=a) for t, c, a in zip(tokens, chosen, top))
