"""Triton fused MoE (`ninfer.ops.triton.fused_moe`) against the reference routed experts `moe_experts`.

CPU tests run the kernels in the Triton interpreter in a child process (fp32, tiny shapes). `gpu` tests run
the compiled kernels at the Qwen3.6-35B-A3B shapes (E=256, K=8, H=2048, I=512) in bf16, at odd shapes, for
every tier of the sorted path's config table and several decode-path tile choices, and inside CUDA graphs
whose routing changes between replays (decode path at T=3, sorted path at T=4).

With a shared expert (`shared=SharedExpert(...)`) the oracle is the plain-PyTorch composition of
`REFERENCE.moe_block`: moe_experts_fp32 + weight[:, None] * swiglu_mlp(x, ...).float(), cast to x's dtype
once.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import pytest
import torch
from triton_interpreter import interpreted_kernels, max_rel_error, run_interpreter_child

from ninfer.ops.mlp import swiglu_mlp
from ninfer.ops.moe import moe_experts, moe_experts_fp32, moe_route_logits

torch.set_num_threads(1)


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.fused_moe")


def _routing(
    tokens: int, num_experts: int, top_k: int, gen: torch.Generator, excluded: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (as top-k gives), never one of `excluded`; weights sum to 1 per token."""
    allowed = torch.tensor([e for e in range(num_experts) if e not in excluded])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    return weights, ids.reshape(tokens, top_k)


def _experts(
    num_experts: int, hidden: int, inter: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    return gate_up, down


def _expected_layout(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> dict[str, torch.Tensor]:
    """The block layout built in Python from the definition (stable sort, blocks of block_m per expert)."""
    flat = expert_ids.reshape(-1).long()
    sorted_pairs = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    first_row = torch.cumsum(counts, 0) - counts
    block_expert, block_start, block_end = [], [], []
    for expert in range(num_experts):
        for start in range(0, int(counts[expert]), block_m):
            block_expert.append(expert)
            block_start.append(int(first_row[expert]) + start)
            block_end.append(int(first_row[expert] + counts[expert]))
    return {
        "sorted_pairs": sorted_pairs,
        "block_expert": torch.tensor(block_expert),
        "block_row_start": torch.tensor(block_start),
        "block_row_end": torch.tensor(block_end),
    }


E, K, H, I = 8, 2, 32, 16
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def _tiny_config(kernels: ModuleType, **overrides: int) -> object:
    """Smallest tiles `tl.dot` takes, so the tiny shapes still span several K steps and blocks."""
    fields = {
        "block_m": 16, "gate_up_block_n": 16, "gate_up_block_k": 16, "gate_up_warps": 4, "gate_up_stages": 2,
        "down_block_n": 16, "down_block_k": 16, "down_warps": 4, "down_stages": 2, "group_m": 2,
    }  # fmt: skip
    return kernels.FusedMoeConfig(**{**fields, **overrides})


@pytest.mark.parametrize("tokens", [1, 5, 13])
@pytest.mark.parametrize("tiles", ["tiny", "sorted-default", "auto"])
def test_fused_moe_matches_reference_with_an_unused_expert(
    kernels: ModuleType, tokens: int, tiles: str
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen)
    gate_up, down = _experts(E, H, I, gen)
    weights, ids = _routing(tokens, E, K, gen, excluded=(3,))
    # sorted-default: BLOCK_K 128 > H, masked K; auto: T*K <= 26 takes the decode path
    config = {"tiny": _tiny_config(kernels), "sorted-default": kernels.default_config(tokens * K)}.get(tiles)

    got = kernels.fused_moe(x, gate_up, down, weights, ids, config=config)

    assert got.shape == (tokens, H) and got.dtype == x.dtype
    torch.testing.assert_close(got, moe_experts(x, weights, ids, gate_up, down), **CLOSE)


@pytest.mark.parametrize("align_chunk", [256, 8], ids=["one-align-program", "chunked-align"])
def test_fused_moe_all_tokens_choose_the_same_expert(kernels: ModuleType, align_chunk: int) -> None:
    """37 rows on expert 5 (three blocks of 16, the last partial); the other slot spreads over the rest."""
    gen = torch.Generator().manual_seed(5)
    tokens = 37
    x = torch.randn(tokens, H, generator=gen)
    gate_up, down = _experts(E, H, I, gen)
    weights, ids = _routing(tokens, E, K, gen, excluded=(5,))
    ids[:, 1] = 5
    config = _tiny_config(kernels, align_chunk=align_chunk)

    got = kernels.fused_moe(x, gate_up, down, weights, ids, config=config)

    torch.testing.assert_close(got, moe_experts(x, weights, ids, gate_up, down), **CLOSE)
    blocks = kernels.align_pairs_by_expert(ids, E, 16, align_chunk=align_chunk)
    live = int(blocks.num_blocks[0])
    assert (blocks.block_expert[:live] == 5).sum() == 3


def test_fused_moe_odd_dims_chunked_align_and_strided_int32_routing(kernels: ModuleType) -> None:
    """H, I not multiples of the K/N tiles; T*K = 39 not a multiple of BLOCK_M; five align chunks of 8;
    int32 ids and low-precision weights read through strided views."""
    gen = torch.Generator().manual_seed(9)
    tokens, num_experts, top_k, hidden, inter = 13, 6, 3, 40, 24
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up, down = _experts(num_experts, hidden, inter, gen)
    weights, ids = _routing(tokens, num_experts, top_k, gen)
    wide_ids = torch.zeros(tokens, 2 * top_k, dtype=torch.int32)
    wide_ids[:, ::2] = ids
    wide_weights = torch.zeros(tokens, 2 * top_k, dtype=torch.bfloat16)
    wide_weights[:, 1::2] = weights
    strided_ids, strided_weights = wide_ids[:, ::2], wide_weights[:, 1::2]
    assert not strided_ids.is_contiguous() and not strided_weights.is_contiguous()
    config = _tiny_config(kernels, align_chunk=8)

    got = kernels.fused_moe(x, gate_up, down, strided_weights, strided_ids, config=config)

    torch.testing.assert_close(got, moe_experts(x, strided_weights, ids, gate_up, down), **CLOSE)


def test_fused_moe_fp16_rounds_like_the_reference(kernels: ModuleType) -> None:
    """In a 16-bit dtype the projections, the SiLU product and each expert output are rounded where the
    reference rounds them (fp16: the interpreter's bf16 dot is unreliable)."""
    gen = torch.Generator().manual_seed(11)
    tokens = 13
    x = torch.randn(tokens, H, generator=gen).half()
    gate_up, down = (w.half() for w in _experts(E, H, I, gen))
    weights, ids = _routing(tokens, E, K, gen)
    weights = weights.half()

    got = kernels.fused_moe(x, gate_up, down, weights, ids, config=_tiny_config(kernels))

    assert got.dtype == torch.float16
    torch.testing.assert_close(got, moe_experts(x, weights, ids, gate_up, down), rtol=2e-3, atol=1e-3)


def test_fused_moe_writes_the_out_buffer(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(2)
    tokens = 5
    x = torch.randn(tokens, H, generator=gen)
    gate_up, down = _experts(E, H, I, gen)
    weights, ids = _routing(tokens, E, K, gen)
    out = torch.full((tokens, H), float("nan"))

    got = kernels.fused_moe(x, gate_up, down, weights, ids, out=out, config=_tiny_config(kernels))

    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, moe_experts(x, weights, ids, gate_up, down), **CLOSE)


@pytest.mark.parametrize(("tokens", "align_chunk"), [(1, 256), (13, 256), (13, 4), (37, 16)])
def test_align_pairs_by_expert_matches_a_stable_sort(
    kernels: ModuleType, tokens: int, align_chunk: int
) -> None:
    gen = torch.Generator().manual_seed(tokens + align_chunk)
    block_m = 4
    _, ids = _routing(tokens, E, K, gen, excluded=(0, 6))
    ids[: tokens // 2, 0] = 2  # a crowded expert: several blocks

    blocks = kernels.align_pairs_by_expert(ids, E, block_m, align_chunk=align_chunk)

    expected = _expected_layout(ids, E, block_m)
    live = int(blocks.num_blocks[0])
    assert live == len(expected["block_expert"])
    assert blocks.block_expert.shape[0] >= live  # the static bound holds
    assert torch.equal(blocks.sorted_pairs.long(), expected["sorted_pairs"])
    for name in ("block_expert", "block_row_start", "block_row_end"):
        assert torch.equal(getattr(blocks, name)[:live].long(), expected[name]), name


def test_fused_moe_no_tokens_and_bad_shapes(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(0)
    gate_up, down = _experts(E, H, I, gen)
    empty = kernels.fused_moe(
        torch.empty(0, H), gate_up, down, torch.empty(0, K), torch.empty(0, K, dtype=torch.long)
    )
    assert empty.shape == (0, H)
    x = torch.randn(3, H, generator=gen)
    weights, ids = _routing(3, E, K, gen)
    with pytest.raises(ValueError, match="down"):
        kernels.fused_moe(x, gate_up, down[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="expert_ids"):
        kernels.fused_moe(x, gate_up, down, weights, ids[:2])
    with pytest.raises(ValueError, match="out"):
        kernels.fused_moe(x, gate_up, down, weights, ids, out=torch.empty(3, H, dtype=torch.float64))


def test_default_config_tiers_are_valid_dot_tiles(kernels: ModuleType) -> None:
    for pairs in (1, 8, 16, 17, 64, 65, 4096, 65536, 1 << 20):
        config = kernels.default_config(pairs)
        tiles = (config.block_m, config.gate_up_block_n, config.gate_up_block_k, config.down_block_n)
        assert all(t >= 16 and t & (t - 1) == 0 for t in (*tiles, config.down_block_k)), config
    assert kernels.default_config(8).block_m == 16 and kernels.default_config(65536).block_m >= 64


# ---- decode path (interpreter) -------------------------------------------------------------------------


def _tiny_decode_config(kernels: ModuleType, **overrides: int) -> object:
    """Tiles small enough that H=45 and I=21 span several masked steps and blocks."""
    fields = {
        "gate_up_block_n": 8, "gate_up_block_k": 16, "gate_up_warps": 4,
        "down_block_h": 8, "down_block_i": 16, "down_experts": 2, "down_warps": 4,
    }  # fmt: skip
    return kernels.FusedMoeDecodeConfig(**{**fields, **overrides})


def _decode_routing(tokens: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing the decode path must get right: token 0 picks expert 4 twice in its top-k (its weights then
    add), and every other token shares expert 4 with token 0 (the same weight rows read by two tokens)."""
    weights, ids = _routing(tokens, DECODE_E, top_k, gen, excluded=(4,))
    ids[0, 0] = ids[0, top_k - 1] = 4
    ids[1:, 1] = 4
    return weights, ids


DECODE_E, DECODE_H, DECODE_I = 6, 45, 21  # odd H and I: no tile divides them


@pytest.mark.parametrize(("tokens", "top_k"), [(1, 2), (1, 3), (3, 2), (3, 3)])
@pytest.mark.parametrize(
    "tiles", ["tiny", "tiny-one-expert-per-step", "tiny-four-experts-per-step", "default"]
)
def test_decode_path_matches_reference(kernels: ModuleType, tokens: int, top_k: int, tiles: str) -> None:
    """Decode tiles: several masked H and I steps, partial N and H blocks; experts per step 1, 2 (a partial
    last group at K=3) and 4 (> K: masked slots); default: BLOCK_K and BLOCK_I clamp to one masked step."""
    gen = torch.Generator().manual_seed(10 * tokens + top_k)
    x = torch.randn(tokens, DECODE_H, generator=gen)
    gate_up, down = _experts(DECODE_E, DECODE_H, DECODE_I, gen)
    weights, ids = _decode_routing(tokens, top_k, gen)
    config = {
        "tiny": _tiny_decode_config(kernels),
        "tiny-one-expert-per-step": _tiny_decode_config(kernels, down_experts=1, down_block_h=4),
        "tiny-four-experts-per-step": _tiny_decode_config(kernels, down_experts=4, gate_up_block_n=16),
        "default": kernels.default_decode_config(tokens * top_k),
    }[tiles]
    out = torch.full((tokens, DECODE_H), float("nan"))

    got = kernels.fused_moe(x, gate_up, down, weights, ids, out=out, config=config)

    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, moe_experts(x, weights, ids, gate_up, down), **CLOSE)


def test_decode_path_strided_int32_routing_and_bf16_weights(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(21)
    tokens, top_k = 3, 3
    x = torch.randn(tokens, DECODE_H, generator=gen)
    gate_up, down = _experts(DECODE_E, DECODE_H, DECODE_I, gen)
    weights, ids = _decode_routing(tokens, top_k, gen)
    wide_ids = torch.zeros(tokens, 2 * top_k, dtype=torch.int32)
    wide_ids[:, 1::2] = ids
    wide_weights = torch.zeros(tokens, 2 * top_k, dtype=torch.bfloat16)
    wide_weights[:, ::2] = weights
    strided_ids, strided_weights = wide_ids[:, 1::2], wide_weights[:, ::2]

    got = kernels.fused_moe(
        x, gate_up, down, strided_weights, strided_ids, config=_tiny_decode_config(kernels)
    )

    torch.testing.assert_close(got, moe_experts(x, strided_weights, ids, gate_up, down), **CLOSE)


@pytest.mark.parametrize("seed", [12, 13])
def test_decode_path_fp16_rounds_like_the_reference(kernels: ModuleType, seed: int) -> None:
    """fp16 (the interpreter's bf16 is unreliable): projections, SiLU product and expert outputs rounded
    where the reference rounds them, fp32 expert weights cast to fp16 as they are read. Rounded at the
    same points, nearly every output is bit-equal to the reference's (only the fp32 summation order
    differs); skipping any one rounding changes 25-50% of them by an ulp, which a tolerance would hide."""
    gen = torch.Generator().manual_seed(seed)
    tokens, top_k = 3, 3
    x = torch.randn(tokens, DECODE_H, generator=gen).half()
    gate_up, down = _experts(DECODE_E, DECODE_H, DECODE_I, gen)  # fp32 expert weights, fp16 x
    weights, ids = _decode_routing(tokens, top_k, gen)
    weights = weights.half()

    got = kernels.fused_moe(x, gate_up, down, weights, ids, config=_tiny_decode_config(kernels))

    expected = moe_experts(x, weights, ids, gate_up, down)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=1e-3)
    assert (got != expected).float().mean() <= 0.05, "rounded at different points than the reference"


@pytest.mark.parametrize(("tokens", "top_k", "path"), [(1, 8, "decode"), (8, 8, "decode"), (65, 1, "sorted")])
def test_fused_moe_takes_the_decode_path_up_to_decode_max_pairs(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch, tokens: int, top_k: int, path: str
) -> None:
    assert kernels.DECODE_MAX_PAIRS == 64, "update the parametrization"
    calls: list[tuple[str, object]] = []
    for name in ("decode", "sorted"):
        monkeypatch.setattr(
            kernels, f"_fused_moe_{name}", lambda *args, name=name, **_: calls.append((name, args[-1]))
        )
    gen = torch.Generator().manual_seed(0)
    gate_up, down = _experts(8, H, I, gen)
    weights, ids = _routing(tokens, 8, top_k, gen)

    kernels.fused_moe(torch.randn(tokens, H, generator=gen), gate_up, down, weights, ids)

    expected_type = kernels.FusedMoeDecodeConfig if path == "decode" else kernels.FusedMoeConfig
    assert [name for name, _ in calls] == [path] and isinstance(calls[0][1], expected_type)


def test_decode_config_tiles_are_powers_of_two(kernels: ModuleType) -> None:
    for pairs in (1, 8, 64, 65, 1 << 20):
        assert isinstance(kernels.default_decode_config(pairs), kernels.FusedMoeDecodeConfig)
    with pytest.raises(ValueError, match="down_block_h"):
        kernels.FusedMoeDecodeConfig(down_block_h=6)


# ---- shared expert (interpreter) -----------------------------------------------------------------------


def _shared_expert(
    kernels: ModuleType, tokens: int, hidden: int, inter: int, gen: torch.Generator, dtype: torch.dtype
) -> tuple[object, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A SharedExpert whose gate_up and down are strided views (row strides hidden + 7 and inter + 5, as a
    slice of a bigger stacked weight would be), and its (gate, up, down) for `swiglu_mlp`."""
    stacked = torch.randn(2 * inter, hidden + 7, generator=gen) * hidden**-0.5
    down_wide = torch.randn(hidden, inter + 5, generator=gen) * inter**-0.5
    gate_up, down = stacked.to(dtype)[:, :hidden], down_wide.to(dtype)[:, :inter]
    weight = torch.sigmoid(torch.randn(tokens, generator=gen))
    shared = kernels.SharedExpert(gate_up=gate_up, down=down, weight=weight)
    return shared, (gate_up[:inter], gate_up[inter:], down)


def _with_shared(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    shared: object, shared_mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """The reference MoE block with the shared expert: fp32 routed sum + weight * shared output, one cast."""
    routed = moe_experts_fp32(x, weights, ids.long(), gate_up, down)
    shared_out = swiglu_mlp(x, *shared_mlp).float()
    return (routed + shared.weight[:, None].float() * shared_out).to(x.dtype)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("tokens", "top_k"), [(1, 2), (3, 3), (5, 2)])
@pytest.mark.parametrize("tiles", ["tiny", "tiny-four-experts-per-step", "default"])
def test_decode_path_with_shared_expert_matches_reference(
    kernels: ModuleType, tokens: int, top_k: int, tiles: str
) -> None:
    """Odd H and I (masked steps), the shared expert's rows strided, fp32 weights, poisoned out."""
    gen = torch.Generator().manual_seed(30 + 10 * tokens + top_k)
    x = torch.randn(tokens, DECODE_H, generator=gen)
    gate_up, down = _experts(DECODE_E, DECODE_H, DECODE_I, gen)
    weights, ids = _decode_routing(tokens, top_k, gen)
    shared, shared_mlp = _shared_expert(kernels, tokens, DECODE_H, DECODE_I, gen, torch.float32)
    config = {
        "tiny": _tiny_decode_config(kernels),
        "tiny-four-experts-per-step": _tiny_decode_config(kernels, down_experts=4, down_block_h=4),
        "default": kernels.default_decode_config(tokens * top_k),
    }[tiles]
    out = torch.full((tokens, DECODE_H), float("nan"))

    got = kernels.fused_moe(x, gate_up, down, weights, ids, shared=shared, out=out, config=config)

    assert got.data_ptr() == out.data_ptr()
    expected = _with_shared(x, weights, ids, gate_up, down, shared, shared_mlp)
    torch.testing.assert_close(got, expected, **CLOSE)
    without = moe_experts(x, weights, ids, gate_up, down)
    assert (got - without).abs().max() > 1e-2, "the shared term is missing"


@pytest.mark.parametrize("tokens", [1, 5, 13])
@pytest.mark.parametrize("tiles", ["tiny", "sorted-default"])
def test_sorted_path_with_shared_expert_matches_reference(
    kernels: ModuleType, tokens: int, tiles: str
) -> None:
    gen = torch.Generator().manual_seed(40 + tokens)
    x = torch.randn(tokens, H, generator=gen)
    gate_up, down = _experts(E, H, I, gen)
    weights, ids = _routing(tokens, E, K, gen)
    shared, shared_mlp = _shared_expert(kernels, tokens, H, I, gen, torch.float32)
    config = _tiny_config(kernels) if tiles == "tiny" else kernels.default_config(tokens * K)
    out = torch.full((tokens, H), float("nan"))

    got = kernels.fused_moe(x, gate_up, down, weights, ids, shared=shared, out=out, config=config)

    torch.testing.assert_close(got, _with_shared(x, weights, ids, gate_up, down, shared, shared_mlp), **CLOSE)


def test_sorted_path_takes_a_shared_expert_of_another_width(kernels: ModuleType) -> None:
    """The sorted path runs the shared expert in torch ops, so I_s may differ from I; the decode path
    runs it as one more expert slot and refuses."""
    gen = torch.Generator().manual_seed(50)
    tokens, shared_inter = 5, 24
    x = torch.randn(tokens, H, generator=gen)
    gate_up, down = _experts(E, H, I, gen)
    weights, ids = _routing(tokens, E, K, gen)
    shared, shared_mlp = _shared_expert(kernels, tokens, H, shared_inter, gen, torch.float32)

    got = kernels.fused_moe(x, gate_up, down, weights, ids, shared=shared, config=_tiny_config(kernels))

    torch.testing.assert_close(got, _with_shared(x, weights, ids, gate_up, down, shared, shared_mlp), **CLOSE)
    with pytest.raises(ValueError, match="width 24"):
        kernels.fused_moe(x, gate_up, down, weights, ids, shared=shared)  # T*K = 10: the decode path


@pytest.mark.parametrize("path", ["decode", "sorted"])
def test_shared_expert_fp16_rounds_like_the_reference(kernels: ModuleType, path: str) -> None:
    """fp16: the shared projections, SiLU product and output are rounded where swiglu_mlp rounds them and
    the whole block once at the end: nearly every output bit-equal to the reference's."""
    gen = torch.Generator().manual_seed(60)
    tokens, top_k = 3, 3
    x = torch.randn(tokens, DECODE_H, generator=gen).half()
    gate_up, down = (w.half() for w in _experts(DECODE_E, DECODE_H, DECODE_I, gen))
    weights, ids = _decode_routing(tokens, top_k, gen)
    shared, shared_mlp = _shared_expert(kernels, tokens, DECODE_H, DECODE_I, gen, torch.float16)
    config = _tiny_decode_config(kernels) if path == "decode" else _tiny_config(kernels)

    got = kernels.fused_moe(x, gate_up, down, weights, ids, shared=shared, config=config)

    expected = _with_shared(x, weights, ids, gate_up, down, shared, shared_mlp)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=1e-3)
    assert (got != expected).float().mean() <= 0.05, "rounded at different points than the reference"


def test_routing_kernel_feeds_fused_moe_with_shared_expert(kernels: ModuleType) -> None:
    """The decode block as the model will run it: moe_route_topk's fp32 weights, int32 ids and shared
    weight straight into fused_moe, against moe_route_logits + the reference block."""
    routing = interpreted_kernels("ninfer.ops.triton.moe_routing")
    gen = torch.Generator().manual_seed(70)
    tokens, top_k = 3, 2
    x = torch.randn(tokens, DECODE_H, generator=gen)
    gate_up, down = _experts(DECODE_E, DECODE_H, DECODE_I, gen)
    logits = torch.stack([torch.randperm(DECODE_E, generator=gen) for _ in range(tokens)]).float() / 4
    gate = torch.randn(1, DECODE_H, generator=gen) * DECODE_H**-0.5
    shared, shared_mlp = _shared_expert(kernels, tokens, DECODE_H, DECODE_I, gen, torch.float32)

    weights, ids, shared_weight = routing.moe_route_topk(logits, top_k, x=x, shared_expert_gate=gate)
    shared = kernels.SharedExpert(gate_up=shared.gate_up, down=shared.down, weight=shared_weight)
    got = kernels.fused_moe(x, gate_up, down, weights, ids, shared=shared)

    ref_weights, ref_ids = moe_route_logits(logits, top_k)
    ref_shared = kernels.SharedExpert(
        gate_up=shared.gate_up, down=shared.down, weight=torch.sigmoid(x @ gate.T).reshape(-1)
    )
    expected = _with_shared(x, ref_weights, ref_ids, gate_up, down, ref_shared, shared_mlp)
    torch.testing.assert_close(got, expected, **CLOSE)


def test_shared_expert_bad_arguments(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(80)
    tokens = 3
    x = torch.randn(tokens, H, generator=gen)
    gate_up, down = _experts(E, H, I, gen)
    weights, ids = _routing(tokens, E, K, gen)
    shared, _ = _shared_expert(kernels, tokens, H, I, gen, torch.float32)
    replace = dataclasses.replace
    with pytest.raises(ValueError, match="shared.weight"):
        kernels.fused_moe(x, gate_up, down, weights, ids, shared=replace(shared, weight=shared.weight[:2]))
    with pytest.raises(ValueError, match="shared.gate_up"):
        kernels.fused_moe(
            x, gate_up, down, weights, ids, shared=replace(shared, gate_up=shared.gate_up[:, :-1])
        )
    with pytest.raises(ValueError, match="dtype"):
        kernels.fused_moe(
            x, gate_up, down, weights, ids, shared=replace(shared, gate_up=shared.gate_up.double())
        )
    with pytest.raises(ValueError, match="K >= 1"):
        kernels.fused_moe(x, gate_up, down, weights[:, :0], ids[:, :0], shared=shared)


# ---- GPU, real shapes ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
REAL_E, REAL_K, REAL_H, REAL_I = 256, 8, 2048, 512


@pytest.fixture(scope="module")
def real_experts() -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 expert weights at the 35B-A3B shapes (1.5 GB), made on the GPU once for the module."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(REAL_E, 2 * REAL_I, REAL_H, generator=gen, device="cuda", dtype=torch.bfloat16)
    down = torch.randn(REAL_E, REAL_H, REAL_I, generator=gen, device="cuda", dtype=torch.bfloat16)
    return gate_up.mul_(REAL_H**-0.5), down.mul_(REAL_I**-0.5)


def _real_routing(tokens: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """x and top-k routing as the router makes it (distinct experts per token, weights renormalised)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, REAL_H, generator=gen, device="cuda").to(dtype)
    probs = torch.softmax(torch.randn(tokens, REAL_E, generator=gen, device="cuda") * 2.0, dim=-1)
    top, ids = torch.topk(probs, REAL_K, dim=-1)
    return x, (top / top.sum(-1, keepdim=True)).to(dtype), ids


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("tokens", "path"),
    [(1, "auto"), (2, "auto"), (3, "auto"), (5, "auto"), (8, "auto"), (37, "auto"), (2048, "auto"),
     (1, "sorted"), (8, "sorted")],
)  # fmt: skip
def test_fused_moe_cuda_real_shapes_bf16(
    real_experts: tuple[torch.Tensor, torch.Tensor], tokens: int, path: str
) -> None:
    """auto: T <= 8 takes the decode path (T*K <= 64), larger T the sorted one; sorted: forced at decode T."""
    from ninfer.ops.triton.fused_moe import default_config, fused_moe

    gate_up, down = real_experts
    x, weights, ids = _real_routing(tokens, seed=tokens)
    if tokens > 1:
        ids[1:, 0] = ids[0, 0]  # one expert shared by every token (and maybe twice in a token's top-k)
    expected = moe_experts(x, weights, ids, gate_up, down)
    config = default_config(tokens * REAL_K) if path == "sorted" else None
    out = torch.full_like(x, float("nan"))

    got = fused_moe(x, gate_up, down, weights, ids, out=out, config=config)

    assert not got.isnan().any()
    assert max_rel_error(got, expected) < 1e-2
    again = fused_moe(x, gate_up, down, weights, ids, out=torch.full_like(x, float("nan")), config=config)
    assert torch.equal(again, got), "not deterministic"


# Decode tiles at their extremes (the timing script's --sweep choices lie within them): one or all experts
# per down step, the whole H in one gate_up step, 1-row and 16-row blocks, 2 and 8 warps.
DECODE_TILE_CHOICES = (
    {},
    {"gate_up_block_n": 16, "gate_up_block_k": 256, "down_block_h": 8, "down_experts": 2},
    {"gate_up_block_n": 4, "gate_up_block_k": 1024, "down_block_h": 2, "down_experts": 8},
    {"gate_up_block_n": 8, "gate_up_warps": 8, "down_block_h": 4, "down_experts": 8, "down_warps": 8},
    {"gate_up_block_n": 8, "gate_up_block_k": 256, "gate_up_warps": 2, "down_block_i": 256, "down_experts": 1,
     "down_warps": 2},
    {"gate_up_block_n": 2, "gate_up_block_k": 2048, "down_block_h": 1, "down_experts": 8, "down_warps": 2},
)  # fmt: skip


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("choice", range(len(DECODE_TILE_CHOICES)))
def test_fused_moe_cuda_decode_tile_choices(
    real_experts: tuple[torch.Tensor, torch.Tensor], choice: int
) -> None:
    from ninfer.ops.triton.fused_moe import FusedMoeDecodeConfig, fused_moe

    gate_up, down = real_experts
    x, weights, ids = _real_routing(5, seed=200 + choice)
    expected = moe_experts(x, weights, ids, gate_up, down)
    config = FusedMoeDecodeConfig(**DECODE_TILE_CHOICES[choice])

    got = fused_moe(x, gate_up, down, weights, ids, out=torch.full_like(x, float("nan")), config=config)

    assert not got.isnan().any()
    assert max_rel_error(got, expected) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tier", range(5))
def test_fused_moe_cuda_every_config_tier(real_experts: tuple[torch.Tensor, torch.Tensor], tier: int) -> None:
    """Each table config compiles and is correct on the same 37-token input (align in 2 chunks by default)."""
    from ninfer.ops.triton.fused_moe import _CONFIGS, fused_moe

    assert len(_CONFIGS) == 5, "update the tier parametrization"
    gate_up, down = real_experts
    x, weights, ids = _real_routing(37, seed=100 + tier)
    expected = moe_experts(x, weights, ids, gate_up, down)

    got = fused_moe(
        x, gate_up, down, weights, ids, out=torch.full_like(x, float("nan")), config=_CONFIGS[tier][1]
    )

    assert not got.isnan().any()
    assert max_rel_error(got, expected) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 5, 37, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_moe_cuda_odd_shapes(tokens: int, dtype: torch.dtype) -> None:
    """H, I not multiples of any tile, E and K not powers of two, int32 ids, fp32 weights with bf16 x
    (T=1, 5: decode path; 37, 300: sorted path)."""
    from ninfer.ops.triton.fused_moe import fused_moe

    gen = torch.Generator().manual_seed(tokens)
    num_experts, top_k, hidden, inter = 10, 3, 200, 72
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", dtype)
    gate_up, down = (w.to("cuda", dtype) for w in _experts(num_experts, hidden, inter, gen))
    weights, ids = _routing(tokens, num_experts, top_k, gen)
    weights, ids = weights.cuda(), ids.to("cuda", torch.int32)
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:  # the fp32 oracle without TF32
        expected = moe_experts(x, weights, ids.long(), gate_up, down)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    out = torch.full_like(x, float("nan"))

    got = fused_moe(x, gate_up, down, weights, ids, out=out)

    assert not got.isnan().any()
    assert max_rel_error(got, expected) < (1e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("tokens", "path"), [(3, "decode"), (9, "sorted")])
def test_fused_moe_cuda_graph_replays_new_routing(
    real_experts: tuple[torch.Tensor, torch.Tensor], tokens: int, path: str
) -> None:
    """Captured once, replayed with new x, weights and expert ids written into the captured tensors."""
    from ninfer.ops.triton.fused_moe import DECODE_MAX_PAIRS, default_config, fused_moe

    assert (tokens * REAL_K <= DECODE_MAX_PAIRS) == (path == "decode")
    config = default_config(tokens * REAL_K) if path == "sorted" else None  # decode: the automatic choice
    gate_up, down = real_experts
    x, weights, ids = _real_routing(tokens, seed=1)
    out = torch.full_like(x, float("nan"))
    fused_moe(x, gate_up, down, weights, ids, out=out, config=config)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, gate_up, down, weights, ids, out=out, config=config)

    for seed in (2, 3, 4, 5):
        new_x, new_weights, new_ids = _real_routing(tokens, seed=seed)
        if seed == 4:
            new_ids[:, 0] = new_ids[0, 0]  # every token shares an expert: a layout the capture did not see
        if seed == 5:
            new_ids[0, 1] = new_ids[0, 0]  # an expert twice in one token's top-k (its weights add)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any()
        assert max_rel_error(out, moe_experts(new_x, new_weights, new_ids, gate_up, down)) < 1e-2


# ---- GPU, shared expert --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_shared() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's layout: one stacked input projection [router E | shared gate I | shared up I] of which
    the shared gate_up is a row slice, a separate shared down [H, I] and the shared-expert gate row [1, H]."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    input_proj = torch.randn(REAL_E + 2 * REAL_I, REAL_H, generator=gen, device="cuda") * REAL_H**-0.5
    shared_down = torch.randn(REAL_H, REAL_I, generator=gen, device="cuda") * REAL_I**-0.5
    gate = torch.randn(1, REAL_H, generator=gen, device="cuda") * REAL_H**-0.5
    return input_proj.bfloat16(), shared_down.bfloat16(), gate.bfloat16()


def _real_block_reference(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    shared_gate_up: torch.Tensor, shared_down: torch.Tensor, shared_weight: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    routed = moe_experts_fp32(x, weights, ids.long(), gate_up, down)
    shared_out = swiglu_mlp(x, shared_gate_up[:REAL_I], shared_gate_up[REAL_I:], shared_down).float()
    return (routed + shared_weight[:, None].float() * shared_out).to(x.dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("tokens", "path"), [(1, "auto"), (3, "auto"), (8, "auto"), (37, "auto"), (300, "auto"), (3, "sorted")]
)
def test_fused_moe_cuda_shared_expert_real_shapes(
    real_experts: tuple[torch.Tensor, torch.Tensor],
    real_shared: tuple[torch.Tensor, ...],
    tokens: int,
    path: str,
) -> None:
    """Shared gate_up a row slice of the stacked input projection, fp32 routing weights (as the routing
    kernel gives them), poisoned out; T <= 8 auto: decode path, larger: sorted; deterministic."""
    from ninfer.ops.triton.fused_moe import SharedExpert, default_config, fused_moe

    gate_up, down = real_experts
    input_proj, shared_down, _ = real_shared
    shared_gate_up = input_proj[REAL_E:]
    x, weights, ids = _real_routing(tokens, seed=400 + tokens)
    weights = weights.float()
    shared_weight = torch.rand(tokens, device="cuda")
    shared = SharedExpert(gate_up=shared_gate_up, down=shared_down, weight=shared_weight)
    config = default_config(tokens * REAL_K) if path == "sorted" else None

    got = fused_moe(
        x, gate_up, down, weights, ids, shared=shared, out=torch.full_like(x, float("nan")), config=config
    )

    assert not got.isnan().any()
    expected = _real_block_reference(
        x, weights, ids, gate_up, down, shared_gate_up, shared_down, shared_weight
    )
    assert max_rel_error(got, expected) < 1e-2
    routed_only = moe_experts(x, weights, ids, gate_up, down)
    assert max_rel_error(routed_only, expected) > 2e-2, "the shared term is too small to test"
    again = fused_moe(x, gate_up, down, weights, ids, shared=shared, config=config)
    assert torch.equal(again, got), "not deterministic"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_moe_cuda_shared_expert_odd_shapes(tokens: int, dtype: torch.dtype) -> None:
    """H, I not multiples of any tile, strided shared weights, K = 3 (T=1, 5: decode path; 37: sorted)."""
    from ninfer.ops.triton.fused_moe import SharedExpert, fused_moe

    gen = torch.Generator().manual_seed(500 + tokens)
    num_experts, top_k, hidden, inter = 10, 3, 200, 72
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", dtype)
    gate_up, down = (w.to("cuda", dtype) for w in _experts(num_experts, hidden, inter, gen))
    weights, ids = _routing(tokens, num_experts, top_k, gen)
    weights, ids = weights.cuda(), ids.to("cuda", torch.int32)
    stacked = (torch.randn(2 * inter, hidden + 8, generator=gen) * hidden**-0.5).to("cuda", dtype)
    shared_down = (torch.randn(hidden, inter, generator=gen) * inter**-0.5).to("cuda", dtype)
    shared_weight = torch.rand(tokens, generator=gen).cuda()
    shared = SharedExpert(gate_up=stacked[:, :hidden], down=shared_down, weight=shared_weight)
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:  # the fp32 oracle without TF32
        routed = moe_experts_fp32(x, weights, ids.long(), gate_up, down)
        shared_out = swiglu_mlp(x, stacked[:inter, :hidden], stacked[inter:, :hidden], shared_down).float()
        expected = (routed + shared_weight[:, None] * shared_out).to(dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32

    got = fused_moe(x, gate_up, down, weights, ids, shared=shared, out=torch.full_like(x, float("nan")))

    assert not got.isnan().any()
    assert max_rel_error(got, expected) < (1e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("tokens", "path"), [(3, "decode"), (9, "sorted")])
def test_routing_and_fused_moe_with_shared_expert_cuda_graph(
    real_experts: tuple[torch.Tensor, torch.Tensor],
    real_shared: tuple[torch.Tensor, ...],
    tokens: int,
    path: str,
) -> None:
    """The decode MoE block after the router GEMM (routing kernel + fused_moe with the shared expert)
    captured once, replayed with new x and router logits copied into the captured tensors; against
    moe_route_logits + the reference block. Logits without ties (distinct multiples of 1/32, exact in
    bf16), so the reference's top-k is unique."""
    from ninfer.ops.triton.fused_moe import DECODE_MAX_PAIRS, SharedExpert, default_config, fused_moe
    from ninfer.ops.triton.moe_routing import moe_route_topk

    assert (tokens * REAL_K <= DECODE_MAX_PAIRS) == (path == "decode")
    config = default_config(tokens * REAL_K) if path == "sorted" else None
    gate_up, down = real_experts
    input_proj, shared_down, gate = real_shared
    shared_gate_up = input_proj[REAL_E:]

    def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(tokens, REAL_H, generator=gen, device="cuda").bfloat16()
        perms = torch.stack([torch.randperm(REAL_E, generator=gen, device="cuda") for _ in range(tokens)])
        return x, ((perms.float() - REAL_E / 2) / 32).bfloat16()

    x, logits = inputs(1)
    out = torch.full_like(x, float("nan"))

    def block() -> None:
        weights, ids, shared_weight = moe_route_topk(logits, REAL_K, x=x, shared_expert_gate=gate)
        shared = SharedExpert(gate_up=shared_gate_up, down=shared_down, weight=shared_weight)
        fused_moe(x, gate_up, down, weights, ids, shared=shared, out=out, config=config)

    block()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        block()

    for seed in (2, 3, 4):
        new_x, new_logits = inputs(seed)
        x.copy_(new_x)
        logits.copy_(new_logits)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any()
        ref_weights, ref_ids = moe_route_logits(new_logits, REAL_K)
        shared_weight = torch.sigmoid(torch.nn.functional.linear(new_x, gate).float()).reshape(-1)
        expected = _real_block_reference(
            new_x, ref_weights, ref_ids, gate_up, down, shared_gate_up, shared_down, shared_weight
        )
        assert max_rel_error(out, expected) < 1e-2
