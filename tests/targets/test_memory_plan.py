"""The generation Program's memory plan (`ninfer.targets.qwen3_6.memory.plan_memory`) is pure arithmetic,
so the CUDA sizing is checked here on CPU with the real packages' dims at several device sizes.

The expected numbers are computed from the dims in this file (bytes per KV position of the attention
layers, a GDN state slot's bytes, the working space's rule), not by calling the sizing twice:
1. the per-token and per-slot bytes of Qwen3.6-27B and -35B-A3B, pinned to literal values;
2. on an H200 (141 GB) both packages hold the model's 262,144 positions and the pool fills the memory
   NInfer may hold (``gpu_memory_fraction`` of the total, weights included); on an H100 (80 GB) the 27B's
   context is the largest that fits, in whole pages; the 35B-A3B does not fit an H100 at 0.9 nor a 48 GB
   card, and the refusal names the numbers and the flags;
3. an explicit max_context beyond the pool (or the model) is refused with the numbers; the checkpoint
   slots follow ``prefix_cache`` / ``cache_memory_gb``;
4. on CPU the plan is today's: max_context x max_concurrency pages plus the cache's share;
5. a small model's CUDA pool is capped at 64 requests at max_context;
6. build_program on (a faked) CUDA hands the measured plan to the Program and logs it.
"""

from __future__ import annotations

import math

import pytest
import torch

from ninfer.targets.qwen3_6.memory import MemoryPlan, plan_memory
from ninfer.targets.qwen3_6.open import decode_backend
from ninfer.targets.qwen3_6.variant import Variant
from ninfer.targets.qwen3_6.weights import weight_schema
from ninfer.targets.registry import PACKAGES
from ninfer.types import EngineConfig

GIB = 2**30
MIB = 2**20
CUDA = torch.device("cuda")  # only a name here: the plan touches no device
CPU = torch.device("cpu")
BF16 = 2
# device memory as the driver reports it (nvidia-smi, MiB)
H100_80GB = 81559 * MIB
H200_141GB = 143771 * MIB
CARD_48GB = 46068 * MIB
CUDA_CONTEXT = 600 * MIB  # held besides the weights before the Program is sized
POSITIONS = 262144
PAGE = 64


def kv_bytes_per_token(v: Variant, extra_layers: int = 0, elem: int = BF16) -> int:
    """K and V of one position in every full-attention layer (and a drafter's)."""
    attention_layers = sum(1 for kind in v.layer_types if kind == "full_attention") + extra_layers
    return 2 * attention_layers * v.num_kv_heads * v.head_dim * elem


def gdn_slot_bytes(v: Variant, elem: int = BF16) -> int:
    """One state slot: every linear-attention layer's conv window (compute dtype) and fp32 recurrent
    state."""
    gdn_layers = sum(1 for kind in v.layer_types if kind == "linear_attention")
    conv = v.conv_dim * (v.linear_conv_kernel_dim - 1) * elem
    recurrent = v.linear_num_value_heads * v.linear_key_head_dim * v.linear_value_head_dim * 4
    return gdn_layers * (conv + recurrent)


def weight_bytes(v: Variant, drafter: str | None) -> int:
    """The weights a Program holds on the device (``drafter``: the group of the speculative one)."""
    groups = {"text", "vision"} | ({drafter} if drafter else set())
    return sum(
        math.prod(s.shape) * (4 if s.keep_fp32 else BF16) for s in weight_schema(v) if s.group in groups
    )


def cuda_plan(name: str, total: int, fraction: float = 0.9, **config: object) -> MemoryPlan:
    package = PACKAGES[name]  # with its drafter where dflash:K drafts (an artifact converted with one)
    v = (package.with_drafter() if str(config.get("speculative")).startswith("dflash:") else package).variant
    engine = EngineConfig(gpu_memory_fraction=fraction, **config)  # type: ignore[arg-type]
    backend = decode_backend(engine, True, v)  # CUDA: the decode lookahead is on
    spec = engine.speculative
    held = weight_bytes(v, spec and spec.partition(":")[0]) + CUDA_CONTEXT
    return plan_memory(
        v, engine, backend, device=CUDA, dtype=torch.bfloat16, free_bytes=total - held, total_bytes=total
    )


def expected(name: str, total: int, max_concurrency: int = 4, fraction: float = 0.9) -> dict[str, int]:
    """The plan by hand for plain decoding (3 slots per lane: current, spare, lookahead's), the default
    8192-token prefill unit and 16,384 image tokens."""
    v = PACKAGES[name].variant
    slot, page_bytes = gdn_slot_bytes(v), kv_bytes_per_token(v) * PAGE
    working = 2 * GIB * (8192 // 2048) + 16384 * 4 * 32 * 1024  # activations + vision workspace
    held = weight_bytes(v, None) + CUDA_CONTEXT
    room = int(fraction * total) - held - working - 3 * max_concurrency * slot
    checkpoint_slots = min(64, int(0.1 * room) // slot)
    room -= checkpoint_slots * slot
    pages = room // page_bytes  # the fast ops' attention reads the pages in place: no workspace per position
    context = POSITIONS if pages >= POSITIONS // PAGE else pages * PAGE
    return {"kv_pages": pages, "max_context": context, "checkpoint_slots": checkpoint_slots}


def test_per_token_and_per_slot_bytes_of_the_real_packages() -> None:
    v27, v35 = PACKAGES["qwen3_6_27b"].variant, PACKAGES["qwen3_6_35b_a3b"].variant
    assert kv_bytes_per_token(v27) == 64 * 1024  # 16 attention layers x 4 kv heads x 256 x K,V x bf16
    assert kv_bytes_per_token(v27, 1) == 68 * 1024  # + the MTP layer's KV in the same pages
    assert kv_bytes_per_token(v35) == 20 * 1024  # 10 x 2 x 256 x 2 x 2
    assert gdn_slot_bytes(v27) == 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4) == 153_944_064
    assert gdn_slot_bytes(v35) == 30 * (8192 * 3 * 2 + 32 * 128 * 128 * 4) == 64_389_120
    for v, mtp in ((v27, 0), (v27, 1), (v35, 0), (v35, 1)):
        plan = cuda_plan("qwen3_6_27b" if v is v27 else "qwen3_6_35b_a3b", H200_141GB,
                         speculative="mtp:2" if mtp else None)  # fmt: skip
        assert plan.page_bytes == kv_bytes_per_token(v, mtp) * PAGE
        assert plan.slot_bytes == gdn_slot_bytes(v)


@pytest.mark.parametrize("name", ["qwen3_6_27b", "qwen3_6_35b_a3b"])
@pytest.mark.parametrize("max_concurrency", [1, 4, 8])
def test_h200_holds_the_models_context_and_fills_the_allowed_memory(name: str, max_concurrency: int) -> None:
    plan = cuda_plan(name, H200_141GB, max_concurrency=max_concurrency)
    want = expected(name, H200_141GB, max_concurrency)
    assert (plan.kv_pages, plan.max_context, plan.checkpoint_slots) == (
        want["kv_pages"], want["max_context"], want["checkpoint_slots"],
    )  # fmt: skip
    assert plan.max_context == POSITIONS and plan.context_from == "model"
    assert plan.requests_at_max_context >= 2  # several full-context requests at once
    used = plan.held_bytes + plan.working_bytes + plan.slots_bytes + plan.kv_pool_bytes
    assert plan.allowed_bytes - plan.page_bytes < used <= plan.allowed_bytes  # all of it, never more
    assert "262,144 (the model's positions)" in plan.describe()


def test_h200_and_h100_numbers() -> None:
    """The figures the docs quote (max_concurrency 4, plain decoding)."""
    p27 = cuda_plan("qwen3_6_27b", H200_141GB)
    assert 900_000 < p27.kv_pool_tokens < 960_000 and 54 * GIB < p27.kv_pool_bytes < 59 * GIB
    assert p27.requests_at_max_context == 3
    p35 = cuda_plan("qwen3_6_35b_a3b", H200_141GB)
    assert 2_350_000 < p35.kv_pool_tokens < 2_450_000 and p35.requests_at_max_context == 9
    h100 = cuda_plan("qwen3_6_27b", H100_80GB)
    want = expected("qwen3_6_27b", H100_80GB)
    assert (h100.kv_pages, h100.max_context) == (want["kv_pages"], want["max_context"])
    assert h100.context_from == "fits" and 110_000 < h100.max_context < 140_000
    assert h100.max_context % PAGE == 0 and h100.kv_pages >= h100.max_context // PAGE
    assert "the model allows more" in h100.describe()


def test_a_larger_context_than_fits_on_the_h100_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError) as info:
        cuda_plan("qwen3_6_27b", H100_80GB, max_context=POSITIONS)
    message = str(info.value)
    assert "max_context 262144 needs 4096 KV pages (16.0 GiB)" in message
    assert "lower --max-context or raise --gpu-memory-fraction (now 0.9)" in message
    fits = cuda_plan("qwen3_6_27b", H100_80GB).max_context
    assert cuda_plan("qwen3_6_27b", H100_80GB, max_context=fits).max_context == fits
    with pytest.raises(ValueError, match="exceeds the model's 262144 positions"):
        cuda_plan("qwen3_6_27b", H200_141GB, max_context=POSITIONS + 1)


@pytest.mark.parametrize(
    ("name", "total", "fraction"),
    [
        ("qwen3_6_35b_a3b", H100_80GB, 0.9),
        ("qwen3_6_35b_a3b", CARD_48GB, 0.9),
        ("qwen3_6_27b", CARD_48GB, 1.0),
    ],
)
def test_no_room_for_the_pool_is_refused_naming_the_flags(name: str, total: int, fraction: float) -> None:
    with pytest.raises(ValueError) as info:
        cuda_plan(name, total, fraction)
    message = str(info.value)
    assert message.startswith("no room for the KV pool: NInfer may hold ")
    assert f"{fraction * total / GIB:.1f} GiB ({fraction:g} of {total / GIB:.1f} GiB)" in message
    held = (weight_bytes(PACKAGES[name].variant, False) + CUDA_CONTEXT) / GIB
    assert f"the weights and others hold {held:.1f} GiB" in message
    assert "raise --gpu-memory-fraction" in message and "--max-image-tokens" in message


def test_a_higher_fraction_and_fewer_image_tokens_fit_the_35b_on_an_h100() -> None:
    plan = cuda_plan("qwen3_6_35b_a3b", H100_80GB, 0.95, max_image_tokens=4096, max_concurrency=1)
    assert plan.context_from in ("model", "fits") and plan.max_context >= 4096
    assert plan.held_bytes + plan.working_bytes + plan.slots_bytes + plan.kv_pool_bytes <= plan.allowed_bytes


def test_checkpoint_slots_follow_the_cache_settings() -> None:
    slot = gdn_slot_bytes(PACKAGES["qwen3_6_27b"].variant)
    assert cuda_plan("qwen3_6_27b", H200_141GB, prefix_cache=False).checkpoint_slots == 0
    assert cuda_plan("qwen3_6_27b", H200_141GB, cache_memory_gb=3.0).checkpoint_slots == 3 * GIB // slot
    assert cuda_plan("qwen3_6_35b_a3b", H200_141GB).checkpoint_slots == 64  # the default's cap
    # the checkpoint slots' bytes go to the pool when the cache is off
    off, on = cuda_plan("qwen3_6_27b", H200_141GB, prefix_cache=False), cuda_plan("qwen3_6_27b", H200_141GB)
    freed = on.checkpoint_slots * slot // on.page_bytes
    assert off.kv_pages - on.kv_pages in (freed, freed + 1)


def test_mtp_reserves_its_extra_positions_and_its_layer() -> None:
    plan = cuda_plan("qwen3_6_27b", H100_80GB, speculative="mtp:3")
    assert plan.extra_tokens == 6 and plan.lane_slots == 4 * 5  # 2K positions; current + K + 1 states
    assert -(-(plan.max_context + 6) // PAGE) <= plan.kv_pages


def test_dflash_reserves_its_block_its_states_and_its_layers() -> None:
    """dflash:15 on the 27B: a verify of 16 positions (17 state slots a lane), the block after a round
    that ends at the last allowed token (2K + 1 positions), and the drafter's five layers of 8 x 128 KV
    heads in the same pages; on an H200 four lanes still hold the model's whole context."""
    plan = cuda_plan("qwen3_6_27b", H200_141GB, speculative="dflash:15")
    assert plan.extra_tokens == 31 and plan.lane_slots == 4 * 17
    assert (
        plan.page_bytes
        == (kv_bytes_per_token(PACKAGES["qwen3_6_27b"].variant) + 5 * 2 * 8 * 128 * BF16) * PAGE
    )
    assert plan.max_context == POSITIONS
    # the drafter's weights: 1.73 B parameters, 3.46 GB in bf16 (the published drafter's size)
    full = PACKAGES["qwen3_6_27b"].with_drafter().variant
    assert weight_bytes(full, "dflash") - weight_bytes(full, None) == 2 * (
        5 * (2 * 5120 * 4096 + 2 * 5120 * 1024 + 3 * 5120 * 17408 + 2 * 5120 + 2 * 128)
        + 5120 * 25600
        + 2 * 5120
    )


def test_the_reference_ops_on_cuda_size_for_their_fp32_scores() -> None:
    """The reference attention holds [heads, unit, context] fp32 scores, and its decode attention reads a
    row's whole block table: its default context is at most 32,768, and what fits beside the scores."""
    plan = cuda_plan("qwen3_6_27b", H200_141GB, kernels="reference")
    assert (plan.context_from, plan.max_context) == ("reference", 32768)
    assert "reference op table" in plan.describe()
    heads = PACKAGES["qwen3_6_27b"].variant.num_attention_heads
    assert plan.working_bytes > 3 * heads * 2048 * plan.max_context * 4
    small = cuda_plan("qwen3_6_27b", H100_80GB, kernels="reference")
    assert small.context_from == "fits" and small.max_context < 32768


@pytest.mark.parametrize("name", ["qwen3_6_tiny", "qwen3_6_27b"])
def test_cpu_plan_is_max_context_times_lanes_plus_the_cache_share(name: str) -> None:
    v = PACKAGES[name].variant
    config = EngineConfig(max_concurrency=4, device="cpu")
    plan = plan_memory(v, config, decode_backend(config, False, v), device=CPU, dtype=torch.float32)
    context = min(v.max_position_embeddings, 32768)
    slot, page_bytes = gdn_slot_bytes(v, 4), kv_bytes_per_token(v, elem=4) * PAGE  # fp32 on CPU
    lane_pages = context // PAGE * 4
    budget = min(GIB, 4 * (2 * 4 * slot + lane_pages * page_bytes))  # 2 slots per lane: no lookahead
    cache_slots = min(64, budget // 4 // slot)
    assert (plan.max_context, plan.context_from, plan.checkpoint_slots, plan.lane_slots) == (
        context, "default", cache_slots, 8,
    )  # fmt: skip
    assert plan.kv_pages == lane_pages + (budget - cache_slots * slot) // page_bytes
    assert plan.gpu_memory_fraction is None and "(CPU)" in plan.describe()
    given = plan_memory(v, EngineConfig(max_context=1024, prefix_cache=False, device="cpu"),
                        decode_backend(config, False, v), device=CPU, dtype=torch.float32)  # fmt: skip
    assert (given.kv_pages, given.checkpoint_slots, given.context_from) == (1024 // PAGE * 4, 0, "given")


def test_a_small_models_pool_is_capped_at_64_requests_at_max_context() -> None:
    """The tiny packages (the GPU tests' models) would otherwise fill an H200 with millions of pages."""
    v = PACKAGES["qwen3_6_tiny"].variant
    config = EngineConfig()
    plan = plan_memory(v, config, decode_backend(config, True, v), device=CUDA, dtype=torch.bfloat16,
                       free_bytes=H200_141GB - CUDA_CONTEXT, total_bytes=H200_141GB)  # fmt: skip
    assert plan.max_context == v.max_position_embeddings == 16384 and plan.context_from == "model"
    assert plan.capped and plan.kv_pages == 64 * (16384 // PAGE) and plan.requests_at_max_context == 64
    assert "capped at 64 requests at max_context" in plan.describe()
    assert not cuda_plan("qwen3_6_35b_a3b", H200_141GB).capped


def test_build_program_on_cuda_sizes_the_program_from_the_measured_memory(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The CUDA wiring with the device faked: build_program measures, plans and hands the plan's pool,
    context and checkpoint slots to the Program (and logs the plan, a warning when the context is
    shorter than the model's)."""
    import ninfer.targets.qwen3_6.impl.runtime.program as program_module
    import ninfer.targets.qwen3_6.open as family

    v = PACKAGES["qwen3_6_27b"].variant
    held = weight_bytes(v, None) + CUDA_CONTEXT
    built: list[object] = []
    monkeypatch.setattr(family, "device_memory", lambda device: (H100_80GB - held, H100_80GB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (9 * GIB, H100_80GB))
    monkeypatch.setattr(
        program_module, "Qwen36Program", lambda variant, view, config, backend: built.append(config)
    )
    config = EngineConfig(device="cuda")
    with caplog.at_level("INFO", logger="ninfer.engine"):
        family.build_program(v, None, config, None, CUDA, torch.bfloat16)  # type: ignore[arg-type]
    (program_config,) = built
    plan = cuda_plan("qwen3_6_27b", H100_80GB)
    assert program_config.memory == plan  # type: ignore[attr-defined]
    got = program_config.kv_pages, program_config.max_context, program_config.checkpoint_slots  # type: ignore[attr-defined]
    assert got == (plan.kv_pages, plan.max_context, plan.checkpoint_slots)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "the model allows more" in warnings[0].getMessage()
    assert any("9.0 GiB free on the device" in r.getMessage() for r in caplog.records)


def test_the_host_tier_takes_host_cache_gb_a_quarter_slots_the_rest_pages() -> None:
    """``host_cache_gb`` is host memory: the device plan is the same with it or without, the tier gets a
    quarter of it in state slots (each a whole GDN state: 147 MiB on the 27B) and the rest in pages, and
    nothing without the context cache."""
    v = PACKAGES["qwen3_6_27b"].variant
    slot, page_bytes = gdn_slot_bytes(v), kv_bytes_per_token(v) * PAGE
    without = cuda_plan("qwen3_6_27b", H200_141GB)
    plan = cuda_plan("qwen3_6_27b", H200_141GB, host_cache_gb=64)
    assert (plan.kv_pages, plan.checkpoint_slots, plan.max_context) == (
        without.kv_pages, without.checkpoint_slots, without.max_context,
    )  # fmt: skip
    slots = 16 * GIB // slot
    assert (plan.host_slots, plan.host_pages) == (slots, (64 * GIB - slots * slot) // page_bytes)
    assert plan.host_bytes <= 64 * GIB and "host tier" in plan.describe() and "pinned" in plan.describe()
    assert (without.host_slots, without.host_pages) == (0, 0) and "host tier" not in without.describe()
    off = cuda_plan("qwen3_6_27b", H200_141GB, host_cache_gb=64, prefix_cache=False)
    assert (off.host_slots, off.host_pages) == (0, 0)
    # a budget too small for one slot and one page is no tier; one that holds few pages trades slots
    assert cuda_plan("qwen3_6_27b", H200_141GB, host_cache_gb=0.1).host_slots == 0
    small = cuda_plan("qwen3_6_27b", H200_141GB, host_cache_gb=(slot + 3 * page_bytes) / GIB)
    assert (small.host_slots, small.host_pages) == (1, 3)


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), True, "8"])
def test_host_cache_gb_must_be_a_number_of_gb(value: object) -> None:
    with pytest.raises(ValueError, match="host_cache_gb"):
        EngineConfig(host_cache_gb=value)  # type: ignore[arg-type]
