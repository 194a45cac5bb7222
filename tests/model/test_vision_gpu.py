"""The vision tower on CUDA (fp32 and bf16) against the CPU fp32 reference: the same function, several
images of mixed sizes and a two-frame grid. Imports neither Pillow nor transformers (the GPU image may
lack them)."""

from __future__ import annotations

import pytest
import torch
from qwen3_6_model_harness import rel_err, tiny_view

from ninfer.targets.qwen3_6.vision import vision_embeddings

GRIDS = [(1, 4, 6), (1, 16, 16), (1, 2, 28), (2, 4, 4), (1, 4, 6), (1, 32, 48)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_tower_on_cuda_matches_cpu(dtype: torch.dtype, tolerance: float) -> None:
    view = tiny_view("qwen3_6_tiny")
    assert view.vision is not None and view.variant.vision is not None
    rows = sum(t * h * w for t, h, w in GRIDS)
    pv = torch.randn(rows, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(3))
    cuda = view.to("cuda", dtype)
    assert cuda.vision is not None
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, whatever another test left set
    try:
        with torch.no_grad():
            expected = vision_embeddings(view.vision, view.variant.vision, pv, GRIDS)
            got = vision_embeddings(cuda.vision, view.variant.vision, pv.cuda(), GRIDS)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert got.dtype == dtype and got.device.type == "cuda"
    err = rel_err(got, expected)
    print(f"cuda {dtype}: rel err {err:.2e}")
    assert err <= tolerance
