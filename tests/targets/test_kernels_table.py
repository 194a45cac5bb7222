"""The op tables of `ninfer.targets.qwen3_6.kernels`: selection rules, the SDPA prefill attention (the
Triton kernel's baseline, plain torch, so it runs on CPU too; `ninfer.ops.attention`) and the reference
table's gated prefill attention against the reference paged attention, and fla's
varlen chunk table (`ninfer.ops.gdn`), kept per step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ninfer.ops.attention import gated_output, paged_attention, sdpa_prefill_attention
from ninfer.ops.gdn import fla_varlen
from ninfer.targets.qwen3_6.kernels import REFERENCE, select_kernels
from ninfer.targets.qwen3_6.model import StepBatch

torch.set_num_threads(1)


def test_selection_rules() -> None:
    cpu = torch.device("cpu")
    assert select_kernels(cpu) is REFERENCE and select_kernels(cpu, "reference") is REFERENCE
    with pytest.raises(ValueError, match="CUDA"):
        select_kernels(cpu, "fast")
    with pytest.raises(ValueError, match="'auto', 'reference' or 'fast'"):
        select_kernels(cpu, "fastest")


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 1), (8, 2)])
def test_sdpa_prefill_attention_equals_reference(heads: int, kv_heads: int) -> None:
    """Rows: a whole prompt (square causal), a chunk after a cached prefix (bottom-right causal), and a
    one-token row; page size 4 divides none of the lengths; the block table is shuffled."""
    gen = torch.Generator().manual_seed(heads)
    page_size, dim = 4, 16
    queries, contexts = [9, 5, 1], [9, 23, 14]
    pages_per_row = [-(-c // page_size) for c in contexts]
    order = torch.randperm(sum(pages_per_row), generator=gen).int()
    table = torch.zeros(3, max(pages_per_row), dtype=torch.int32)
    start = 0
    for row, n in enumerate(pages_per_row):
        table[row, :n] = order[start : start + n]
        start += n
    k_pages = torch.randn(sum(pages_per_row), page_size, kv_heads, dim, generator=gen)
    v_pages = torch.randn(sum(pages_per_row), page_size, kv_heads, dim, generator=gen)
    q = torch.randn(sum(queries), heads, dim, generator=gen)
    qkv = torch.randn(sum(queries), heads * 2 * dim, generator=gen)
    query_start = torch.tensor([0, 9, 14, 15], dtype=torch.int32)
    context_lens = torch.tensor(contexts, dtype=torch.int32)

    want = paged_attention(q, k_pages, v_pages, table, query_start, context_lens, dim**-0.5)
    for host in (False, True):  # row bounds read back from the device, or the builder's host copies
        batch = _batch(query_start, context_lens, table, host)
        got = sdpa_prefill_attention(q, k_pages, v_pages, batch, dim**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        gated = REFERENCE.gated_prefill_attention(q, k_pages, v_pages, batch, dim**-0.5, qkv)
        torch.testing.assert_close(gated, gated_output(want, qkv))


def _batch(query_start: torch.Tensor, lens: torch.Tensor, table: torch.Tensor, host: bool) -> StepBatch:
    n, b = int(query_start[-1]), len(lens)
    return StepBatch(
        token_ids=torch.zeros(n, dtype=torch.long),
        positions=torch.zeros(3, n, dtype=torch.long),
        query_start=query_start,
        context_lens=lens,
        block_table=table,
        slot_mapping=torch.zeros(n, dtype=torch.long),
        state_in=torch.zeros(b, dtype=torch.long),
        state_out=torch.zeros(b, dtype=torch.long),
        fresh=torch.zeros(b, dtype=torch.bool),
        query_start_host=tuple(query_start.tolist()) if host else None,
        context_lens_host=tuple(lens.tolist()) if host else None,
    )


def test_fla_varlen_chunk_table() -> None:
    """Rows of 130, 1 and 64 tokens: 3 + 1 + 1 chunks of 64, each (row, chunk within the row); built once
    per step (the same object for every layer of one batch, a new one for the next batch), kept by the
    step itself: steps of two Programs taken in turn keep their own tables, and nothing outlives a step."""
    query_start = torch.tensor([0, 130, 131, 195], dtype=torch.int32)
    context_lens = torch.tensor([130, 1, 64], dtype=torch.int32)
    batch = _batch(query_start, context_lens, torch.zeros(3, 1, dtype=torch.int32), host=True)
    meta = fla_varlen(batch)
    assert meta.chunk_indices.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [2, 0]]
    assert meta.chunk_indices.dtype == torch.int32 and meta.cu_seqlens_cpu.tolist() == [0, 130, 131, 195]
    assert fla_varlen(batch) is meta
    other = _batch(query_start.clone(), context_lens, torch.zeros(3, 1, dtype=torch.int32), host=True)
    other_meta = fla_varlen(other)
    assert other_meta is not meta
    assert fla_varlen(batch) is meta and fla_varlen(other) is other_meta  # interleaved steps keep theirs
    assert dataclasses.replace(batch).memo == {}  # a replaced batch is another step
