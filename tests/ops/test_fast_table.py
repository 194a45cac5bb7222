"""The fast op table's compositions (`ninfer.ops.norm`, `linear`, `attention`, `gdn`, `moe`, reached
through `ninfer.targets.qwen3_6.kernels.fast_kernels()`) against the reference table's.

The kernels themselves are tested one by one (tests/ops/test_triton_*.py); this checks the wiring that
the model calls: which rows of the stacked MoE input projection are the router and which the shared
expert, the shared expert's gate, the one-row GEMV dispatch and its fallback, the attention prologue and
the gated prefill attention, the GDN decode step's split of the stacked input projection (with and
without the conv step in the GEMV's epilogue). CPU tests run in the Triton interpreter in a child
process (tiny fp32 shapes); end to end on a GPU, tests/gpu/test_fast_path.py compares greedy tokens.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import interpreted_kernels, max_rel_error, run_interpreter_child

from ninfer.targets.qwen3_6.kernels import Kernels
from ninfer.targets.qwen3_6.view import MoeMlpView, stacked_rows

torch.set_num_threads(1)


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def tables() -> ModuleType:
    return interpreted_kernels("ninfer.targets.qwen3_6.kernels")


@pytest.fixture(scope="module")
def table(tables: ModuleType) -> Kernels:
    """The fast table (its Triton kernels interpreted; without fla-core, prefill keeps the reference)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tables.fast_kernels()


@pytest.fixture(scope="module")
def reference(tables: ModuleType) -> Kernels:
    return tables.REFERENCE


def _moe_view(gen: torch.Generator, experts: int, inter: int, hidden: int, shared: int) -> MoeMlpView:
    """A MoE view whose router and shared gate/up rows are consecutive blocks of one buffer (stacked)."""
    stack = torch.randn(experts + 2 * shared, hidden, generator=gen) * hidden**-0.5
    router, gate, up = stack[:experts], stack[experts : experts + shared], stack[experts + shared :]
    view = MoeMlpView(
        router=router,
        gate_up=torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5,
        down=torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5,
        shared_gate_proj=gate,
        shared_up_proj=up,
        shared_down_proj=torch.randn(hidden, shared, generator=gen) * shared**-0.5,
        shared_expert_gate=torch.randn(1, hidden, generator=gen),
        input_proj=stacked_rows((router, gate, up)),
    )
    assert view.input_proj is not None
    return view


@pytest.mark.parametrize("shared_width", [16, 24])  # equal to the expert width, and wider (sorted path)
@pytest.mark.parametrize("tokens", [1, 3, 40])  # decode path (T*K <= 64) and sorted path
def test_moe_block_matches_the_reference_block(
    table: Kernels, reference: Kernels, tokens: int, shared_width: int
) -> None:
    gen = torch.Generator().manual_seed(tokens * 100 + shared_width)
    view = _moe_view(gen, experts=8, inter=16, hidden=24, shared=shared_width)
    variant = SimpleNamespace(num_experts_per_tok=2)
    x = torch.randn(tokens, 24, generator=gen)
    decode = tokens * 2 <= 64
    for v in (view, replace(view, input_proj=None)):  # stacked and unstacked projections
        want = reference.moe_block(v, variant, x, decode)
        got = table.moe_block(v, variant, x, decode)
        assert not got.isnan().any()
        assert max_rel_error(got, want) < 1e-5, (tokens, shared_width, v.input_proj is not None)


def test_moe_block_reads_the_shared_expert_rows_not_the_router_rows(table: Kernels) -> None:
    """Swapping the shared gate and up blocks of the stack must change the fast block's output."""
    gen = torch.Generator().manual_seed(7)
    view = _moe_view(gen, experts=8, inter=16, hidden=24, shared=16)
    variant = SimpleNamespace(num_experts_per_tok=2)
    x = torch.randn(3, 24, generator=gen)
    swapped_stack = torch.cat([view.router, view.shared_up_proj, view.shared_gate_proj])
    swapped = replace(view, input_proj=swapped_stack)
    got = table.moe_block(swapped, variant, x, True)
    assert max_rel_error(got, table.moe_block(view, variant, x, True)) > 1e-3


def test_linear_takes_the_gemv_for_one_row_and_falls_back_otherwise(table: Kernels) -> None:
    gen = torch.Generator().manual_seed(3)
    for rows, n, k in ((1, 5, 24), (1, 33, 40), (3, 33, 40)):
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        torch.testing.assert_close(table.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    # a weight without a unit stride along K (the GEMV cannot read it) goes to F.linear
    x, w = torch.randn(1, 40, generator=gen), torch.randn(40, 33, generator=gen).t()
    torch.testing.assert_close(table.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_logits_are_the_reference_logits(table: Kernels, reference: Kernels) -> None:
    """One row through the GEMV's fp32 output (the fp16 result widened, not an fp32 sum), three rows
    (no tuned tile at these dims) through F.linear and the cast: both the reference's
    `F.linear(x, w).float()` in fp16, the GEMV's sum order aside."""
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 3):
        x, w = torch.randn(rows, 40, generator=gen).half(), torch.randn(33, 40, generator=gen).half()
        got = table.logits(x, w)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, reference.logits(x, w), rtol=2e-3, atol=2e-3)
        assert torch.equal(got, got.half().float())  # the fp16 result widened, not an fp32 sum


@pytest.mark.parametrize("padded", [False, True])
def test_gated_prefill_attention_matches_the_reference(
    table: Kernels, reference: Kernels, padded: bool
) -> None:
    """Two rows (a fresh prompt, a chunk after a prefix) through the step's device bounds, the gate read
    from qkv; a padded step (a prefill graph's capacity) gets zeros past its rows, as the reference."""
    from ninfer.targets.qwen3_6.model import StepBatch

    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, d, page_size = 4, 2, 16, 8
    queries, contexts, padding = [9, 6], [9, 21], 5 if padded else 0
    n = sum(queries) + padding
    table_rows = torch.tensor([[3, 0, 0], [1, 4, 2]], dtype=torch.int32)
    k_pages, v_pages = (torch.randn(5, page_size, kv_heads, d, generator=gen) for _ in range(2))
    qkv = torch.randn(n, heads * 2 * d + 2 * kv_heads * d, generator=gen)
    q = torch.randn(n, heads, d, generator=gen)
    batch = StepBatch(
        token_ids=torch.zeros(n, dtype=torch.long),
        positions=torch.zeros(3, n, dtype=torch.long),
        query_start=torch.tensor([0, 9, 15], dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        block_table=table_rows,
        slot_mapping=torch.zeros(n, dtype=torch.long),
        state_in=torch.zeros(2, dtype=torch.long),
        state_out=torch.zeros(2, dtype=torch.long),
        fresh=torch.zeros(2, dtype=torch.bool),
        padded=padded,
    )
    want = reference.gated_prefill_attention(q, k_pages, v_pages, batch, d**-0.5, qkv)
    got = table.gated_prefill_attention(q, k_pages, v_pages, batch, d**-0.5, qkv)
    assert got.shape == (n, heads * d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_linear_gelu_tanh_off_cuda_is_the_reference(table: Kernels, reference: Kernels) -> None:
    """Off CUDA the fused fc1 + GELU is the reference composition (torch's CPU `_addmm_activation` applies
    the exact GELU, not the tanh one); on CUDA: tests/gpu/test_vision_graphs_cuda.py."""
    gen = torch.Generator().manual_seed(13)
    x, w = torch.randn(5, 24, generator=gen), torch.randn(40, 24, generator=gen)
    bias = torch.randn(40, generator=gen)
    want = F.gelu(F.linear(x, w, bias), approximate="tanh")
    assert torch.equal(reference.linear_gelu_tanh(x, w, bias), want)
    assert torch.equal(table.linear_gelu_tanh(x, w, bias), want)


def test_linear_add_rms_norm_equals_the_reference_composition(table: Kernels, reference: Kernels) -> None:
    """The projection (the GEMV for one row, F.linear for more) then the fused add + norm equals the
    reference composition (F.linear, then add_rms_norm)."""
    gen = torch.Generator().manual_seed(11)
    for rows, n, k in ((1, 33, 40), (1, 5, 24), (3, 33, 40)):
        act, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) * k**-0.5
        residual, weight = torch.randn(rows, n, generator=gen), torch.randn(n, generator=gen) * 0.1
        want_h, want_x = reference.linear_add_rms_norm(act, w, residual, weight, 1e-6)
        got_h, got_x = table.linear_add_rms_norm(act, w, residual, weight, 1e-6)
        torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-5)


def test_linear_add_rms_norm_hands_split_partials_to_the_norm(
    table: Kernels, reference: Kernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shape whose tuned GEMV splits K: the norm kernel gets the split partials (no reduce launch) and
    the residual stream equals the reduced projection + add_rms_norm bit for bit, the normed row within
    the reference's tolerance."""
    import ninfer.ops.triton.norm as norm
    import ninfer.ops.triton.skinny_gemm as skinny

    split = skinny.SkinnyConfig(block_n=16, block_k=16, split_k=2, use_dot=True)
    monkeypatch.setitem(skinny._TUNED, (8, 33, 40), split)
    skinny.default_config.cache_clear()
    slabs: list[int] = []
    partials = skinny.skinny_linear_partials
    monkeypatch.setattr(
        skinny, "skinny_linear_partials", lambda *a, **kw: slabs.append(len(out := partials(*a, **kw))) or out
    )
    gen = torch.Generator().manual_seed(12)
    act, w = torch.randn(3, 40, generator=gen), torch.randn(33, 40, generator=gen) * 40**-0.5
    residual, weight = torch.randn(3, 33, generator=gen), torch.randn(33, generator=gen) * 0.1

    got_h, got_x = table.linear_add_rms_norm(act, w, residual, weight, 1e-6)
    want_h, want_x = norm.add_rms_norm(skinny.skinny_linear(act, w), residual, weight, 1e-6)
    skinny.default_config.cache_clear()

    assert slabs == [2]
    assert torch.equal(got_x, want_x)
    ref_h, _ = reference.linear_add_rms_norm(act, w, residual, weight, 1e-6)
    torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_h, want_h, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 3])
def test_linear_add_rms_norm_reads_settled_inputs_and_launches_early_at_one_row(
    table: Kernels, reference: Kernels, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    """The GEMV branch of linear_add_rms_norm hands the norm settled=True, and launch_next_early at one
    row only."""
    import ninfer.ops.triton.norm as norm

    seen: list[dict[str, object]] = []
    plain = norm.add_rms_norm_partials

    def spy(*args: object, **kwargs: object) -> object:
        seen.append({k: kwargs.get(k) for k in ("settled", "launch_next_early")})
        return plain(*args, **kwargs)

    monkeypatch.setattr(norm, "add_rms_norm_partials", spy)
    gen = torch.Generator().manual_seed(30 + rows)
    act, w = torch.randn(rows, 40, generator=gen), torch.randn(33, 40, generator=gen) * 40**-0.5
    residual, weight = torch.randn(rows, 33, generator=gen), torch.randn(33, generator=gen) * 0.1
    import ninfer.ops.linear as linear

    monkeypatch.setattr(linear, "takes_skinny", lambda x, w: True)  # the GEMV branch at any row count

    got_h, got_x = table.linear_add_rms_norm(act, w, residual, weight, 1e-6)

    assert seen == [{"settled": True, "launch_next_early": rows == 1}]
    want_h, want_x = reference.linear_add_rms_norm(act, w, residual, weight, 1e-6)
    torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-5)


def _flagged_ops() -> list[tuple[ModuleType, str]]:
    import ninfer.ops.triton.norm as norm

    return [(norm, "rms_norm"), (norm, "add_rms_norm"), (norm, "gated_rms_norm")]


@pytest.mark.parametrize("rows", [1, 3])
def test_norms_load_settled_inputs_and_launch_next_early_at_one_row(
    table: Kernels, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    """The fast table's norms load their bound weight and the residual stream before the PDL wait
    (settled), and let the next kernel launch early at one row only (the H200 A/B: slower at eight rows);
    the results are the plain kernels', bit for bit."""
    ops = _flagged_ops()
    plain = {name: getattr(module, name) for module, name in ops}
    seen: dict[str, dict[str, bool]] = {}
    for module, name in ops:

        def spy(*args: object, _name: str = name, **kwargs: object) -> object:
            seen[_name] = {k: v for k, v in kwargs.items() if k in ("settled", "launch_next_early")}
            return plain[_name](*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 32, generator=gen), torch.randn(rows, 32, generator=gen)
    weight = torch.randn(32, generator=gen) * 0.1
    o, z = torch.randn(rows, 2, 16, generator=gen), torch.randn(rows, 2, 16, generator=gen)

    got = (
        table.rms_norm(x, weight, 1e-6),
        *table.add_rms_norm(x, residual, weight, 1e-6),
        table.gated_rms_norm(o, weight[:16], z, 1e-6),
    )
    want = (
        plain["rms_norm"](x, weight, 1e-6),
        *plain["add_rms_norm"](x, residual, weight, 1e-6),
        plain["gated_rms_norm"](o, weight[:16], z, 1e-6),
    )

    early = rows == 1
    assert seen == {
        "rms_norm": {"settled": True, "launch_next_early": early},
        "add_rms_norm": {"settled": True, "launch_next_early": early},
        "gated_rms_norm": {"launch_next_early": early},
    }
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize(("rows", "tokens_per_row"), [(1, 1), (3, 1), (3, 3)])
def test_attention_and_moe_decode_launch_next_early_at_one_row(
    table: Kernels, reference: Kernels, monkeypatch: pytest.MonkeyPatch, rows: int, tokens_per_row: int
) -> None:
    """The attention prologue, the decode attention (split and merge launches) and the decode MoE block
    (its down launch) let the next kernel launch early at one row only; the decode attention loads K/V
    before its wait only with one token per row; the results are the plain ops'."""
    import ninfer.ops.triton.attention_prologue as prologue
    import ninfer.ops.triton.moe_decode as moe_decode
    import ninfer.ops.triton.paged_decode_attention as attention

    seen: dict[str, list[bool]] = {}
    for module, name in ((prologue, "qk_norm_rope_kv_write"), (attention, "paged_decode_attention"),
                         (moe_decode, "moe_decode_block")):  # fmt: skip
        plain = getattr(module, name)

        def spy(*args: object, _name: str = name, _plain: object = plain, **kwargs: object) -> object:
            seen.setdefault(_name, []).append(bool(kwargs.get("launch_next_early")))
            if _name == "paged_decode_attention":
                seen.setdefault("settled_kv", []).append(bool(kwargs.get("settled")))
            return _plain(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(module, name, spy)
    gen = torch.Generator().manual_seed(rows)
    heads, kv_heads, dim, page, pages = 4, 2, 16, 8, 3
    variant = SimpleNamespace(
        num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=dim, rms_norm_eps=1e-6,
        num_experts_per_tok=2,
    )  # fmt: skip
    qkv = torch.randn(rows, heads * 2 * dim + 2 * kv_heads * dim, generator=gen)
    k_pages = torch.randn(rows * pages, page, kv_heads, dim, generator=gen)
    v_pages = torch.randn(rows * pages, page, kv_heads, dim, generator=gen)
    slots = torch.tensor([r * pages * page + 5 for r in range(rows)])
    norm_w, cos, sin = torch.randn(dim, generator=gen) * 0.1, torch.ones(rows, 8), torch.zeros(rows, 8)
    q = table.attention_prologue(qkv, norm_w, norm_w, cos, sin, k_pages, v_pages, slots, variant)
    table_rows = torch.arange(rows * pages, dtype=torch.int32).view(rows, pages)
    lens = torch.full((rows,), 6, dtype=torch.int32)
    o = table.gated_decode_attention(q, k_pages, v_pages, table_rows, lens, dim**-0.5, qkv, tokens_per_row)
    view = _moe_view(gen, experts=8, inter=16, hidden=24, shared=16)
    x = torch.randn(rows, 24, generator=gen)
    moe = table.moe_block(view, variant, x, True)

    early = rows == 1
    assert seen == {
        "qk_norm_rope_kv_write": [early], "paged_decode_attention": [early], "moe_decode_block": [early],
        "settled_kv": [tokens_per_row == 1],
    }  # fmt: skip
    want_o = reference.gated_decode_attention(
        q, k_pages, v_pages, table_rows, lens, dim**-0.5, qkv, tokens_per_row
    )
    assert max_rel_error(o, want_o) < 1e-5
    assert max_rel_error(moe, reference.moe_block(view, variant, x, True)) < 1e-5


@pytest.mark.parametrize("rows", [1, 3])  # one row: projection + conv kernel; 3: the conv in the GEMV
@pytest.mark.parametrize("stacked", [True, False])
def test_gdn_decode_matches_the_reference_step(
    table: Kernels, reference: Kernels, rows: int, stacked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast GDN decode step from the layer input (which columns of the stacked projection are the
    conv input, z, b and a; the conv step's pool update) against the reference step, both pools included;
    the conv kernel runs exactly when the GEMV's epilogue does not (one row, or no stacked rows). The conv
    step, its epilogue form and the recurrence read their pools as settled, and launch the next kernel
    early at one row only."""
    from ninfer.ops.triton import conv_update, gdn_decode, skinny_gemm
    from ninfer.targets.qwen3_6.view import GdnLayerView

    flags: dict[str, list[object]] = {"conv": [], "recurrence": [], "epilogue": []}
    conv_kernel, recurrence = conv_update.causal_conv1d_update_slots, gdn_decode.gdn_decode_step
    gemv = skinny_gemm.skinny_linear

    def conv_spy(*args: object, **kwargs: object) -> torch.Tensor:
        flags["conv"].append((kwargs.get("settled"), kwargs.get("launch_next_early")))
        return conv_kernel(*args, **kwargs)

    def recurrence_spy(*args: object, **kwargs: object) -> torch.Tensor:
        flags["recurrence"].append((kwargs.get("settled"), kwargs.get("launch_next_early")))
        return recurrence(*args, **kwargs)

    def gemv_spy(*args: object, **kwargs: object) -> torch.Tensor:
        if kwargs.get("conv") is not None:
            flags["epilogue"].append(kwargs["conv"].settled)
        return gemv(*args, **kwargs)

    monkeypatch.setattr(conv_update, "causal_conv1d_update_slots", conv_spy)
    monkeypatch.setattr(gdn_decode, "gdn_decode_step", recurrence_spy)
    monkeypatch.setattr(skinny_gemm, "skinny_linear", gemv_spy)

    gen = torch.Generator().manual_seed(20 + rows)
    nk, nv, dk, dv, hidden, width, slots = 2, 4, 8, 8, 24, 4, 6
    conv_dim = 2 * nk * dk + nv * dv
    stack = torch.randn(conv_dim + nv * dv + 2 * nv, hidden, generator=gen) * hidden**-0.5
    qkv, z, b, a = stack.split([conv_dim, nv * dv, nv, nv])
    view = GdnLayerView(
        in_proj_qkv=qkv, in_proj_z=z, in_proj_b=b, in_proj_a=a,
        conv_weight=torch.randn(conv_dim, width, generator=gen) * 0.5,
        dt_bias=torch.randn(nv, generator=gen), A_log=torch.randn(nv, generator=gen) * 0.5,
        norm=torch.ones(dv), out_proj=torch.randn(hidden, nv * dv, generator=gen),
        in_proj=stacked_rows((qkv, z, b, a)) if stacked else None,
    )  # fmt: skip
    assert (view.in_proj is not None) == stacked
    variant = SimpleNamespace(
        linear_key_dim=nk * dk, linear_value_dim=nv * dv, linear_num_key_heads=nk, linear_num_value_heads=nv,
        linear_key_head_dim=dk, linear_value_head_dim=dv,
    )  # fmt: skip
    batch = SimpleNamespace(
        state_in=torch.arange(rows), state_out=torch.arange(rows) + rows, fresh=torch.arange(rows) == 1,
        tokens_per_row=1, num_rows=rows,
    )  # fmt: skip
    x = torch.randn(rows, hidden, generator=gen)
    conv_pool = torch.randn(slots, conv_dim, width - 1, generator=gen)
    rec_pool = torch.randn(slots, nv, dk, dv, generator=gen) * 0.1
    want_conv, want_rec = conv_pool.clone(), rec_pool.clone()

    want_o, want_z = reference.gdn_decode(view, variant, x, want_conv, want_rec, batch)
    got_o, got_z = table.gdn_decode(view, variant, x, conv_pool, rec_pool, batch)

    epilogue = stacked and rows > 1
    early = rows == 1
    assert flags == {
        "conv": [] if epilogue else [(True, early)],
        "recurrence": [(True, early)],
        "epilogue": [True] if epilogue else [],
    }

    torch.testing.assert_close(got_z, want_z, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_o, want_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(conv_pool, want_conv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rec_pool, want_rec, rtol=1e-4, atol=1e-5)
