"""Public owning values of the NInfer Engine: configuration, requests, events, results and errors.

Everything here is a plain immutable value (no torch, no threads), so gateways can build and read them
freely. The Engine itself (``ninfer.Engine``) and ``GenerationHandle`` live in ``ninfer.runtime.engine``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from ninfer.runtime.contract.constraint import OutputConstraint
from ninfer.runtime.contract.types import TokenLogprob

__all__ = [
    "Availability",
    "EngineConfig",
    "EngineFailed",
    "FinishReason",
    "GenerationDelta",
    "GenerationEvent",
    "GenerationRequest",
    "GenerationResult",
    "GenerationStart",
    "NEUTRAL_SAMPLING",
    "NInferError",
    "OutputConstraint",
    "RejectKind",
    "RequestRejected",
    "ScoreResult",
    "TokenLogprob",
    "ToolCallDelta",
    "Usage",
    "default_decode_gap_ms",
    "default_prefill_chunk",
    "resolve_sampling",
]

Purpose = Literal["generation", "causal_scoring"]
FinishReason = Literal["stop", "length", "cancelled", "error"]
MAX_CONCURRENCY_LIMIT = 8
MAX_TOP_LOGPROBS = 20
# the neutral (OpenAI) value of each sampling field that neither the request nor the model's generation
# config sets: no temperature scaling, no truncation, no penalty
NEUTRAL_SAMPLING: Mapping[str, float | int] = MappingProxyType(
    {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
)


# ---------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------


def default_prefill_chunk(kernels: str) -> int:
    """Prompt tokens per prefill unit when ``EngineConfig.prefill_chunk_tokens`` is None, by op table.

    ``fast`` (CUDA): 8192, as vLLM's and SGLang's defaults on 80-141 GB GPUs. Each unit pays a fixed host
    cost (Python over every layer), which a 2048-token unit of Qwen3.6-35B-A3B does not cover on the H200
    (docs/benchmarks.md, "Why the kernels are as they are", prefill unit). ``reference``: 2048, because its
    attention materialises fp32 scores of [heads, unit, context] (several GB for an 8192-token unit).
    """
    return 8192 if kernels == "fast" else 2048


def default_decode_gap_ms(kernels: str) -> float:
    """``EngineConfig.max_decode_gap_ms`` when None, by op table: ``fast`` (CUDA) 100 ms, so a decoding
    stream sees at most about a tenth of a second between two tokens while a long prompt is prefilled
    (a full 8,192-token chunk takes about 0.7 s on the 27B); ``reference``: 0 (off: chunk sizes that
    depend on timing would make CPU runs' prefill chunks, and so their float sums, differ run to run)."""
    return 100.0 if kernels == "fast" else 0.0


MAX_DRAFT_TOKENS = 8
MAX_DFLASH_DRAFT_TOKENS = 15  # a DFlash block of 16 positions: the anchor and 15 drafts


@dataclass(frozen=True)
class SpeculativeSpec:
    """A speculative decoding backend, fixed at start (`parse_speculative`).

    ``method``: ``mtp`` (the checkpoint's multi-token-prediction head), ``dflash`` (the package's DFlash
    block drafter, its weights converted into the artifact) or ``known`` (a benchmark backend: drafts
    whose acceptance is scripted to ``mean_accepted`` tokens per row per verify, through the real verify
    and commit path; its output is not the model's). ``draft_tokens``: K drafts per verify (a verify
    step runs K + 1 tokens per row).
    """

    method: Literal["mtp", "dflash", "known"]
    draft_tokens: int
    mean_accepted: float | None = None  # known only: mean tokens a row produces per verify (1..K+1)


def parse_speculative(text: str | None) -> SpeculativeSpec | None:
    """``None``, ``mtp:K``, ``dflash:K`` or ``known:K@TAU`` -> a `SpeculativeSpec`; ValueError names what
    is wrong."""
    if text is None:
        return None
    method, _, rest = text.partition(":")
    count, _, tau = rest.partition("@")
    if method not in ("mtp", "dflash", "known") or not count.isdigit():
        raise ValueError(
            f"speculative must be 'mtp:K' (K = 1..{MAX_DRAFT_TOKENS}), 'dflash:K' (K = "
            f"1..{MAX_DFLASH_DRAFT_TOKENS}) or 'known:K@TAU', got {text!r}"
        )
    k = int(count)
    limit = MAX_DFLASH_DRAFT_TOKENS if method == "dflash" else MAX_DRAFT_TOKENS
    if not 1 <= k <= limit:
        raise ValueError(f"speculative draft tokens K must be 1..{limit}, got {k}")
    if method in ("mtp", "dflash"):
        if tau:
            raise ValueError(f"{method} takes no mean accepted length (it is the model's), got {text!r}")
        return SpeculativeSpec(method, k)
    try:
        mean = float(tau)
    except ValueError:
        raise ValueError(f"known:K@TAU needs the mean accepted length TAU (1..K+1), got {text!r}") from None
    if not 1.0 <= mean <= k + 1:
        raise ValueError(f"known:K@TAU: TAU must be in [1, {k + 1}], got {mean}")
    return SpeculativeSpec("known", k, mean)


@dataclass(frozen=True)
class EngineConfig:
    """Everything fixed when an Engine starts. Invalid values raise ``ValueError`` naming the field.

    - ``purpose``: ``generation`` (requests, streaming) or ``causal_scoring`` (``Engine.score`` only);
      fixed for the Engine's life.
    - ``max_concurrency``: active requests at once (1..8); the KV pool is shared, not split per lane.
    - ``queue_capacity``: waiting requests beyond the active ones; a submit beyond
      ``max_concurrency + queue_capacity`` outstanding requests is rejected at once (overload).
    - ``queue_timeout_s``: longest wait for admission; ``None`` waits forever.
    - ``max_context``: longest prompt + generated tokens of one request; ``None`` takes the Program's: on
      CUDA the model's positions when one request that long fits in the KV pool, else the most that fits;
      on CPU ``min(model, 32768)``. A value the pool cannot hold is refused at start.
    - ``device``/``dtype``: where and in which compute dtype the Program runs (``auto`` picks CUDA when
      present, and the artifact's storage dtype).
    - ``page_size``: KV positions per page; ``prefill_chunk_tokens``: prompt tokens per prefill unit, so
      a long prompt interleaves with decode rounds; ``None`` takes `default_prefill_chunk` of the op
      table the Program runs.
    - ``max_decode_gap_ms``: while requests decode, the staged prefill's chunks are sized so that their
      inter-token gap (one chunk + one decode round, learned from the gaps measured) stays under this
      many milliseconds; with nothing decoding a chunk is ``prefill_chunk_tokens`` again. ``0`` turns
      it off; ``None`` takes `default_decode_gap_ms` of the op table (docs/engine.md, "Prefill pacing").
    - ``cuda_graphs``/``warmup``: capture decode graphs; run one warmup request before ``ready``.
    - ``prefill_graph_tokens``: with ``cuda_graphs`` and the fast op table, a one-row text prefill chunk
      of up to this many tokens replays a CUDA graph (capacities 64, 128, ...; the chunk laid
      out at the smallest that holds it) instead of paying ~100 ms of Python launches; ``0``: every
      chunk eager (docs/engine.md, "Prefill graphs").
    - ``decode_lookahead``: the Program queues the decode after each decode before the Engine has
      committed the first, so the GPU runs it while the worker commits and publishes (SGLang's overlap
      scheduling, vLLM's async scheduling; docs/engine.md). Costs one more recurrent-state slot per lane
      and, when a row ends unforeseen (a stop token), one discarded step. ``None``: on for CUDA.
    - ``kernels``: the op implementations: ``auto`` (fast Triton/fla-core ops on CUDA, the reference
      ops elsewhere), ``reference`` (plain PyTorch everywhere: the oracle) or ``fast`` (CUDA only).
    - ``speculative``: the decode backend: ``None`` (plain decoding), ``mtp:K``, ``dflash:K`` (an artifact
      converted with a DFlash drafter, `ninfer convert --dflash`) or the benchmark backend ``known:K@TAU``
      (`parse_speculative`); fixed for the Engine's life.
    - ``draft_vocab``: ``mtp:K`` and ``dflash:K`` only: the draft head scores only the first
      ``draft_vocab`` token ids (a byte-level BPE vocabulary lists its tokens in merge order, frequent
      ones first), so a draft step reads that slice of ``lm_head`` instead of all of it (2.5 GB on the
      27B). Still lossless: the verify scores the whole vocabulary, so a draft outside the slice is only
      never proposed. ``None``: the whole vocabulary.
    - ``max_image_tokens``: image pad tokens one request may carry (a 1024 x 1024 image is 1,024); the
      vision tower's working memory is reserved for this many at start, a larger request is rejected.
    - ``vision_graph_sizes``: with ``cuda_graphs``, image sizes (width, height in pixels, as sent) whose
      vision tower the Program captures as a CUDA graph at start (one per size, keyed by the grid the
      Frontend resizes it to; an image of another size runs eagerly). Each must fit ``max_image_tokens``.
    - ``score_window``/``score_stride``: causal scoring windows (see ``Engine.score``).
    - ``prefix_cache``: the context cache (docs/resources-and-context-cache.md): a request whose prompt
      starts with a prefix the Engine has run before continues the checkpoint at that prefix instead of
      prefilling it; output is the same as a cold run. A request may opt out (``GenerationRequest``).
    - ``cache_memory_gb``: memory for the context cache's own resources. On CUDA, its checkpoint state
      slots (the checkpoints' KV pages come from the shared pool, which fills the memory); ``None``: a
      tenth of the memory left for state, at most 64 slots. On CPU, where the pool only holds
      ``max_context x max_concurrency``, the checkpoint budget: a quarter state slots, the rest KV pages
      added to the pool; ``None``: four times the lanes' state, at most 1 GiB. Checkpoints may also use
      whatever the lanes leave idle.
    - ``host_cache_gb``: host memory (pinned on CUDA) for a second checkpoint tier: a checkpoint the
      device needs room from is copied there instead of dropped, and copied back when a later request
      continues it (docs/resources-and-context-cache.md, "The host tier"). A quarter becomes state slots,
      the rest KV pages. ``0`` (the default): no host tier, evicted checkpoints are dropped. Not used
      without ``prefix_cache``.
    - ``capture_interval``: prompt tokens between two checkpoints of a long prompt (besides the
      Frontend's reuse boundaries: the system preamble and the assistant turn starts). The default is the
      fast table's prefill unit, so a long prompt's capture points fall on its unit boundaries
      (docs/resources-and-context-cache.md, "Where checkpoints come from").
    - ``gpu_memory_fraction``: the share of the CUDA device's total memory a generation Engine may hold,
      weights included (vLLM's ``--gpu-memory-utilization``); the shared KV pool takes what is left of it
      after the weights, the working space and the state slots (docs/resources-and-context-cache.md,
      "Sizing"). Not used on CPU.
    """

    purpose: Purpose = "generation"
    max_concurrency: int = 4
    queue_capacity: int = 64
    queue_timeout_s: float | None = 600.0
    max_context: int | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    page_size: int = 64
    prefill_chunk_tokens: int | None = None
    max_decode_gap_ms: float | None = None
    cuda_graphs: bool = True
    prefill_graph_tokens: int = 1024
    decode_lookahead: bool | None = None
    warmup: bool = True
    kernels: Literal["auto", "reference", "fast"] = "auto"
    score_window: int = 2048
    score_stride: int = 1024
    speculative: str | None = None
    draft_vocab: int | None = None
    max_image_tokens: int = 16384
    vision_graph_sizes: tuple[tuple[int, int], ...] = ()
    prefix_cache: bool = True
    cache_memory_gb: float | None = None
    host_cache_gb: float = 0.0
    capture_interval: int = 8192
    gpu_memory_fraction: float = 0.9

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.cache_memory_gb is not None and not self.cache_memory_gb >= 0:
            raise ValueError(f"cache_memory_gb must be >= 0 or None, got {self.cache_memory_gb}")
        host = self.host_cache_gb
        if isinstance(host, bool) or not isinstance(host, (int, float)) or not 0 <= host < float("inf"):
            raise ValueError(f"host_cache_gb must be a number of GB >= 0, got {self.host_cache_gb!r}")
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0 (0: off), got {self.prefill_graph_tokens}")
        if self.capture_interval < 1:
            raise ValueError(f"capture_interval must be >= 1, got {self.capture_interval}")
        spec = parse_speculative(self.speculative)  # raises ValueError naming what is wrong
        if self.draft_vocab is not None:
            if self.draft_vocab < 1:
                raise ValueError(f"draft_vocab must be >= 1 or None, got {self.draft_vocab}")
            if spec is None or spec.method not in ("mtp", "dflash"):
                raise ValueError(
                    f"draft_vocab needs speculative 'mtp:K' or 'dflash:K', got {self.speculative!r}"
                )
        if self.max_image_tokens < 0:
            raise ValueError(f"max_image_tokens must be >= 0, got {self.max_image_tokens}")
        for size in self.vision_graph_sizes:
            if len(size) != 2 or min(size) < 1:
                raise ValueError(f"vision_graph_sizes holds (width, height) pixel sizes >= 1, got {size!r}")
        if self.purpose not in ("generation", "causal_scoring"):
            raise ValueError(f"purpose must be 'generation' or 'causal_scoring', got {self.purpose!r}")
        if not 1 <= self.max_concurrency <= MAX_CONCURRENCY_LIMIT:
            raise ValueError(
                f"max_concurrency must be 1..{MAX_CONCURRENCY_LIMIT}, got {self.max_concurrency}"
            )
        if self.queue_capacity < 0:
            raise ValueError(f"queue_capacity must be >= 0, got {self.queue_capacity}")
        if self.queue_timeout_s is not None and not self.queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s must be > 0 or None, got {self.queue_timeout_s}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be >= 2 or None, got {self.max_context}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto/bfloat16/float16/float32, got {self.dtype!r}")
        if self.kernels not in ("auto", "reference", "fast"):
            raise ValueError(f"kernels must be 'auto', 'reference' or 'fast', got {self.kernels!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_decode_gap_ms is not None and not self.max_decode_gap_ms >= 0:
            raise ValueError(f"max_decode_gap_ms must be >= 0 (0: off) or None, got {self.max_decode_gap_ms}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.score_window < 2:
            raise ValueError(f"score_window must be >= 2, got {self.score_window}")
        if not 1 <= self.score_stride <= self.score_window - 1:
            raise ValueError(
                f"score_stride must be 1..score_window-1 ({self.score_window - 1}) so windows overlap by at "
                f"least one token, got {self.score_stride}"
            )


# ---------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationRequest:
    """One generation request. Give exactly one of ``prompt`` (text or token ids) or ``messages``.

    ``max_tokens=None`` allows generation up to the context limit. Sampling follows vLLM/OpenAI
    conventions: ``temperature=0`` is greedy, ``top_k`` 0 or -1 disables top-k, ``seed=None`` draws a
    fresh seed. A sampling field left ``None`` takes the model's default, resolved by the Engine (see
    ``resolve_sampling``): the generation config's value, else the neutral one in ``NEUTRAL_SAMPLING``.
    ``stop``/``stop_token_ids`` end generation (the stop string is not included in the text
    unless ``include_stop_str_in_output``); ``ignore_eos`` keeps going past end-of-sequence tokens.
    ``logprobs`` adds the chosen token's logprob, ``top_logprobs`` (0..20) that many alternatives.
    ``thinking_budget`` (>= 1) caps reasoning tokens: the Frontend then forces the end of the thinking
    block. It cannot be 0: the first token is sampled together with the end of the prompt.
    ``logit_bias`` maps token ids (below the vocabulary size) to a bias in [-100, 100] added to their
    logits before sampling (OpenAI's meaning: -100 bans a token, +100 all but forces it; greedy too); the
    reported log-probs stay the model's. ``min_tokens``: the end-of-sequence tokens (unless
    ``ignore_eos``) and ``stop_token_ids`` cannot be drawn before that many tokens were generated (vLLM's
    meaning; stop strings still apply).
    ``constraint`` (structured outputs, docs/structured-outputs.md): what the output after the reasoning
    must match (a JSON schema, a regex, a choice, a grammar, tool calls).
    """

    prompt: str | Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    thinking_budget: int | None = None
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    # the context cache: a session key finds the session's latest continuation first (a hint: reuse is
    # decided by content, so output never depends on it); ``prefix_cache=False`` keeps the request out
    # of the cache (it neither continues nor leaves checkpoints)
    session_id: str | None = None
    prefix_cache: bool = True
    constraint: OutputConstraint | None = None

    def problems(self) -> list[str]:
        """Every reason this request cannot be represented, each saying what to change."""
        out: list[str] = []
        if (self.prompt is None) == (self.messages is None):
            out.append("give exactly one of prompt or messages")
        if self.prompt is not None and not isinstance(self.prompt, str):
            ids = list(self.prompt)
            if not ids:
                out.append("prompt token list is empty; give at least one token id")
            elif any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
                out.append("prompt token ids must be non-negative integers")
        if isinstance(self.prompt, str) and not self.prompt:
            out.append("prompt is empty; give some text")
        if self.messages is not None and not list(self.messages):
            out.append("messages is empty; give at least one message")
        if self.tools is not None and self.messages is None:
            out.append("tools need messages (a chat request), not a raw prompt")
        if self.max_tokens is not None and self.max_tokens < 1:
            out.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        out.extend(sampling_problems({name: getattr(self, name) for name in NEUTRAL_SAMPLING}))
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            out.append(f"seed must be an integer in [0, 2**63), got {self.seed}")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
            if any(not isinstance(s, str) or not s for s in stops):
                out.append("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            out.append("stop_token_ids must be non-negative integers")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            out.append(f"top_logprobs must be 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            out.append("top_logprobs needs logprobs=True")
        if self.thinking_budget is not None and self.thinking_budget < 1:
            out.append(
                f"thinking_budget must be >= 1, got {self.thinking_budget}: the final prefill step always "
                "samples the first token before the thinking block can be closed; to skip thinking, "
                "turn it off in the chat template (chat_template_kwargs enable_thinking=False)"
            )
        out.extend(logit_bias_problems(self.logit_bias))
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            out.append(f"min_tokens must be an integer >= 0, got {self.min_tokens}")
        elif self.max_tokens is not None and self.min_tokens > self.max_tokens:
            out.append(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        session = self.session_id
        if session is not None and (not isinstance(session, str) or len(session) > 256):
            out.append("session_id must be a string of at most 256 characters")
        if self.constraint is not None:
            out.extend(_constraint_problems(self))
        return out

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def _constraint_problems(request: GenerationRequest) -> list[str]:
    constraint = request.constraint
    if not isinstance(constraint, OutputConstraint):
        return [f"constraint must be an OutputConstraint, got {type(constraint).__name__}"]
    name = constraint.field_name
    out = constraint.problems()
    if request.ignore_eos:
        out.append(f"{name}: a constrained output ends when its grammar is complete; drop ignore_eos")
    if constraint.kind == "tool_call":
        names = [
            (t.get("function", t) if isinstance(t, Mapping) else {}).get("name") for t in request.tools or ()
        ]
        if not names:
            out.append(f"{name}: a tool call needs the request's tools; give tools")
        elif constraint.tool_name is not None and constraint.tool_name not in names:
            out.append(f"{name}: function {constraint.tool_name!r} is not one of the request's tools {names}")
    return out


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# each sampling field's valid values: (test, the rule as the error message states it)
_SAMPLING_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: _finite(v) and v >= 0, "a finite number >= 0 (0 = greedy)"),
    "top_p": (lambda v: _finite(v) and 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: _is_int(v) and v >= -1, "an integer >= -1 (0 or -1 = disabled)"),
    "min_p": (lambda v: _finite(v) and 0 <= v <= 1, "in [0, 1]"),
    "presence_penalty": (lambda v: _finite(v) and -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (lambda v: _finite(v) and -2 <= v <= 2, "in [-2, 2]"),
    "repetition_penalty": (lambda v: _finite(v) and v > 0, "> 0 (1 = off)"),
}


LOGIT_BIAS_LIMIT = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024


def logit_bias_problems(bias: Mapping[Any, Any] | None) -> list[str]:
    """What is wrong with a ``logit_bias`` mapping (the vocabulary bound is the Engine's to check)."""
    if bias is None:
        return []
    if not isinstance(bias, Mapping):
        return [f"logit_bias must map token ids to numbers, got {type(bias).__name__}"]
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        return [f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}"]
    for token, value in bias.items():
        if not _is_int(token) or token < 0:
            return [f"logit_bias keys must be token ids (integers >= 0), got {token!r}"]
        if not _finite(value) or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            return [f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}"]
    return []


def sampling_problems(values: Mapping[str, Any]) -> list[str]:
    """What is wrong with the given sampling values (names as in ``NEUTRAL_SAMPLING``); ``None`` means
    "the model's default" and is never a problem."""
    out: list[str] = []
    for name, (valid, rule) in _SAMPLING_RULES.items():
        value = values.get(name)
        if value is not None and not valid(value):
            out.append(f"{name} must be {rule}, got {value}")
    return out


def resolve_sampling(defaults: Mapping[str, Any], **given: float | int | None) -> dict[str, Any]:
    """Every sampling field (``NEUTRAL_SAMPLING``'s names), resolved the way vLLM does it: the value
    given (not ``None``), else the model's generation-config default (``defaults``, a Frontend's
    ``generation_defaults``), else the neutral value. ``do_sample: false`` in the config means greedy
    (temperature 0) unless a temperature is given, as in transformers' ``generate``."""
    unknown = sorted(set(given) - set(NEUTRAL_SAMPLING))
    if unknown:
        raise TypeError(f"resolve_sampling: unknown sampling fields {unknown}")
    out: dict[str, Any] = {}
    for name, neutral in NEUTRAL_SAMPLING.items():
        value = given.get(name)
        if value is None:
            value = defaults.get(name)
        out[name] = neutral if value is None else value
    if given.get("temperature") is None and defaults.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


# ---------------------------------------------------------------------------------------------------
# Events and results
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCallDelta:
    """Incremental tool call: the first delta of a call carries ``id`` and ``name``; later ones extend
    ``arguments`` (a JSON text fragment)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reused_prefix_tokens: int = 0  # prompt tokens served from a cached checkpoint (not recomputed)
    drafted_tokens: int = 0  # speculative decoding: draft tokens proposed for the request
    accepted_draft_tokens: int = 0  # of them, those the verify accepted and the request kept
    draft_rounds: int = 0  # verify rounds that carried drafts for the request
    # per draft position (1st, 2nd, ...): the rounds whose draft there was kept (a round keeps a prefix)
    accepted_by_position: tuple[int, ...] = ()

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class GenerationStart:
    """Published once, after admission committed its resource choice and before any delta."""

    request_id: int
    prompt_tokens: int
    reused_prefix_tokens: int


@dataclass(frozen=True)
class GenerationDelta:
    """Newly committed output. ``logprobs`` (when asked for) align with ``token_ids``."""

    request_id: int
    text: str = ""
    reasoning_text: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class GenerationResult:
    """The one terminal event of a request: aggregate output and why it ended.

    ``finish_reason == "error"`` carries ``error`` (a ``RequestRejected`` or ``EngineFailed``); the
    output fields then hold whatever had been published before the error.
    """

    request_id: int
    text: str
    reasoning_text: str
    tool_calls: tuple[ToolCallDelta, ...]
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] | None = None
    error: NInferError | None = None


GenerationEvent = GenerationStart | GenerationDelta | GenerationResult


@dataclass(frozen=True)
class ScoreResult:
    """Causal scoring of one text: ``logprobs[i]`` is log p(token i | tokens before it); the first
    token has no context, so ``logprobs[0] is None``; ``total_nll`` is minus the sum of the rest.

    Filled only when ``Engine.score`` was asked for them:
    - ``top_logprobs`` (``top_n > 0``): one entry per token, ``None`` for the first; entry ``i`` holds the
      ``top_n`` most likely tokens at token i's position ``((token_id, logprob), ...)``, best first, from
      the same window (and the same logits) as ``logprobs[i]``; ``()`` when not asked.
    - ``next_token`` (``next_token=True``): the greedy prediction after the last token, its logprob and
      its ``top_n`` alternatives (from the window that ends at the last token); ``None`` when not asked
      or the text is empty.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    total_nll: float
    top_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...] = ()
    next_token: TokenLogprob | None = None


@dataclass(frozen=True)
class Availability:
    """Engine readiness, owned by the Engine worker; gateways only read and map it."""

    state: Literal["starting", "warming", "ready", "failed", "closed"]
    reason: str | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"


# ---------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------

RejectKind = Literal[
    "context_too_long", "invalid_request", "overload", "queue_timeout", "infeasible", "wrong_purpose"
]


class NInferError(Exception):
    """Base of every error the public Engine reports."""

    kind: str = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class RequestRejected(NInferError):
    """Only this request failed; the Engine is fine. ``kind`` says which rule it broke:

    ``context_too_long`` (prompt/max_tokens beyond ``max_context``), ``invalid_request`` (cannot be
    represented, e.g. a bad sampling value), ``overload`` (queue full at submit), ``queue_timeout``
    (waited longer than ``queue_timeout_s``), ``infeasible`` (cannot fit even in an empty Engine),
    ``wrong_purpose`` (generation on a scoring Engine or the reverse).
    """

    def __init__(self, kind: RejectKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __repr__(self) -> str:
        return f"RequestRejected({self.kind!r}, {self.message!r})"


class RequestFailed(NInferError):
    """Only this request failed while it ran: forming its output raised (e.g. a bug in the package's
    tool-call parser). Its resources were released; the Engine serves the other requests on."""

    kind = "output_error"

    def __repr__(self) -> str:
        return f"RequestFailed({self.message!r})"


class EngineFailed(NInferError):
    """The Engine failed as a whole (its shared state could no longer be trusted); it serves no more."""

    kind = "engine_failed"

    def __repr__(self) -> str:
        return f"EngineFailed({self.message!r})"
