"""The op tables of `ninfer.targets.qwen3_6.kernels`: selection rules, and the fast prefill attention
(plain SDPA, so it runs on CPU too) against the reference paged attention."""

from __future__ import annotations

import pytest
import torch

from ninfer.ops.attention import paged_attention
from ninfer.targets.qwen3_6.kernels import REFERENCE, _sdpa_prefill_attention, select_kernels

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
    query_start = torch.tensor([0, 9, 14, 15], dtype=torch.int32)
    context_lens = torch.tensor(contexts, dtype=torch.int32)

    args = (q, k_pages, v_pages, table, query_start, context_lens, dim**-0.5)
    torch.testing.assert_close(_sdpa_prefill_attention(*args), paged_attention(*args), rtol=1e-5, atol=1e-5)
