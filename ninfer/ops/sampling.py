"""Counter-based, graph-capturable token sampling (architecture brief §4).

Every row's randomness is a pure function of (request seed, position of the token being sampled,
token id). There is no ``torch.Generator`` state: the "RNG" advances exactly when the Program commits a
position and passes the next one, a seeded request reproduces across runs and batch compositions, and
forced-control tokens (never sampled) cannot disturb it.

Sampling is Gumbel-max: ``argmax(filtered_logits / T + g)`` with ``g = -log(-log(u))`` and ``u`` built
from a 32-bit integer hash of the counter. The hash uses only int64 tensor ops on values kept in
[0, 2**32), with every multiply arranged so it cannot overflow int64, so CPU and CUDA produce the same
noise bits. (The float transform ``-log(-log(u))`` may differ by an ulp between devices; that can flip
a draw only when two candidates tie to within one float32 ulp.)

Order of operations in `sample`: penalties -> logit bias (when given) -> greedy rows take the argmax ->
temperature -> top-k -> top-p -> min-p -> Gumbel-max. All per-row work is tensor ops with no host sync
and no branching on device data, so a decode step that calls `sample` can be captured in a CUDA graph.
The only branches are on host-side facts fixed when the `SamplingBatch` is built (`candidates`, `all_greedy`).

Filter semantics (value thresholds, so ties never depend on sort order or device):
- top-k keeps tokens whose value is >= the k-th largest value (ties at the boundary are kept);
- top-p keeps, in the top-k-renormalised distribution, the smallest descending prefix whose mass is
  >= top_p, plus every token tied with its last member;
- min-p keeps tokens with prob >= min_p * max_prob (renormalisation does not change that ratio).

Reported log-probs are ``log_softmax`` of the raw model logits, before penalties, temperature and
truncation, which is what the OpenAI API and vLLM (default ``logprobs_mode``) report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ninfer.runtime.contract.types import MAX_TOP_LOGPROBS, SamplingParams

__all__ = [
    "ALL_CANDIDATES",
    "MAX_LOGPROBS",
    "MIN_TEMPERATURE",
    "SampleResult",
    "SamplingBatch",
    "SamplingParams",
    "apply_filters",
    "apply_penalties",
    "counter_bits",
    "counter_uniform",
    "gumbel_noise",
    "mix32",
    "mix32_int",
    "sample",
    "wrap_seed",
]

MAX_LOGPROBS = MAX_TOP_LOGPROBS
# Temperatures in (0, MIN_TEMPERATURE) are computed as MIN_TEMPERATURE: below it the draw is already
# the argmax for any realistic logit gap, and a smaller divisor could overflow float32 to inf.
MIN_TEMPERATURE = 1e-5
ALL_CANDIDATES = 1 << 62  # `SamplingBatch.candidates` value meaning "a full sort of the vocabulary"

_MASK32 = 0xFFFFFFFF
_INT32_MAX = (1 << 31) - 1
_NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------------
# counter-based hash
# --------------------------------------------------------------------------------------------------


def _as_signed_multiplier(constant: int) -> int:
    """``x * c mod 2**32`` equals ``x * (c - 2**32) mod 2**32``; using the signed form keeps the int64
    product of a 32-bit ``x`` inside (-2**63, 2**63), so no overflow (undefined in C++) ever happens."""
    return constant - (1 << 32) if constant >= (1 << 31) else constant


# lowbias32 (C. Wellons, hash-prospector): a 32-bit finaliser with very low avalanche bias.
_LOWBIAS_M1 = 0x7FEB352D
_LOWBIAS_M2 = 0x846CA68B
_M1_SIGNED = _as_signed_multiplier(_LOWBIAS_M1)
_M2_SIGNED = _as_signed_multiplier(_LOWBIAS_M2)


def mix32_int(x: int) -> int:
    """lowbias32 on a Python int (the plain reference the tensor version must equal)."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * _LOWBIAS_M1) & _MASK32
    x ^= x >> 15
    x = (x * _LOWBIAS_M2) & _MASK32
    x ^= x >> 16
    return x


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int64 tensor of values in [0, 2**32); returns a new tensor in the same range."""
    x = x ^ (x >> 16)
    x.mul_(_M1_SIGNED).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_M2_SIGNED).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 16)
    return x


def _stream_salts(stream: int) -> tuple[int, int]:
    """Two distinct 32-bit salts per stream, so independent uses (token draws, speculative acceptance
    tests, ...) of the same (seed, position) never share noise."""
    if not 0 <= stream < (1 << 30):
        raise ValueError(f"stream must be in [0, 2**30), got {stream}")
    golden = 0x9E3779B9
    return mix32_int((2 * stream + 1) * golden), mix32_int((2 * stream + 2) * golden)


_TOKEN_SALT = 0x2545F491


def _row_keys(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """Two 32-bit keys per row, [2, B], from the full 64-bit seed and 64-bit position (int64 [B])."""
    seed = seed.long()
    position = position.long()
    salt_a, salt_b = _stream_salts(stream)
    # both key lanes in one [2, B] tensor: half the (launch-bound) tiny kernels of two passes
    seed_lo = seed & _MASK32
    key = mix32(torch.stack((seed_lo ^ salt_a, seed_lo ^ salt_b)))
    # `>>` on int64 is arithmetic, so `& mask` after it yields the high word of the two's complement.
    for word in ((seed >> 32) & _MASK32, position & _MASK32, (position >> 32) & _MASK32):
        key = mix32(key ^ word)
    return key


def counter_bits(
    seed: torch.Tensor, position: torch.Tensor, index: torch.Tensor, stream: int = 0
) -> torch.Tensor:
    """32 random bits (int64 in [0, 2**32)) for every (row, index): a pure function of
    (seed[b], position[b], index, stream).

    seed, position: int64 [B]; index: int64 [N] (shared by all rows) or [B, N]. Returns [B, N].
    """
    keys = _row_keys(seed, position, stream)
    index_hash = mix32((index.long() & _MASK32) ^ _TOKEN_SALT)
    if index_hash.dim() == 1:
        index_hash = index_hash.unsqueeze(0)
    # two keys (64 bits of key material) so that two (seed, position) streams are unrelated even when
    # one of their 32-bit keys collides
    x = index_hash ^ keys[0].unsqueeze(1)
    x.add_(keys[1].unsqueeze(1)).bitwise_and_(_MASK32)
    return mix32(x)


def _negated_uniform(
    seed: torch.Tensor, position: torch.Tensor, index: torch.Tensor, stream: int
) -> torch.Tensor:
    """``-w`` for `counter_uniform`'s ``w``, built negated to save a kernel on the hot path."""
    bits = counter_bits(seed, position, index, stream)
    # -(bits + 0.5) * 2**-32, rounded exactly as the unnegated form (scaling by 2**-32 is exact).
    # int -> float32 keeps 24 significant bits, so the largest values can round to 1.0; clamp to the
    # largest float32 below 1 (an event of probability ~3e-8).
    negated = bits.to(torch.float32).mul_(-(2.0**-32)).sub_(2.0**-33)
    return negated.clamp_(min=-(1.0 - 2.0**-24))


def counter_uniform(
    seed: torch.Tensor, position: torch.Tensor, index: torch.Tensor, stream: int = 0
) -> torch.Tensor:
    """Float32 uniform in (0, 1) per (row, index), from `counter_bits`; exact spacing 2**-32 near 0."""
    return _negated_uniform(seed, position, index, stream).neg_()


def _log_exponential(
    seed: torch.Tensor, position: torch.Tensor, vocab_size: int, stream: int
) -> torch.Tensor:
    """``log(E)`` with ``E = -log1p(-w)`` a standard exponential; the Gumbel variable is ``-log(E)``.

    ``w`` (a uniform with fine resolution near 0) plays the role of ``1 - u``: ``-log(u) = -log1p(-w)``
    keeps full precision in the large-Gumbel tail that decides which token wins.
    """
    index = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    exponential = torch.log1p(_negated_uniform(seed, position, index, stream)).neg_()
    return exponential.log_()


def gumbel_noise(
    seed: torch.Tensor, position: torch.Tensor, vocab_size: int, stream: int = 0
) -> torch.Tensor:
    """Standard Gumbel noise [B, vocab_size] float32 for the counter (seed[b], position[b], token id)."""
    return _log_exponential(seed, position, vocab_size, stream).neg_()


# --------------------------------------------------------------------------------------------------
# parameters
# --------------------------------------------------------------------------------------------------


def wrap_seed(seed: int) -> int:
    """A seed taken modulo 2**64, as the int64 (two's complement) a device tensor can hold."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def _candidates_needed(params: SamplingParams) -> int:
    """How many top candidates a row's top-k/top-p need to see (0 = none, ALL_CANDIDATES = full sort)."""
    if params.greedy:
        return 0
    if params.top_k > 0:
        return min(params.top_k, ALL_CANDIDATES)
    return ALL_CANDIDATES if params.top_p < 1 else 0


# --------------------------------------------------------------------------------------------------
# batch
# --------------------------------------------------------------------------------------------------


@dataclass
class SamplingBatch:
    """Per-row sampling settings as device tensors, one row per request.

    `candidates` and `all_greedy` are host-side facts derived from the params when the batch is built
    (never read back from the device). They choose the static shape of the work: `candidates` is how
    many top values per row top-k/top-p look at (any value >= the rows' need gives the same tokens, so
    a captured graph may pin it, e.g. to ALL_CANDIDATES); `all_greedy` skips noise and filters.
    """

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int32, 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B] float32
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64 (the effective per-request seed, mod 2**64)
    greedy: torch.Tensor  # [B] bool
    candidates: int = ALL_CANDIDATES
    all_greedy: bool = False

    @staticmethod
    def _host_tensors(params: Sequence[SamplingParams], seeds: Sequence[int]) -> dict[str, torch.Tensor]:
        if len(params) != len(seeds):
            raise ValueError(f"got {len(params)} SamplingParams but {len(seeds)} seeds")
        for p in params:
            p.validate()
        for s in seeds:
            if not isinstance(s, int) or isinstance(s, bool):
                raise ValueError(f"seed must be an integer, got {s!r}")
        f32 = torch.float32
        return {
            "temperature": torch.tensor([p.temperature for p in params], dtype=f32),
            "top_k": torch.tensor([min(p.top_k, _INT32_MAX) for p in params], dtype=torch.int32),
            "top_p": torch.tensor([p.top_p for p in params], dtype=f32),
            "min_p": torch.tensor([p.min_p for p in params], dtype=f32),
            "repetition_penalty": torch.tensor([p.repetition_penalty for p in params], dtype=f32),
            "presence_penalty": torch.tensor([p.presence_penalty for p in params], dtype=f32),
            "frequency_penalty": torch.tensor([p.frequency_penalty for p in params], dtype=f32),
            "seed": torch.tensor([wrap_seed(s) for s in seeds], dtype=torch.int64),
            "greedy": torch.tensor([p.greedy for p in params], dtype=torch.bool),
        }

    @staticmethod
    def _static_facts(params: Sequence[SamplingParams]) -> tuple[int, bool]:
        candidates = max((_candidates_needed(p) for p in params), default=0)
        return candidates, all(p.greedy for p in params)

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], seeds: Sequence[int], device: torch.device | str
    ) -> SamplingBatch:
        """Validate `params` and place them on `device`; `seeds[i]` is row i's effective seed (the
        Program derives one for requests without `seed`)."""
        host = cls._host_tensors(params, seeds)
        candidates, all_greedy = cls._static_facts(params)
        device = torch.device(device)
        if device.type == "cuda":  # copies from pageable memory would each wait for the device queue
            host = {name: t.pin_memory() for name, t in host.items()}
        tensors = {name: t.to(device, non_blocking=True) for name, t in host.items()}
        return cls(**tensors, candidates=candidates, all_greedy=all_greedy)

    def update(self, params: Sequence[SamplingParams], seeds: Sequence[int]) -> None:
        """Overwrite every row in place (same B), keeping the tensors a captured graph reads."""
        if len(params) != self.size:
            raise ValueError(f"batch has {self.size} rows, got {len(params)} SamplingParams")
        for name, host in self._host_tensors(params, seeds).items():
            getattr(self, name).copy_(host)
        self.candidates, self.all_greedy = self._static_facts(params)

    @property
    def size(self) -> int:
        return int(self.temperature.shape[0])


# --------------------------------------------------------------------------------------------------
# logits processing and sampling
# --------------------------------------------------------------------------------------------------


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    output_counts: torch.Tensor | None,
    batch: SamplingBatch,
) -> torch.Tensor:
    """Penalised copy of `logits` [B, V] float32.

    Repetition penalty (HF/vLLM) on tokens seen in the prompt or the output: positive logits are
    divided by it, others multiplied. Presence (-p once) and frequency (-f * count) penalties apply to
    output tokens only (OpenAI semantics). `prompt_mask` [B, V] bool and `output_counts` [B, V] int
    may be None (nothing seen).
    """
    if prompt_mask is None and output_counts is None:
        return logits.clone()
    seen = torch.zeros_like(logits, dtype=torch.bool) if prompt_mask is None else prompt_mask.bool()
    if output_counts is not None:
        in_output = output_counts > 0
        seen = seen | in_output
    repetition = batch.repetition_penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    out = torch.where(seen, penalised, logits)
    if output_counts is not None:
        out = out - batch.frequency_penalty.unsqueeze(1) * output_counts.to(out.dtype)
        out = out - batch.presence_penalty.unsqueeze(1) * in_output.to(out.dtype)
    return out


def apply_filters(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    candidates: int = ALL_CANDIDATES,
) -> torch.Tensor:
    """Top-k, then top-p, then min-p on temperature-scaled logits [B, V]; removed tokens become -inf.

    `candidates` is how many top values per row to sort (>= every row's top_k, or the full vocabulary
    when a row has top_k off and top_p < 1); 0 skips top-k/top-p entirely.
    """
    vocab = scaled.shape[-1]
    # min-p: p >= min_p * p_max  <=>  logit >= logit_max + log(min_p); log(0) = -inf keeps everything
    threshold = scaled.amax(dim=-1) + torch.log(min_p)
    width = min(candidates, vocab)
    if width > 0:
        if width >= vocab:
            top_values = scaled.sort(dim=-1, descending=True).values
        else:
            top_values = scaled.topk(width, dim=-1, sorted=True).values
        k_index = (top_k.clamp(min=1, max=width) - 1).long().unsqueeze(1)
        kth_value = top_values.gather(1, k_index).squeeze(1)
        cut_k = torch.where(top_k > 0, kth_value, _NEG_INF)
        # top-p over the top-k-renormalised distribution, in descending order
        kept_values = top_values.masked_fill(top_values < cut_k.unsqueeze(1), _NEG_INF)
        probs = kept_values.softmax(dim=-1)
        mass_before = torch.cumsum(probs, dim=-1).roll(1, dims=-1)
        mass_before[:, 0] = 0.0
        # >= 1 since top_p > 0; the clamp only guards a row of all -inf (NaN probs)
        n_keep = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
        cut_p = top_values.gather(1, n_keep - 1).squeeze(1)
        cut_p = torch.where(top_p < 1, cut_p, _NEG_INF)  # top_p = 1 keeps all despite cumsum rounding
        threshold = torch.maximum(threshold, torch.maximum(cut_k, cut_p))
    return scaled.masked_fill(scaled < threshold.unsqueeze(1), _NEG_INF)


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy draw: ``torch.argmax(logits, -1)`` (into ``out`` where given), the first max, a NaN
    counting as the largest (the fast form: `ninfer.ops.triton.argmax.argmax_rows`)."""
    return torch.argmax(logits, dim=-1, out=out)


class SampleResult(NamedTuple):
    tokens: torch.Tensor  # [B] int64
    logprob: torch.Tensor  # [B] float32, log_softmax(raw logits)[token]
    top_ids: torch.Tensor  # [B, n] int64, highest raw log-probs first
    top_logprobs: torch.Tensor  # [B, n] float32


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    positions: torch.Tensor,
    prompt_mask: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
    num_logprobs: int = 0,
    with_logprob: bool = True,
    logit_bias: torch.Tensor | None = None,
) -> SampleResult:
    """Draw one token per row.

    logits: [B, V] any float dtype (computed in float32). positions: int64 [B], the absolute position
    of the token being sampled; with the row's seed it is the whole random state. num_logprobs: how
    many top raw log-probs to return per row (static; rows wanting fewer slice).
    Log-probs are those of the raw logits (before penalties, temperature and truncation).
    ``with_logprob=False`` (no row asked for log-probs) skips the full-vocabulary normaliser; the
    returned ``logprob`` is then zeros and ``num_logprobs`` must be 0.
    ``logit_bias`` [B, V] float32 (``None``: no row has one) is added after the penalties; ``-inf``
    forbids a token. Like the penalties it changes the draw, not the reported log-probs.
    """
    raw = logits.float()
    vocab = raw.shape[-1]
    if prompt_mask is None and output_counts is None:
        penalised = raw
    else:
        penalised = apply_penalties(raw, prompt_mask, output_counts, batch)
    if logit_bias is not None:
        penalised = penalised + logit_bias
    tokens = penalised.argmax(dim=-1)
    if not batch.all_greedy:
        temperature = torch.where(batch.greedy, 1.0, batch.temperature.clamp(min=MIN_TEMPERATURE))
        scaled = penalised / temperature.unsqueeze(1)
        filtered = apply_filters(scaled, batch.top_k, batch.top_p, batch.min_p, batch.candidates)
        filtered.sub_(_log_exponential(batch.seed, positions, vocab, stream=0))  # + Gumbel noise
        tokens = torch.where(batch.greedy, tokens, filtered.argmax(dim=-1))

    if not with_logprob:
        if num_logprobs:
            raise ValueError("num_logprobs needs with_logprob=True")
        empty = torch.empty((raw.shape[0], 0), device=raw.device)
        return SampleResult(tokens, torch.zeros_like(tokens, dtype=torch.float32), empty.long(), empty)
    log_normaliser = torch.logsumexp(raw, dim=-1)
    logprob = raw.gather(1, tokens.unsqueeze(1)).squeeze(1) - log_normaliser
    if num_logprobs > 0:
        top_values, top_ids = raw.topk(num_logprobs, dim=-1)
        top_logprobs = top_values - log_normaliser.unsqueeze(1)
    else:
        top_ids = torch.empty((raw.shape[0], 0), dtype=torch.int64, device=raw.device)
        top_logprobs = torch.empty((raw.shape[0], 0), dtype=torch.float32, device=raw.device)
    return SampleResult(tokens=tokens, logprob=logprob, top_ids=top_ids, top_logprobs=top_logprobs)
