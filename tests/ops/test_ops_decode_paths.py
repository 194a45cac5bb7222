"""Graph-capturable decode variants equal the general reference ops they stand in for."""

from __future__ import annotations

import pytest
import torch

from ninfer.ops.attention import kv_write, paged_attention, paged_decode_attention
from ninfer.ops.moe import moe_experts, moe_experts_gathered, moe_route

torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_equals_paged_attention(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    n_heads, n_kv, d, page, max_pages, n_pages = 6, 2, 16, 5, 7, 40
    k_pages = torch.randn(n_pages, page, n_kv, d, generator=g).to(dtype)
    v_pages = torch.randn(n_pages, page, n_kv, d, generator=g).to(dtype)
    lens = torch.tensor([1, 9, 33, 35, 12], dtype=torch.int32)  # 35 = the full table width
    table = torch.randperm(n_pages, generator=g)[: 5 * max_pages].view(5, max_pages).int()
    q = torch.randn(5, n_heads, d, generator=g).to(dtype)
    # a large stale key/value just past each row's length must not leak into its output
    rows = [r for r, n in enumerate(lens.tolist()) if n < page * max_pages]
    slots = torch.tensor([int(table[r, int(lens[r]) // page]) * page + int(lens[r]) % page for r in rows])
    stale = torch.full((len(rows), n_kv, d), 100.0).to(dtype)
    kv_write(k_pages, v_pages, stale, stale, slots)
    expected = paged_attention(q, k_pages, v_pages, table, torch.arange(6, dtype=torch.int32), lens, 0.25)
    actual = paged_decode_attention(q, k_pages, v_pages, table, lens, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def test_moe_experts_gathered_equals_loop() -> None:
    g = torch.Generator().manual_seed(1)
    n, h, e, i, k = 7, 16, 8, 12, 3
    x = torch.randn(n, h, generator=g)
    router = torch.randn(e, h, generator=g)
    gate_up = torch.randn(e, 2 * i, h, generator=g) * 0.2
    down = torch.randn(e, h, i, generator=g) * 0.2
    weights, ids = moe_route(x, router, k)
    expected = moe_experts(x, weights, ids, gate_up, down).float()
    torch.testing.assert_close(
        moe_experts_gathered(x, weights, ids, gate_up, down), expected, rtol=1e-5, atol=1e-5
    )
