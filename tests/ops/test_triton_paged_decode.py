"""Triton paged decode attention (`ninfer.ops.triton.paged_decode_attention`) against the reference
`ninfer.ops.attention.paged_decode_attention`.

CPU tests run the kernel in the Triton interpreter through a private copy of the module (TRITON_INTERPRET
is set only while that copy is loaded and run). `gpu` tests run the compiled kernel at D = 256 with the
27B (24:4) and 35B-A3B (16:2) head ratios.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from triton_interpreter import interpreted_kernels, run_interpreter_child

from ninfer.ops.attention import gated_attention_output, split_q_gate
from ninfer.ops.attention import paged_decode_attention as reference_paged_decode_attention

torch.set_num_threads(1)


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.paged_decode_attention")


def _paged_inputs(
    context_lens: list[int], n_heads: int, n_kv: int, head_dim: int, page_size: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Random q (a strided view of a q_proj output, as the model passes it), shuffled pages, int32 tables.

    Every row gets its own pages, in random order, plus spare table entries pointing at random pages.
    """
    batch = len(context_lens)
    max_pages = max(-(-n // page_size) for n in context_lens) + 1
    num_pages = batch * max_pages + 3
    q_proj = torch.randn(batch, n_heads * 2 * head_dim, generator=gen)
    q, _ = split_q_gate(q_proj, n_heads, head_dim)
    return {
        "q": q,
        "k_pages": torch.randn(num_pages, page_size, n_kv, head_dim, generator=gen),
        "v_pages": torch.randn(num_pages, page_size, n_kv, head_dim, generator=gen),
        "block_table": torch.randperm(num_pages, generator=gen)[: batch * max_pages]
        .view(batch, max_pages)
        .to(torch.int32),
        "context_lens": torch.tensor(context_lens, dtype=torch.int32),
    }


def _poison_unused_positions(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy of the inputs with NaN in every K/V slot outside the rows' contexts: a kernel that reads past
    a row's length (or a page outside its table prefix) turns its output into NaN."""
    page_size = x["k_pages"].shape[1]
    live = torch.zeros(x["k_pages"].shape[:2], dtype=torch.bool)
    for row, length in enumerate(x["context_lens"].tolist()):
        for pos in range(length):
            live[x["block_table"][row, pos // page_size], pos % page_size] = True
    poisoned = dict(x)
    for name in ("k_pages", "v_pages"):
        poisoned[name] = x[name].masked_fill(~live[:, :, None, None], float("nan"))
    return poisoned


CLOSE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize(
    ("n_heads", "n_kv", "head_dim"),
    [(12, 2, 32), (8, 1, 64), (6, 1, 32)],
    ids=["gqa6-d32", "gqa8-d64", "gqa6-kv1"],
)
@pytest.mark.parametrize(
    ("num_splits", "block_n"), [(1, 8), (3, 8), (2, 16)], ids=["1split", "3splits", "2splits"]
)
def test_paged_decode_matches_reference(
    kernels: ModuleType, n_heads: int, n_kv: int, head_dim: int, num_splits: int, block_n: int
) -> None:
    gen = torch.Generator().manual_seed(n_heads * 100 + head_dim + num_splits)
    context_lens = [1, 23, 10]  # page size 4 divides none of them
    x = _paged_inputs(context_lens, n_heads, n_kv, head_dim, 4, gen)
    scale = head_dim**-0.5
    expected = reference_paged_decode_attention(**x, scale=scale)
    out = torch.full_like(expected, float("nan"))

    got = kernels.paged_decode_attention(
        **_poison_unused_positions(x), scale=scale, out=out, num_splits=num_splits, block_n=block_n
    )

    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, expected, **CLOSE)


def test_paged_decode_empty_splits_and_padding_row(kernels: ModuleType) -> None:
    """More splits than a short row has key blocks, and a padding row of length 0 (zeros out)."""
    gen = torch.Generator().manual_seed(5)
    x = _paged_inputs([2, 0, 13, 5], 8, 1, 32, 4, gen)
    scale = 0.3
    live = [0, 2, 3]
    expected = reference_paged_decode_attention(
        **{
            **x,
            "q": x["q"][live],
            "block_table": x["block_table"][live],
            "context_lens": x["context_lens"][live],
        },
        scale=scale,
    )
    out = torch.full((4, 8, 32), float("nan"))

    got = kernels.paged_decode_attention(**x, scale=scale, out=out, num_splits=4, block_n=4)

    torch.testing.assert_close(got[live], expected, **CLOSE)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_preloaded_blocks_and_merge_columns_give_the_same_bits(kernels: ModuleType) -> None:
    """Key blocks loaded before the PDL wait (settled inputs; 0, 1 or 2 blocks, the row's newest position
    loaded again after it) and the merge over column blocks narrower than the head change no bit: the
    same blocks are attended in the same order. Rows ending inside the first block, inside the second and
    past both; empty trailing splits; a page size (3) that does not divide the key block (4); the gated
    merge too. With the early copy of each newest row poisoned (what a read that raced the prologue
    would leave), the reload must put the written row back: still the same bits."""
    gen = torch.Generator().manual_seed(17)
    n_heads, n_kv, head_dim = 8, 2, 64
    x = _paged_inputs([5, 19, 40, 0], n_heads, n_kv, head_dim, 3, gen)
    qkv = torch.randn(4, n_heads * 2 * head_dim + 2 * n_kv * head_dim, generator=gen)
    runs = {
        (settled, preload, merge_block_d, gated, stale): kernels.paged_decode_attention(
            **x, scale=0.2, num_splits=3, block_n=4, settled=settled, preload_blocks=preload,
            merge_block_d=merge_block_d, gate_qkv=qkv if gated else None, stale_newest_for_tests=stale,
        )
        for settled, preload in ((False, 1), (True, 0), (True, 1), (True, 2))
        for merge_block_d in (64, 16)
        for gated in (False, True)
        for stale in (False, True)
    }  # fmt: skip
    for (_, _, _, gated, _), got in runs.items():
        assert torch.equal(got, runs[(False, 1, 64, gated, False)])
    live = [0, 1, 2]
    rows = {name: x[name][live] for name in ("q", "block_table", "context_lens")}
    expected = reference_paged_decode_attention(**{**x, **rows}, scale=0.2)
    torch.testing.assert_close(runs[(True, 1, 16, False, False)][live], expected, **CLOSE)
    with pytest.raises(ValueError, match="preload_blocks"):
        kernels.paged_decode_attention(**x, scale=0.2, preload_blocks=-1)
    with pytest.raises(ValueError, match="merge_block_d"):
        kernels.paged_decode_attention(**x, scale=0.2, merge_block_d=0)


def test_paged_decode_allocates_output_in_q_dtype(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(9)
    x = _paged_inputs([7, 3], 6, 1, 32, 4, gen)
    got = kernels.paged_decode_attention(**x, scale=0.2)
    assert got.shape == x["q"].shape and got.dtype == x["q"].dtype and got.is_contiguous()
    torch.testing.assert_close(got, reference_paged_decode_attention(**x, scale=0.2), **CLOSE)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["1split", "3splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gated_output_equals_attention_then_sigmoid_gate(
    kernels: ModuleType, num_splits: int, dtype: torch.dtype
) -> None:
    """gate_qkv: the output gate applied where the output is written (single-split store or merge) gives
    `sigmoid_gate` of the plain output bit for bit (in fp16 too, where the output's rounding before the
    gate matters), and the reference's gated output; a padding row stays zero; a badly shaped gate_qkv is
    refused before anything launches."""
    from ninfer.ops.triton import attention_prologue

    gen = torch.Generator().manual_seed(40 + num_splits)
    n_heads, n_kv, head_dim = 6, 2, 32
    x = _paged_inputs([9, 0, 14], n_heads, n_kv, head_dim, 4, gen)
    for name in ("q", "k_pages", "v_pages"):
        x[name] = x[name].to(dtype)
    # the q projection with its gate columns, then k and v columns the gate must ignore (qkv's layout)
    qkv = torch.randn(3, n_heads * 2 * head_dim + 2 * n_kv * head_dim, generator=gen).to(dtype)
    plain = kernels.paged_decode_attention(**x, scale=0.25, num_splits=num_splits, block_n=4)
    want = attention_prologue.sigmoid_gate(plain, qkv, num_heads=n_heads, head_dim=head_dim)
    out = torch.full_like(plain, float("nan"))

    got = kernels.paged_decode_attention(
        **x, scale=0.25, num_splits=num_splits, block_n=4, out=out, gate_qkv=qkv
    )

    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.flatten(1), want)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    if dtype == torch.float32:
        gate = split_q_gate(qkv[:, : n_heads * 2 * head_dim], n_heads, head_dim)[1]
        live = [0, 2]
        rows = {name: x[name][live] for name in ("q", "block_table", "context_lens")}
        reference = reference_paged_decode_attention(**{**x, **rows}, scale=0.25)
        want_reference = gated_attention_output(reference, gate[live])
        torch.testing.assert_close(got.flatten(1)[live], want_reference, **CLOSE)
    with pytest.raises(ValueError, match="gate_qkv"):
        kernels.paged_decode_attention(**x, scale=0.25, gate_qkv=qkv[:, : n_heads * head_dim])


def test_default_num_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """About one wave of (row, kv head, split) programs on 132 SMs, at least 16 splits, at most one per
    32 positions of the table and 128 in all; 1 off CUDA (the rule needs no GPU: the SM count is patched)."""
    from types import SimpleNamespace

    from ninfer.ops.triton.paged_decode_attention import default_num_splits

    h200 = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h200)
    cuda = torch.device("cuda")
    assert default_num_splits(1, 2, 4096, cuda) == 128  # 66 wanted: the next power of two
    assert default_num_splits(1, 4, 4096, cuda) == 64  # 33 wanted
    assert default_num_splits(4, 2, 4096, cuda) == 32  # 17 -> 32
    assert default_num_splits(8, 2, 4096, cuda) == 16  # 9, raised to the floor of 16
    assert default_num_splits(8, 4, 4096, cuda) == 16  # 5, raised to 16
    assert default_num_splits(1, 2, 256, cuda) == 8  # one split per 32 positions of the table
    assert default_num_splits(1, 2, 4096, torch.device("cpu")) == 1


# ---- GPU, real shapes ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("n_heads", "n_kv"), [(24, 4), (16, 2)], ids=["27b-24:4", "35b-16:2"])
@pytest.mark.parametrize(
    "context_lens", [[1], [2049, 1, 4100], [4100, 17, 64, 1000, 3, 2500, 4099, 640]], ids=["B1", "B3", "B8"]
)
@pytest.mark.parametrize("num_splits", [None, 1], ids=["default-splits", "1split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_paged_decode_cuda_real_shapes(
    n_heads: int, n_kv: int, context_lens: list[int], num_splits: int | None, dtype: torch.dtype
) -> None:
    from ninfer.ops.triton.paged_decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(len(context_lens) * 10 + n_heads)
    head_dim, page_size = 256, 64
    x = {k: t.cuda() for k, t in _paged_inputs(context_lens, n_heads, n_kv, head_dim, page_size, gen).items()}
    for name in ("q", "k_pages", "v_pages"):
        x[name] = x[name].to(dtype)
    scale = head_dim**-0.5
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:  # the fp32 oracle on the same (rounded) values, no TF32
        expected = reference_paged_decode_attention(
            **{**x, "q": x["q"].float(), "k_pages": x["k_pages"].float(), "v_pages": x["v_pages"].float()},
            scale=scale,
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    out = torch.full_like(x["q"], float("nan"))

    got = paged_decode_attention(**x, scale=scale, out=out, num_splits=num_splits)

    close = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else CLOSE
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), expected, **close)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("n_heads", "n_kv"), [(24, 4), (16, 2)], ids=["27b-24:4", "35b-16:2"])
@pytest.mark.parametrize("context_lens", [[2049], [4100, 17, 64, 1000, 3, 2500, 4099]], ids=["B1", "B7"])
@pytest.mark.parametrize("num_splits", [None, 1], ids=["default-splits", "1split"])
def test_gated_output_cuda_real_shapes(
    n_heads: int, n_kv: int, context_lens: list[int], num_splits: int | None
) -> None:
    """bf16 at D = 256: the gated output equals `sigmoid_gate` after the plain attention, bit for bit."""
    from ninfer.ops.triton.attention_prologue import sigmoid_gate
    from ninfer.ops.triton.paged_decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(len(context_lens) + n_heads)
    head_dim, page_size, batch = 256, 64, len(context_lens)
    x = {k: t.cuda() for k, t in _paged_inputs(context_lens, n_heads, n_kv, head_dim, page_size, gen).items()}
    for name in ("q", "k_pages", "v_pages"):
        x[name] = x[name].bfloat16()
    qkv = torch.randn(batch, (n_heads * 2 + 2 * n_kv) * head_dim, generator=gen).bfloat16().cuda()
    plain = paged_decode_attention(**x, scale=head_dim**-0.5, num_splits=num_splits)
    want = sigmoid_gate(plain, qkv, num_heads=n_heads, head_dim=head_dim)
    out = torch.full_like(plain, float("nan"))

    got = paged_decode_attention(**x, scale=head_dim**-0.5, num_splits=num_splits, out=out, gate_qkv=qkv)

    assert not got.isnan().any()
    assert torch.equal(got.flatten(1), want)
