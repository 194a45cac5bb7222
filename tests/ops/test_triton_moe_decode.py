"""The decode MoE block from the stacked input projection (`ninfer.ops.triton.moe_decode`) against the
routing kernel + `fused_moe` path it replaces and the reference block.

CPU tests run the kernels in the Triton interpreter in a child process (tiny E, H, I, fp32, fp16 and
bf16). The exact-input cases use values that are small multiples of powers of two, so every dot is exact
in fp32 whatever the summation order: logits tie, and the routing (ids and weights) must equal
`moe_route_topk`'s on the same logits bit for bit, and the block's output `fused_moe`'s. `gpu` tests run
the compiled kernels at the Qwen3.6-35B-A3B shapes (E=256, K=8, H=2048, I=512, bf16), also replayed from
a CUDA graph.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import interpreted_kernels, max_rel_error, run_interpreter_child

from ninfer.ops.moe import moe_block_from_projections

torch.set_num_threads(1)

E, H, I = 20, 48, 24  # noqa: E741 (the expert width's usual name)


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.moe_decode")


@pytest.fixture(scope="module")
def fused() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.fused_moe")


@pytest.fixture(scope="module")
def routing() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.moe_routing")


class _Block:
    """One MoE layer's weights (input rows stacked as the binder stacks them) and its decode input."""

    def __init__(self, tokens: int, gen: torch.Generator, *, exact: bool, dtype: torch.dtype = torch.float32):
        def values(*shape: int, scale: float) -> torch.Tensor:
            if exact:  # {-2..2} * scale: the dots below are exact in fp32
                return torch.randint(-2, 3, shape, generator=gen).float() * scale
            return torch.randn(*shape, generator=gen) * scale

        self.x = values(tokens, H, scale=0.5).to(dtype)
        self.input_proj = values(E + 2 * I, H, scale=0.25).to(dtype)  # [router; shared gate; shared up]
        self.gate_up = values(E, 2 * I, H, scale=0.125).to(dtype)
        self.down = values(E, H, I, scale=0.125).to(dtype)
        self.shared_down = values(H, I, scale=0.125).to(dtype)
        self.shared_gate = values(1, H, scale=0.125).to(dtype)
        self.projected = F.linear(self.x, self.input_proj)

    def run(
        self, kernels: ModuleType, top_k: int, gate_up_config: object = None, down_config: object = None,
        early_down: bool | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return kernels.moe_decode_block(
            self.x, self.projected, self.gate_up, self.down, self.shared_down, self.shared_gate, top_k,
            gate_up_config=gate_up_config, down_config=down_config, early_down=early_down,
        )  # fmt: skip

    def reference(self, top_k: int) -> torch.Tensor:
        logits, gate, up = self.projected.split([E, I, I], dim=-1)
        return moe_block_from_projections(
            self.x, logits, gate, up, self.gate_up, self.down, self.shared_down, self.shared_gate, top_k
        )

    def two_kernel_path(
        self, fused: ModuleType, routing: ModuleType, top_k: int, config: object = None
    ) -> torch.Tensor:
        """The path the block replaces: moe_route_topk on the logits, then fused_moe with the shared slot."""
        weights, ids, shared_weight = routing.moe_route_topk(
            self.projected[:, :E], top_k, x=self.x, shared_expert_gate=self.shared_gate
        )
        shared = fused.SharedExpert(gate_up=self.input_proj[E:], down=self.shared_down, weight=shared_weight)
        config = config or fused.default_decode_config(self.x.shape[0] * top_k)
        return fused.fused_moe(self.x, self.gate_up, self.down, weights, ids, shared=shared, config=config)


def _tie_all_logits(block: _Block) -> None:
    """Every router logit zero, -0.0 in half of every odd token's (it must tie with +0.0): the top-k are
    the lowest experts."""
    block.projected[:, :E] = 0.0
    block.projected[1::2, :E:2] = -0.0


@pytest.mark.parametrize(
    ("tokens", "top_k", "dtype"),
    [(1, 2, torch.float32), (1, 4, torch.float32), (3, 3, torch.float32), (5, 2, torch.float32),
     (1, 8, torch.bfloat16), (3, 3, torch.bfloat16), (5, 4, torch.float16)],
)  # fmt: skip
def test_routing_equals_moe_route_topk_exactly(
    kernels: ModuleType, routing: ModuleType, tokens: int, top_k: int, dtype: torch.dtype
) -> None:
    """Exact inputs (many tied logits, negative ones among them): ids, weights and shared weight bit-equal
    to the routing kernel's, with 16-bit logits (ranked as int32 keys) and fp32 ones (int64 keys)."""
    block = _Block(tokens, torch.Generator().manual_seed(10 * tokens + top_k), exact=True, dtype=dtype)
    assert (block.projected[:, :E] < 0).any(), "the case should have negative logits"
    assert block.projected[:, :E].unique().numel() < tokens * E, "the case should have tied logits"

    _, weights, ids, shared_weight = kernels.routed_gate_up(
        block.x, block.projected, block.gate_up, block.shared_gate, top_k
    )

    want_weights, want_ids, want_shared = routing.moe_route_topk(
        block.projected[:, :E], top_k, x=block.x, shared_expert_gate=block.shared_gate
    )
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_weights)
    assert torch.equal(shared_weight, want_shared)


@pytest.mark.parametrize(
    ("dtype", "narrow_keys"),
    [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, True)],
)
def test_negative_logits_rank_by_value(
    kernels: ModuleType, routing: ModuleType, dtype: torch.dtype, narrow_keys: bool
) -> None:
    """All logits negative (the key's flipped magnitude bits decide), two of them tied and -0.0 against
    +0.0 in the second token: the routing kernel's ids and weights, with int64 and int32 keys."""
    block = _Block(2, torch.Generator().manual_seed(3), exact=True, dtype=dtype)
    order = torch.randperm(E, generator=torch.Generator().manual_seed(4)).to(dtype)
    block.projected[:, :E] = -(order * 0.25 + 0.5)
    block.projected[0, 7] = block.projected[0, 3]
    block.projected[1, 5], block.projected[1, 11] = -0.0, 0.0

    config = kernels.RoutedGateUpConfig(narrow_keys=narrow_keys)
    _, weights, ids, _ = kernels.routed_gate_up(
        block.x, block.projected, block.gate_up, block.shared_gate, 6, config
    )

    want_weights, want_ids, _ = routing.moe_route_topk(block.projected[:, :E], 6)
    assert ids[1, :2].tolist() == [5, 11]
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_weights)


def test_all_logits_tied_picks_the_lowest_experts(kernels: ModuleType) -> None:
    block = _Block(2, torch.Generator().manual_seed(1), exact=True)
    _tie_all_logits(block)

    _, weights, ids, _ = kernels.routed_gate_up(block.x, block.projected, block.gate_up, block.shared_gate, 4)

    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    assert torch.equal(weights, torch.full((2, 4), 0.25))


@pytest.mark.parametrize(("tokens", "top_k"), [(1, 2), (3, 3), (8, 4)])
@pytest.mark.parametrize("tiles", ["tiny", "looped", "default"])
def test_block_equals_the_two_kernel_path_exactly(
    kernels: ModuleType, fused: ModuleType, routing: ModuleType, tokens: int, top_k: int, tiles: str
) -> None:
    block = _Block(tokens, torch.Generator().manual_seed(20 + tokens + top_k), exact=True)
    gate_up_config, down_config = None, None
    if tiles != "default":  # one expert per down step, I in two steps
        down_config = fused.FusedMoeDecodeConfig(down_block_h=4, down_block_i=16, down_experts=1)
    if tiles == "tiny":  # masked gate_up columns (24 = 16 + 8), several K steps
        gate_up_config = kernels.RoutedGateUpConfig(block_n=16, block_k=16)
    if tiles == "looped":  # 2 programs of 2 x 8 columns per slot: the second's second block wholly masked
        gate_up_config = kernels.RoutedGateUpConfig(block_n=8, block_k=32, n_loop=2, warps=2)

    got = block.run(kernels, top_k, gate_up_config, down_config)

    # the same down tiles: the same summation order
    assert torch.equal(got, block.two_kernel_path(fused, routing, top_k, down_config))


@pytest.mark.parametrize(
    ("tokens", "top_k", "tied"), [(1, 8, False), (3, 3, True), (5, 2, False), (8, 4, True)]
)
@pytest.mark.parametrize("tiles", ["default", "small", "first_tiles_early"])
def test_early_down_equals_the_two_launch_block_exactly(
    kernels: ModuleType,
    fused: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    tokens: int,
    top_k: int,
    tied: bool,
    tiles: str,
) -> None:
    """The early down launch (ranking again from `projected`, down rows loaded before the PDL wait) gives
    decode_down_combine's bits: exact inputs (tied logits) or all logits tied, whole or partly preloaded."""
    block = _Block(tokens, torch.Generator().manual_seed(60 + tokens + top_k), exact=True)
    if tied:
        _tie_all_logits(block)
    down_config = None
    if tiles == "small":  # 2 experts per step, a partial last hidden block (48 = 32 + 16), I in 3 even steps
        down_config = fused.FusedMoeDecodeConfig(down_block_h=32, down_block_i=8, down_experts=2)
        monkeypatch.setattr(kernels, "_MAX_PRELOAD_BYTES", 1 << 30)  # every tile before the wait
    if tiles == "first_tiles_early":  # I in 2 uneven steps; only group 0's first step before the wait
        down_config = fused.FusedMoeDecodeConfig(down_block_h=32, down_block_i=16, down_experts=2)
        monkeypatch.setattr(kernels, "_MAX_PRELOAD_BYTES", 0)

    got = block.run(kernels, top_k, down_config=down_config, early_down=True)

    assert torch.equal(got, block.run(kernels, top_k, down_config=down_config, early_down=False))


@pytest.mark.parametrize(("tokens", "early"), [(1, True), (2, False)])
def test_early_down_is_the_default_for_one_token(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch, tokens: int, early: bool
) -> None:
    block = _Block(tokens, torch.Generator().manual_seed(70), exact=True)
    calls: list[int] = []
    early_down = kernels._early_down_combine
    monkeypatch.setattr(kernels, "_early_down_combine", lambda *args: calls.append(1) or early_down(*args))

    block.run(kernels, 8)
    assert len(calls) == int(early)
    block.run(kernels, 8, early_down=True)
    assert len(calls) == int(early) + 1, "the keyword over the default"


@pytest.mark.parametrize("tokens", [1, 3, 7])
def test_block_matches_the_reference(kernels: ModuleType, tokens: int) -> None:
    block = _Block(tokens, torch.Generator().manual_seed(30 + tokens), exact=False)

    got = block.run(kernels, 3)

    torch.testing.assert_close(got, block.reference(3), rtol=1e-5, atol=1e-5)


def test_block_fp16_rounds_like_the_reference(kernels: ModuleType) -> None:
    block = _Block(3, torch.Generator().manual_seed(40), exact=False, dtype=torch.float16)

    got = block.run(kernels, 3)

    expected = block.reference(3)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=1e-3)
    assert (got != expected).float().mean() <= 0.05, "rounded at different points than the reference"


def test_bad_arguments_are_named(kernels: ModuleType, fused: ModuleType) -> None:
    block = _Block(2, torch.Generator().manual_seed(50), exact=True)
    args = (block.x, block.projected, block.gate_up, block.down, block.shared_down, block.shared_gate)
    with pytest.raises(ValueError, match="projected must be"):
        kernels.moe_decode_block(block.x, block.projected[:, :-1], *args[2:], 2)
    with pytest.raises(ValueError, match="top_k"):
        kernels.moe_decode_block(*args, 0)
    with pytest.raises(ValueError, match="T\\*K"):
        kernels.moe_decode_block(block.x.repeat(20, 1), block.projected.repeat(20, 1), *args[2:], 4)
    with pytest.raises(ValueError, match="shared_expert_gate"):
        kernels.moe_decode_block(*args[:5], block.shared_gate[:, 1:], 2)
    with pytest.raises(ValueError, match="down must be"):
        kernels.moe_decode_block(block.x, block.projected, block.gate_up, block.down[:, :-1], *args[4:], 2)
    with pytest.raises(ValueError, match="n_loop"):
        kernels.RoutedGateUpConfig(n_loop=3)
    hidden, weights, ids, _ = kernels.routed_gate_up(
        block.x, block.projected, block.gate_up, block.shared_gate, 2
    )
    with pytest.raises(ValueError, match="both shared_down and shared_weight"):
        fused.decode_down_combine(
            hidden, block.down, ids, weights, torch.empty_like(block.x), fused.FusedMoeDecodeConfig(),
            shared_down=block.shared_down,
        )  # fmt: skip
    with pytest.raises(ValueError, match="shared_down"):
        kernels.moe_decode_block(*args[:4], block.shared_down[:-1], block.shared_gate, 2)


# ---- GPU, real shapes ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
REAL_E, REAL_K, REAL_H, REAL_I = 256, 8, 2048, 512


@pytest.fixture(scope="module")
def real_layer() -> dict[str, torch.Tensor]:
    """bf16 weights of one 35B-A3B MoE layer (the experts 1.5 GB), made on the GPU once for the module."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    return {
        "input_proj": randn(REAL_E + 2 * REAL_I, REAL_H, scale=REAL_H**-0.5),
        "gate_up": randn(REAL_E, 2 * REAL_I, REAL_H, scale=REAL_H**-0.5),
        "down": randn(REAL_E, REAL_H, REAL_I, scale=REAL_I**-0.5),
        "shared_down": randn(REAL_H, REAL_I, scale=REAL_I**-0.5),
        "shared_gate": randn(1, REAL_H, scale=REAL_H**-0.5),
    }


def _real_block(
    layer: dict[str, torch.Tensor], x: torch.Tensor, projected: torch.Tensor, early_down: bool
) -> torch.Tensor:
    from ninfer.ops.triton.moe_decode import moe_decode_block

    return moe_decode_block(
        x, projected, layer["gate_up"], layer["down"], layer["shared_down"], layer["shared_gate"], REAL_K,
        early_down=early_down,
    )  # fmt: skip


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("early_down", [True, False])
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8])
def test_cuda_real_shapes_bf16(real_layer: dict[str, torch.Tensor], tokens: int, early_down: bool) -> None:
    """Against the reference block in bf16, the routing kernel + fused_moe path it replaces and the other
    down launch (the same bits)."""
    from ninfer.ops.triton.fused_moe import SharedExpert, fused_moe
    from ninfer.ops.triton.moe_decode import routed_gate_up
    from ninfer.ops.triton.moe_routing import moe_route_topk

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, REAL_H, generator=gen, device="cuda").to(torch.bfloat16)
    projected = F.linear(x, real_layer["input_proj"])
    logits, gate, up = projected.split([REAL_E, REAL_I, REAL_I], dim=-1)

    got = _real_block(real_layer, x, projected, early_down)

    assert not got.isnan().any()
    expected = moe_block_from_projections(
        x, logits, gate, up, real_layer["gate_up"], real_layer["down"], real_layer["shared_down"],
        real_layer["shared_gate"], REAL_K,
    )  # fmt: skip
    assert max_rel_error(got, expected) < 1e-2
    _, weights, ids, shared_weight = routed_gate_up(
        x, projected, real_layer["gate_up"], real_layer["shared_gate"], REAL_K
    )
    want_weights, want_ids, want_shared = moe_route_topk(
        logits, REAL_K, x=x, shared_expert_gate=real_layer["shared_gate"]
    )
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_weights)
    torch.testing.assert_close(shared_weight, want_shared, rtol=1e-5, atol=1e-6)
    shared = SharedExpert(
        gate_up=real_layer["input_proj"][REAL_E:], down=real_layer["shared_down"], weight=shared_weight
    )
    old = fused_moe(x, real_layer["gate_up"], real_layer["down"], weights, ids, shared=shared)
    assert max_rel_error(got, old) < 5e-3
    assert torch.equal(_real_block(real_layer, x, projected, early_down), got), "not deterministic"
    assert torch.equal(_real_block(real_layer, x, projected, not early_down), got), "early_down changed bits"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("early_down", [True, False])
def test_cuda_graph_replays_with_fresh_inputs(real_layer: dict[str, torch.Tensor], early_down: bool) -> None:
    tokens = 8
    x = torch.zeros(tokens, REAL_H, device="cuda", dtype=torch.bfloat16)
    projected = torch.zeros(tokens, REAL_E + 2 * REAL_I, device="cuda", dtype=torch.bfloat16)
    _real_block(real_layer, x, projected, early_down)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _real_block(real_layer, x, projected, early_down)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(5):
        x.copy_(torch.randn(tokens, REAL_H, generator=gen, device="cuda"))
        projected.copy_(F.linear(x, real_layer["input_proj"]))
        graph.replay()
        assert torch.equal(out, _real_block(real_layer, x, projected, early_down))
