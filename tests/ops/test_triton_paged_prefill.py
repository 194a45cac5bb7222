"""Triton paged prefill attention (`ninfer.ops.triton.paged_prefill_attention`) against the reference
`ninfer.ops.attention.paged_attention` (and its gate against `gated_output`), and its DFlash block form
(not causal, sliding window) against `paged_block_attention`.

CPU tests run the kernel in fp32 in the Triton interpreter (a child process, `triton_interpreter`; the
interpreter's bf16 `tl.dot` returns garbage in Triton 3.8, so bf16 is checked compiled only); `gpu` tests
run the compiled kernel in bf16 at D = 256 with the 27B (24:4) and 35B-A3B (16:2) head ratios, against
the fp32 reference and against the SDPA path it replaces.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from triton_interpreter import interpreted_kernels, max_rel_error, run_interpreter_child

from ninfer.ops.attention import gated_output, paged_attention, split_q_gate

torch.set_num_threads(1)


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.paged_prefill_attention")


def _inputs(
    rows: list[tuple[int, int]], n_heads: int, n_kv: int, head_dim: int, page_size: int, *, padding: int = 0,
    dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """rows: (queries, context length) each. q is a strided view of an interleaved q projection (as the
    model passes it), which is also the gate's source; every row owns shuffled pages; K/V slots outside
    every context are NaN, so a read past a row's length or outside its pages shows in the output."""
    gen = torch.Generator().manual_seed(seed)
    max_pages = max(-(-ctx // page_size) for _, ctx in rows) + 1
    num_pages = len(rows) * max_pages + 2
    n = sum(q for q, _ in rows) + padding
    qkv = torch.randn(n, n_heads * 2 * head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_pages, generator=gen)[: len(rows) * max_pages].view(len(rows), max_pages)
    k_pages = torch.randn(num_pages, page_size, n_kv, head_dim, generator=gen).to(dtype)
    v_pages = torch.randn(num_pages, page_size, n_kv, head_dim, generator=gen).to(dtype)
    live = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for row, (_, ctx) in enumerate(rows):
        for pos in range(ctx):
            live[table[row, pos // page_size], pos % page_size] = True
    k_pages = k_pages.masked_fill(~live[:, :, None, None], float("nan"))
    v_pages = v_pages.masked_fill(~live[:, :, None, None], float("nan"))
    starts = [0]
    for q, _ in rows:
        starts.append(starts[-1] + q)
    x = {
        "qkv": qkv,
        "k_pages": k_pages,
        "v_pages": v_pages,
        "block_table": table.to(torch.int32),
        "query_start": torch.tensor(starts, dtype=torch.int32),
        "context_lens": torch.tensor([ctx for _, ctx in rows], dtype=torch.int32),
    }
    x = {name: t.to(device) for name, t in x.items()}
    x["q"] = split_q_gate(x["qkv"], n_heads, head_dim)[0]
    return x


def _reference(x: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """The reference in fp32 from the same (possibly bf16) inputs; tokens past the rows stay zero."""
    f = {name: (t.float() if t.is_floating_point() else t) for name, t in x.items()}
    return paged_attention(
        f["q"], f["k_pages"], f["v_pages"], f["block_table"], f["query_start"], f["context_lens"], scale
    )


def _run(kernels: ModuleType, x: dict[str, torch.Tensor], scale: float, **kwargs: object) -> torch.Tensor:
    return kernels.paged_prefill_attention(
        x["q"], x["k_pages"], x["v_pages"], x["block_table"], x["query_start"], x["context_lens"], scale,
        **kwargs,
    )  # fmt: skip


# (queries, context) per row: a fresh prompt, a chunk after a prefix, one query, a row with no queries,
# chunks that start and end off the tile and page boundaries
ROWS = [(37, 37), (21, 90), (1, 45), (0, 12), (50, 131)]


@pytest.mark.parametrize(
    ("n_heads", "n_kv", "head_dim"), [(6, 2, 32), (8, 1, 16), (4, 4, 32)], ids=["gqa3", "gqa8", "mha"]
)
@pytest.mark.parametrize(
    ("page_size", "block_m", "block_n"), [(16, 16, 16), (32, 32, 16), (8, 16, 32)],
    ids=["page=block", "block-in-page", "block-across-pages"],
)  # fmt: skip
def test_prefill_matches_the_reference(
    kernels: ModuleType, n_heads: int, n_kv: int, head_dim: int, page_size: int, block_m: int, block_n: int
) -> None:
    x = _inputs(ROWS, n_heads, n_kv, head_dim, page_size, padding=5, seed=n_heads * 7 + page_size)
    scale = head_dim**-0.5
    out = torch.full_like(x["q"], 7.0, memory_format=torch.contiguous_format)
    got = _run(kernels, x, scale, out=out, tiles=kernels.PrefillTiles(block_m, block_n, 4, 1))
    want = _reference(x, scale)
    live = int(x["query_start"][-1])
    assert got is out
    torch.testing.assert_close(got[:live], want[:live], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[live:], torch.full_like(got[live:], 7.0)), "padding tokens must not be written"


@pytest.mark.parametrize("padding", [0, 3, 40], ids=["unpadded", "padded-in-tile", "padded-tiles"])
def test_gated_output_matches_the_reference_gate(kernels: ModuleType, padding: int) -> None:
    """Gated, and with ``zero_padding`` (a prefill graph's step): the reference's zeros past the rows."""
    x = _inputs(ROWS, 6, 2, 32, 16, padding=padding, seed=3)
    scale = 32**-0.5
    out = torch.full((x["q"].shape[0], 6 * 32), 7.0)
    tiles = kernels.PrefillTiles(16, 16, 4, 1)
    got = _run(kernels, x, scale, gate_qkv=x["qkv"], zero_padding=True, out=out, tiles=tiles)
    want = gated_output(_reference(x, scale), x["qkv"])
    assert got is out
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_empty_rows_anywhere(kernels: ModuleType) -> None:
    """Rows without queries first, between others and last (the padding after an empty last row is still
    zeroed), gated: each empty row owns one query block that must write nothing."""
    rows = [(0, 5), (12, 12), (0, 7), (0, 3), (9, 40), (0, 8)]
    x = _inputs(rows, 4, 2, 16, 16, padding=20, seed=11)
    out = torch.full((x["q"].shape[0], 4 * 16), 7.0)
    tiles = kernels.PrefillTiles(16, 16, 4, 1)
    got = _run(kernels, x, 0.25, gate_qkv=x["qkv"], zero_padding=True, out=out, tiles=tiles)
    torch.testing.assert_close(got, gated_output(_reference(x, 0.25), x["qkv"]), rtol=1e-5, atol=1e-5)


def test_default_tiles_on_a_long_row(kernels: ModuleType) -> None:
    """The default launch shape (64 queries, 32 keys) over a row that needs both loops several times."""
    x = _inputs([(130, 300)], 4, 2, 32, 64, seed=9)
    torch.testing.assert_close(_run(kernels, x, 0.2), _reference(x, 0.2), rtol=1e-5, atol=1e-5)


# a DFlash drafter's block: T queries a row, the last T of contexts inside, at and past the window
BLOCK_CONTEXTS = [16, 37, 90, 131]


@pytest.mark.parametrize(
    ("causal", "window"), [(False, None), (True, 16), (False, 16), (True, None), (True, 200)]
)
@pytest.mark.parametrize(
    ("tokens", "page_size", "tiles"),
    [(16, 16, (16, 16)), (5, 8, (16, 32)), (20, 16, (16, 16)), (16, 32, None)],
    ids=["block16", "k4-across-pages", "row-in-two-tiles", "default-tiles"],
)
def test_block_attention_matches_the_drafter_reference(
    kernels: ModuleType, causal: bool, window: int | None, tokens: int, page_size: int,
    tiles: tuple[int, int] | None,
) -> None:  # fmt: skip
    from ninfer.ops.attention import fast_paged_block_attention, paged_block_attention

    rows = [(tokens, max(ctx, tokens)) for ctx in BLOCK_CONTEXTS]
    x = _inputs(rows, 4, 2, 16, page_size, seed=tokens + page_size)
    scale = 16**-0.5
    want = paged_block_attention(
        x["q"], x["k_pages"], x["v_pages"], x["block_table"], x["context_lens"], scale, causal=causal,
        window=window,
    )  # fmt: skip
    if tiles is None:
        got = fast_paged_block_attention(
            x["q"], x["k_pages"], x["v_pages"], x["block_table"], x["context_lens"], scale, causal=causal,
            window=window,
        )  # fmt: skip
    else:
        got = _run(kernels, x, scale, tiles=kernels.PrefillTiles(*tiles, 4, 1), causal=causal, window=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if not causal or (window or 10**9) < max(BLOCK_CONTEXTS):  # the control: the plain kernel differs
        assert not torch.allclose(_run(kernels, x, scale), want, rtol=1e-3, atol=1e-3)


def test_bad_shapes_are_named(kernels: ModuleType) -> None:
    x = _inputs([(4, 4)], 4, 2, 16, 16)
    with pytest.raises(ValueError, match="query_start"):
        kernels.paged_prefill_attention(
            x["q"], x["k_pages"], x["v_pages"], x["block_table"], x["query_start"][:1], x["context_lens"], 1.0
        )
    with pytest.raises(ValueError, match="kv heads"):
        _run(kernels, {**x, "q": x["q"][:, :3]}, 1.0)
    with pytest.raises(ValueError, match="gate_qkv"):
        _run(kernels, x, 1.0, gate_qkv=x["qkv"][:, :8])
    with pytest.raises(ValueError, match="power of two"):
        kernels.PrefillTiles(block_m=48)
    with pytest.raises(ValueError, match="window must be >= 1"):
        _run(kernels, x, 1.0, window=0)


# ---- compiled, D = 256 -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("n_heads", "n_kv"), [(24, 4), (16, 2)], ids=["27b", "35b"])
def test_prefill_on_cuda_matches_the_reference_and_sdpa(n_heads: int, n_kv: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from types import SimpleNamespace

    from ninfer.ops.attention import sdpa_prefill_attention
    from ninfer.ops.triton.paged_prefill_attention import paged_prefill_attention

    rows = [(300, 300), (129, 1500), (1, 77), (64, 64)]
    x = _inputs(rows, n_heads, n_kv, 256, 64, dtype=torch.bfloat16, device="cuda", padding=3, seed=n_heads)
    scale = 256**-0.5
    live = int(x["query_start"][-1])
    got = paged_prefill_attention(
        x["q"], x["k_pages"], x["v_pages"], x["block_table"], x["query_start"], x["context_lens"], scale
    )
    want = _reference(x, scale)
    assert max_rel_error(got[:live], want[:live]) < 2e-2
    facts = SimpleNamespace(
        block_table=x["block_table"], query_bounds=lambda: x["query_start"].tolist(),
        context_lengths=lambda: x["context_lens"].tolist(),
    )  # fmt: skip
    sdpa = sdpa_prefill_attention(x["q"], x["k_pages"], x["v_pages"], facts, scale)
    assert max_rel_error(got[:live], sdpa[:live]) < 2e-2
    gated = paged_prefill_attention(
        x["q"], x["k_pages"], x["v_pages"], x["block_table"], x["query_start"], x["context_lens"], scale,
        gate_qkv=x["qkv"],
    )  # fmt: skip
    from ninfer.ops.triton.attention_prologue import sigmoid_gate

    gate_after = sigmoid_gate(got, x["qkv"], num_heads=n_heads, head_dim=256)  # the op the gate replaces
    assert torch.equal(gated[:live], gate_after[:live])


@pytest.mark.gpu
@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, 2048)], ids=["full", "sliding"])
def test_block_attention_on_cuda_at_the_27b_drafters_shape(causal: bool, window: int | None) -> None:
    """The 27B drafter's heads (32 query, 8 KV, D = 128), a block of 16, contexts inside and past its
    2,048-position window, bf16 against the fp32 reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ninfer.ops.attention import fast_paged_block_attention, paged_block_attention

    rows = [(16, ctx) for ctx in (16, 700, 2048, 3001)]
    x = _inputs(rows, 32, 8, 128, 64, dtype=torch.bfloat16, device="cuda", seed=4)
    scale = 128**-0.5
    args = (x["q"], x["k_pages"], x["v_pages"], x["block_table"], x["context_lens"], scale)
    got = fast_paged_block_attention(*args, causal=causal, window=window)
    f = [t.float() if t.is_floating_point() else t for t in args[:5]]
    want = paged_block_attention(*f, scale, causal=causal, window=window)
    assert max_rel_error(got, want) < 2e-2
