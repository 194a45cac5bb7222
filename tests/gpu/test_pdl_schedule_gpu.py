"""The real packages' decode steps pass the PDL schedule check (`ninfer.ops.triton.pdl.checked_schedule`).

Four layers of each package's real dims (three GDN layers and an attention layer), random weights and
state, the fast table, bf16: one decode step recorded eagerly for B = 1 and 8 rows of T = 1 and 4 tokens
(a verify of three drafted tokens), and the one-token steps recorded again inside a CUDA-graph capture, as
the Program captures them: the same launches, and the check passes there too (recording reads no device
value, so it does not break the capture).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parents[1] / "ops"))  # the shared step builder
from pdl_steps import random_store, uniform_step  # noqa: E402

from ninfer.ops.triton import pdl  # noqa: E402
from ninfer.targets.qwen3_6.binder import random_model_view  # noqa: E402
from ninfer.targets.qwen3_6.kernels import select_kernels  # noqa: E402
from ninfer.targets.qwen3_6.model import forward  # noqa: E402
from ninfer.targets.registry import get_package  # noqa: E402

CONTEXT, PAGE_SIZE = 300, 64


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("package", ["qwen3_6_35b_a3b", "qwen3_6_27b"])
def test_decode_step_passes_the_schedule_check(package: str, rows: int, tokens: int) -> None:
    device = torch.device("cuda")
    variant = dataclasses.replace(get_package(package).variant, num_layers=4)
    view = random_model_view(variant, seed=0, dtype=torch.bfloat16, device=device)
    kernels = select_kernels(device, "fast")
    batch = uniform_step(rows, tokens, CONTEXT, PAGE_SIZE, device)
    store = random_store(variant, rows, tokens, CONTEXT, PAGE_SIZE, torch.bfloat16, device)

    def step() -> torch.Tensor:
        return forward(view, variant, batch, store, logits="last", kernels=kernels).logits

    with torch.inference_mode():
        with pdl.checked_schedule(tokens_per_row=tokens) as eager:
            step()
        kinds = {launch.kernel for launch in eager.launches}
        assert "paged_decode_attention._paged_decode_kernel" in kinds and "norm._rms_norm_kernel" in kinds
        assert any(launch.launch_next_early for launch in eager.launches) == (rows * tokens == 1)
        if tokens > 1:
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # the check outermost: it runs once the capture has ended
        with pdl.checked_schedule(tokens_per_row=tokens) as captured, torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
    assert [launch.kernel for launch in captured.launches] == [launch.kernel for launch in eager.launches]
    assert [launch.launch_next_early for launch in captured.launches] == [
        launch.launch_next_early for launch in eager.launches
    ]
