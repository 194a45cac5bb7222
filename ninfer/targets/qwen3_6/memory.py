"""The generation Program's memory plan: how much of the device its state takes, and which context limit.

Pure arithmetic over the package's dims, the `EngineConfig` and two measured numbers (free and total device
memory after the weights are placed), so CPU tests check the CUDA sizing with the real packages' dims
(docs/resources-and-context-cache.md, "Sizing"). `build_program` measures, calls `plan_memory` and
builds the Program from the plan on every device.

CUDA: NInfer may hold ``gpu_memory_fraction`` of the device's TOTAL memory, weights included (vLLM's
``--gpu-memory-utilization``). What is held already when the Program is sized (the weights, the CUDA
context, anything else on the device) comes off first, then the working space (`working_space`:
activations of one prefill unit, the sampler and the decode graphs' pool, the vision workspace, and with
the reference ops on CUDA their attention's gathered K/V and scores at the longest context), then the
lanes' state slots and the checkpoints' state slots; the rest is the shared KV page pool. Active requests
and checkpoints take pages from the same pool (an inactive checkpoint is evicted when a request needs its
pages), and ``max_concurrency`` does not split it: a request reserves its complete growth and waits
(Blocked) while the pool is held by others. ``max_context`` defaults to the model's positions when one
request of that length fits in the pool, else to the largest that fits (whole pages). The pool holds at
most ``MAX_POOL_CONTEXTS`` requests at ``max_context`` (a bound only small models reach).

CPU: the pool is ``max_context x max_concurrency`` pages plus the context cache's share (at most 1 GiB),
``max_context`` defaults to ``min(model, 32768)``: small, fast to allocate, and what the CPU tests use.

Host tier (both devices, `host_tier`): ``host_cache_gb`` of host memory (pinned on CUDA) for checkpoints
offloaded from the device, a quarter state slots (at most one per page), the rest KV pages; 0: none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ninfer.targets.open import prefill_unit, resolve_kernels
from ninfer.targets.qwen3_6.impl.runtime.prefill_graphs import capacities
from ninfer.targets.qwen3_6.kernels import fla_available
from ninfer.targets.qwen3_6.model import StateStore
from ninfer.targets.qwen3_6.variant import Variant, VisionDims
from ninfer.types import EngineConfig

GIB = 2**30
# Without an explicit max_context a CPU Program holds this many positions per request (its pool is
# max_context x max_concurrency pages; the model itself allows variant.max_position_embeddings). The
# reference op table on CUDA defaults to it too: its decode attention gathers a row's whole block table
# every step (a static shape), so a 262,144-position table makes each step read the whole pool's width.
CPU_DEFAULT_MAX_CONTEXT = 32768
# the most checkpoint state slots sized by default (each holds every GDN layer's recurrent state)
MAX_CHECKPOINT_SLOTS = 64
# CUDA: the default checkpoint state slots' share of the memory left for state after the working space and
# the lanes' slots (the KV pool takes the rest)
CHECKPOINT_SLOT_SHARE = 0.1
# CPU: the context cache's default budget, four times the lanes' state, at most this
CPU_CACHE_LIMIT = GIB
# the host tier's share of its budget that becomes state slots (the rest KV pages), like the CPU cache's
HOST_SLOT_SHARE = 0.25
# a default max_context shorter than min(this, the model's positions) is refused instead of taken
MIN_DEFAULT_CONTEXT = 4096
# CUDA: the pool holds at most this many requests at max_context (binds only for small models, whose pool
# would otherwise take the whole device: millions of pages, each free-list update and the zeroing slower)
MAX_POOL_CONTEXTS = 64
# working space: activations, sampling and graph pools per 2048 tokens of a prefill unit
UNIT_WORKING_BYTES = 2 * GIB
# the vision tower's working memory per image token (4 patches, about 32 KiB each at its widest layer)
VISION_BYTES_PER_IMAGE_TOKEN = 4 * 32 * 2**10
# the reference attention's fp32 score tensors alive at once ([heads, queries, keys]: scores, masked, probs)
REFERENCE_SCORE_COPIES = 3


class BackendShape(Protocol):
    """What the sizing needs of a decode backend (`DecodeBackend` has these)."""

    @property
    def slots_per_sequence(self) -> int: ...
    @property
    def extra_tokens(self) -> int: ...
    @property
    def kv_layers(self) -> int: ...

    @property
    def kv_head_shape(self) -> tuple[int, int] | None: ...


@dataclass(frozen=True)
class MemoryPlan:
    """How the Program's memory is divided (all sizes in bytes)."""

    device: str  # "cuda": sized from the device memory; "cpu": from max_context x max_concurrency
    max_context: int  # longest prompt + generated tokens of one request
    # "model" (its positions fit), "fits" (the largest that fits), "given", "default" (CPU), "reference"
    # (CUDA with the reference op table: CPU_DEFAULT_MAX_CONTEXT)
    context_from: str
    page_size: int
    kv_pages: int  # the shared KV pool (lanes and checkpoints), every attention layer's (and the drafter's)
    page_bytes: int  # one page id in every attention layer, the decode backend's included
    lane_slots: int  # state slots of the active sequences (max_concurrency x slots per sequence)
    checkpoint_slots: int  # state slots for published checkpoints
    slot_bytes: int  # one state slot: every GDN layer's conv window and fp32 recurrent state
    working_bytes: int  # left free for activations, graph pools, the vision and attention workspaces
    max_concurrency: int = 1
    extra_tokens: int = 0  # positions a speculative verify writes past a request's last token
    total_bytes: int = 0  # CUDA: the device's memory
    held_bytes: int = 0  # CUDA: held before the Program is built: weights, CUDA context, other processes
    gpu_memory_fraction: float | None = None  # CUDA: the share of total_bytes NInfer may hold
    capped: bool = False  # CUDA: the pool was held to MAX_POOL_CONTEXTS requests at max_context
    host_slots: int = 0  # state slots of the host tier for offloaded checkpoints (0: no host tier)
    host_pages: int = 0  # KV pages of the host tier

    @property
    def host_bytes(self) -> int:
        """Host memory the host tier takes (pinned on CUDA)."""
        return self.host_slots * self.slot_bytes + self.host_pages * self.page_bytes

    @property
    def kv_pool_tokens(self) -> int:
        return self.kv_pages * self.page_size

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv_pages * self.page_bytes

    @property
    def slots_bytes(self) -> int:
        return (self.lane_slots + self.checkpoint_slots) * self.slot_bytes

    @property
    def allowed_bytes(self) -> int:
        """CUDA: what NInfer may hold in all (``gpu_memory_fraction`` of the total)."""
        return int((self.gpu_memory_fraction or 0.0) * self.total_bytes)

    @property
    def requests_at_max_context(self) -> int:
        """How many requests of ``max_context`` positions the pool holds at once."""
        return self.kv_pages // pages_for(self.max_context + self.extra_tokens, self.page_size)

    def describe(self) -> str:
        """One line: the pool, the context limit and where the memory went."""
        g = GIB
        head = (
            f"KV pool {self.kv_pool_tokens:,} tokens ({self.kv_pool_bytes / g:.1f} GiB), shared by up to "
            f"{self.max_concurrency} request{'s' * (self.max_concurrency != 1)} and the context cache; "
            f"max_context {self.max_context:,} "
        )
        reason = {
            "model": "(the model's positions)",
            "fits": "(the most one request can hold in this pool; the model allows more)",
            "given": "(given)",
            "default": "(the CPU default)",
            "reference": "(the reference op table's default; --max-context raises it)",
        }[self.context_from]
        slots = (
            f"{self.lane_slots} lane + {self.checkpoint_slots} checkpoint state slots "
            f"({self.slots_bytes / g:.1f} GiB)"
        )
        host = (
            f"; host tier {self.host_slots} checkpoint state slots + {self.host_pages * self.page_size:,} "
            f"tokens ({self.host_bytes / g:.1f} GiB{' pinned' * (self.device == 'cuda')})"
            if self.host_slots
            else ""
        )
        if self.device != "cuda":
            return f"{head}{reason}; {slots}; pool sized from max_context x max_concurrency (CPU){host}"
        cap = f"; the pool is capped at {MAX_POOL_CONTEXTS} requests at max_context" if self.capped else ""
        return (
            f"{head}{reason}; of {self.total_bytes / g:.1f} GiB x gpu_memory_fraction "
            f"{self.gpu_memory_fraction:.2f} = {self.allowed_bytes / g:.1f} GiB: weights and others "
            f"{self.held_bytes / g:.1f}, working space {self.working_bytes / g:.1f}, {slots}{cap}{host}"
        )


def vision_graph_bytes(
    dims: VisionDims | None, grids: Sequence[tuple[int, int, int]], dtype: torch.dtype
) -> int:
    """What the vision tower's graphs (`impl/runtime/vision_graphs.py`) hold for good: their memory pool, one
    working set of the largest grid (the eager tower's, `VISION_BYTES_PER_IMAGE_TOKEN` an image token),
    and their static input and output of that grid, in the weights' dtype."""
    if dims is None or not grids:
        return 0
    size = torch.empty((), dtype=dtype).element_size()
    merge = dims.spatial_merge_size**2
    largest = max(t * h * w for t, h, w in grids)  # patches
    width = dims.in_channels * dims.temporal_patch_size * dims.patch_size**2
    tokens = largest // merge
    statics = largest * width * size + tokens * dims.out_hidden_size * size
    return tokens * VISION_BYTES_PER_IMAGE_TOKEN + statics


def working_space(config: EngineConfig, device: torch.device, max_image_tokens: int) -> int:
    """Bytes to leave free beside the state whatever the context: activations (they grow with the prefill
    unit), sampling and graph pools, 2 GiB per 2048-token unit, as much again per 2048 tokens of the
    largest prefill graph (its pool); the vision tower's, about 32 KiB per patch
    (4 patches per image token) at its widest layer."""
    chunk = prefill_unit(config.prefill_chunk_tokens, device, config.kernels)
    fast_graphs = config.cuda_graphs and resolve_kernels(device, config.kernels) == "fast" and fla_available()
    largest = max(capacities(config.prefill_graph_tokens, config.prefill_graph_tokens), default=0)
    prefill_graphs = UNIT_WORKING_BYTES * largest // 2048 if fast_graphs else 0
    return (
        UNIT_WORKING_BYTES * max(1, -(-chunk // 2048)) + prefill_graphs
        + max_image_tokens * VISION_BYTES_PER_IMAGE_TOKEN
    )  # fmt: skip


def attention_workspace(
    variant: Variant, config: EngineConfig, device: torch.device, dtype: torch.dtype, context: int,
    max_concurrency: int,
) -> int:  # fmt: skip
    """Bytes the attention of one layer holds at ``context`` positions beyond the prefill unit's
    activations. Fast ops: none (the prefill and decode kernels read the pages in place; the decode's
    split partials are a few KiB a row). Reference ops: a row's K and V gathered and repeated to every
    query head in fp32 and the [heads, unit, context] fp32 scores, or the decode's gather of every row's
    whole table, whichever is larger."""
    if resolve_kernels(device, config.kernels) == "fast":
        return 0
    elem = torch.empty((), dtype=dtype).element_size()
    heads, kv_heads, dim = variant.num_attention_heads, variant.num_kv_heads, variant.head_dim
    chunk = prefill_unit(config.prefill_chunk_tokens, device, config.kernels)
    scores = REFERENCE_SCORE_COPIES * heads * 4  # fp32 score bytes per (query, key) pair, all heads
    prefill = scores * chunk * context + 2 * context * (kv_heads + heads) * dim * 4
    decode = max_concurrency * context * (2 * kv_heads * dim * (elem + 4) + scores)
    return max(prefill, decode)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def default_ceiling(positions: int, config: EngineConfig, device: torch.device) -> int:
    """The longest default ``max_context`` on CUDA: the model's positions with the fast op table, at
    most ``CPU_DEFAULT_MAX_CONTEXT`` with the reference one (see there)."""
    if resolve_kernels(device, config.kernels) == "fast":
        return positions
    return min(positions, CPU_DEFAULT_MAX_CONTEXT)


def host_tier(config: EngineConfig, slot_bytes: int, page_bytes: int) -> tuple[int, int]:
    """(state slots, KV pages) of the host tier: ``host_cache_gb`` split a quarter to slots, the rest to
    pages, at most one slot per page (a checkpoint holds at least one); (0, 0) without the context cache
    or when the budget holds less than one slot and one page."""
    if not config.prefix_cache or config.host_cache_gb <= 0:
        return 0, 0
    budget = int(config.host_cache_gb * GIB)
    if budget < slot_bytes + page_bytes:
        return 0, 0
    slots = max(1, int(budget * HOST_SLOT_SHARE) // slot_bytes)
    pages = (budget - slots * slot_bytes) // page_bytes
    while pages < slots:  # a slot whose checkpoint could hold no page is better spent on pages
        slots -= 1
        pages = (budget - slots * slot_bytes) // page_bytes
    return slots, pages


def plan_memory(
    variant: Variant,
    config: EngineConfig,
    backend: BackendShape,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_context: int | None = None,
    free_bytes: int = 0,
    total_bytes: int = 0,
    vision_graph_grids: Sequence[tuple[int, int, int]] = (),
) -> MemoryPlan:
    """The memory plan of a generation Program (module docstring). ``max_context`` overrides
    ``config.max_context`` (None: the default); ``free_bytes`` / ``total_bytes`` are the device's free and
    total memory measured after the weights were placed (CUDA only); ``vision_graph_grids``: the image
    grids whose vision tower the Program captures (their pool and buffers are working space). Raises
    ``ValueError`` with the numbers and the flags to change when the state cannot fit."""
    given = max_context if max_context is not None else config.max_context
    positions = variant.max_position_embeddings
    if given is not None and given > positions:
        raise ValueError(f"max_context {given} exceeds the model's {positions} positions")
    page = config.page_size
    slot_bytes = StateStore.slot_bytes(variant, dtype)
    page_bytes = StateStore.page_bytes(variant, page, dtype, backend.kv_layers, backend.kv_head_shape)
    n = config.max_concurrency
    lane_slots = backend.slots_per_sequence * n
    image_tokens = config.max_image_tokens if variant.vision is not None else 0
    working = working_space(config, device, image_tokens) + vision_graph_bytes(
        variant.vision, vision_graph_grids, dtype
    )
    host_slots, host_pages = host_tier(config, slot_bytes, page_bytes)
    common = dict(
        page_size=page, page_bytes=page_bytes, lane_slots=lane_slots, slot_bytes=slot_bytes,
        max_concurrency=n, extra_tokens=backend.extra_tokens, host_slots=host_slots, host_pages=host_pages,
    )  # fmt: skip

    def need(context: int) -> int:  # pages of one request at ``context`` positions (a verify's extra too)
        return pages_for(context + backend.extra_tokens, page)

    if device.type != "cuda":
        context = given or min(positions, CPU_DEFAULT_MAX_CONTEXT)
        lane_pages = need(context) * n
        cache_slots = cache_pages = 0
        if config.prefix_cache:
            if config.cache_memory_gb is not None:
                budget = int(config.cache_memory_gb * GIB)
            else:
                budget = min(CPU_CACHE_LIMIT, 4 * (lane_slots * slot_bytes + lane_pages * page_bytes))
            cache_slots = min(MAX_CHECKPOINT_SLOTS, budget // 4 // slot_bytes)
            cache_pages = max(0, (budget - cache_slots * slot_bytes) // page_bytes)
        return MemoryPlan(
            device=device.type, max_context=context, context_from="given" if given else "default",
            kv_pages=lane_pages + cache_pages, checkpoint_slots=cache_slots, working_bytes=0, **common,
        )  # fmt: skip

    fraction = config.gpu_memory_fraction
    allowed = int(fraction * total_bytes)
    held = total_bytes - free_bytes
    flags = (
        f"raise --gpu-memory-fraction (now {fraction:g}) or lower --max-concurrency, --cache-memory-gb, "
        "--max-image-tokens or the prefill unit (EngineConfig.prefill_chunk_tokens)"
    )
    # for checkpoint slots, the KV pool and the attention workspace
    room = allowed - held - working - lane_slots * slot_bytes
    if room <= 0:
        raise ValueError(
            f"no room for the KV pool: NInfer may hold {allowed / GIB:.1f} GiB ({fraction:g} of "
            f"{total_bytes / GIB:.1f} GiB); the weights and others hold {held / GIB:.1f} GiB, the working "
            f"space takes {working / GIB:.1f} GiB and {lane_slots} lane state slots "
            f"{lane_slots * slot_bytes / GIB:.1f} GiB; {flags}"
        )
    if not config.prefix_cache:
        checkpoint_slots = 0
    elif config.cache_memory_gb is not None:
        checkpoint_slots = int(config.cache_memory_gb * GIB) // slot_bytes
    else:
        checkpoint_slots = min(MAX_CHECKPOINT_SLOTS, int(CHECKPOINT_SLOT_SHARE * room) // slot_bytes)
    room -= checkpoint_slots * slot_bytes

    def pool(context: int) -> int:  # pages left for the pool when the attention works at ``context``
        return max(0, (room - attention_workspace(variant, config, device, dtype, context, n)) // page_bytes)

    def fits(context: int) -> bool:
        return need(context) <= pool(context)

    if given is not None:
        context, source = given, "given"
        if not fits(context):
            have, attention = pool(given), attention_workspace(variant, config, device, dtype, given, n)
            raise ValueError(
                f"max_context {given} needs {need(given)} KV pages ({need(given) * page_bytes / GIB:.1f} "
                f"GiB) but the pool holds {have} pages ({have * page_bytes / GIB:.1f} GiB) after the weights "
                f"and others ({held / GIB:.1f} GiB), the working space ({(working + attention) / GIB:.1f} "
                f"GiB) and {lane_slots + checkpoint_slots} state slots, within {fraction:g} of "
                f"{total_bytes / GIB:.1f} GiB; lower --max-context or {flags}"
            )
    elif fits(ceiling := default_ceiling(positions, config, device)):
        context, source = ceiling, "model" if ceiling == positions else "reference"
    else:
        lo, hi = 0, ceiling // page  # the largest whole number of pages that fits (fits() is monotone)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid * page) else (lo, mid - 1)
        context, source = lo * page, "fits"
        least = min(positions, MIN_DEFAULT_CONTEXT)
        if context < least:
            raise ValueError(
                f"the KV pool would hold {pool(least)} pages ({pool(least) * page} positions), less than one "
                f"request of {least} positions needs ({need(least)} pages); NInfer may hold "
                f"{allowed / GIB:.1f} GiB ({fraction:g} of {total_bytes / GIB:.1f} GiB), the weights and "
                f"others hold {held / GIB:.1f} GiB, the working space takes {working / GIB:.1f} GiB; {flags}"
            )
    pages = min(pool(context), MAX_POOL_CONTEXTS * need(context))
    return MemoryPlan(
        device="cuda", max_context=context, context_from=source, kv_pages=pages,
        checkpoint_slots=checkpoint_slots, working_bytes=working + attention_workspace(
            variant, config, device, dtype, context, n
        ), total_bytes=total_bytes, held_bytes=held, gpu_memory_fraction=fraction,
        capped=pages < pool(context), **common,
    )  # fmt: skip
