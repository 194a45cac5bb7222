"""Every reference op runs unchanged on CUDA and agrees with its CPU result (fp32, TF32 off)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ninfer.ops.attention import (
    causal_attention,
    gated_attention_output,
    kv_write,
    paged_attention,
    split_q_gate,
)
from ninfer.ops.conv import causal_conv1d, causal_conv1d_update
from ninfer.ops.gated_delta import chunk_gated_delta_rule, gdn_gating, recurrent_gated_delta_rule
from ninfer.ops.mlp import swiglu_mlp
from ninfer.ops.moe import moe_block
from ninfer.ops.norm import gated_rms_norm, l2norm, rms_norm
from ninfer.ops.rope import apply_partial_rope, mrope_cos_sin

pytestmark = pytest.mark.gpu
torch.set_num_threads(1)


def _cases() -> dict[str, Callable[[torch.device], object]]:
    gen = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    x, w, z = r(9, 32), r(32) * 0.3, r(9, 32)
    positions = torch.randint(0, 1000, (3, 9), generator=gen)
    heads = r(9, 4, 64)
    conv_x, conv_w, conv_state = r(9, 12), r(12, 4), r(12, 3)
    a, b, A_log, dt_bias = r(9, 4), r(9, 4), r(4), r(4)
    q, k, v, state = r(70, 4, 16), r(70, 4, 16), r(70, 4, 24), r(4, 16, 24) * 0.3
    aq, ak, av = r(11, 6, 16), r(11, 2, 16), r(11, 2, 16)
    hidden = r(7, 32)
    moe_w = [r(8, 32), r(8, 32, 32) * 0.2, r(8, 32, 16) * 0.2, r(24, 32), r(24, 32), r(32, 24), r(1, 32)]

    def paged(dev: torch.device) -> torch.Tensor:
        k_pages = torch.zeros(6, 3, 2, 16, device=dev)
        v_pages = torch.zeros_like(k_pages)
        slots = (torch.tensor([4, 1, 5, 0])[torch.arange(11) // 3] * 3 + torch.arange(11) % 3).to(dev)
        kv_write(k_pages, v_pages, ak.to(dev), av.to(dev), slots)
        table = torch.tensor([[4, 1, 5, 0]], dtype=torch.int32, device=dev)
        q_start = torch.tensor([0, 5], dtype=torch.int32, device=dev)
        return paged_attention(
            aq[6:].to(dev), k_pages, v_pages, table, q_start, torch.tensor([11]).to(dev), 0.25
        )

    def rope(dev: torch.device) -> torch.Tensor:
        cos, sin = mrope_cos_sin(positions.to(dev), 16, 1e7, (3, 3, 2))
        return apply_partial_rope(heads.to(dev), cos, sin)

    return {
        "rms_norm": lambda d: rms_norm(x.to(d), w.to(d), 1e-6),
        "gated_rms_norm": lambda d: gated_rms_norm(x.to(d), (1 + w).to(d), z.to(d), 1e-6),
        "l2norm": lambda d: l2norm(x.to(d)),
        "rope": rope,
        "causal_conv1d": lambda d: causal_conv1d(conv_x.to(d), conv_w.to(d), conv_state.to(d)),
        "causal_conv1d_update": lambda d: causal_conv1d_update(conv_x.to(d), r(9, 12, 3).to(d), conv_w.to(d)),
        "gdn_gating": lambda d: gdn_gating(a.to(d), b.to(d), A_log.to(d), dt_bias.to(d)),
        "chunk": lambda d: chunk_gated_delta_rule(
            *(t.to(d) for t in (q, k, v)),
            *gdn_gating(r(70, 4).to(d), r(70, 4).to(d), A_log.to(d), dt_bias.to(d)),
            state.to(d),
        ),
        "recurrent": lambda d: recurrent_gated_delta_rule(
            *(t.to(d) for t in (q, k, v)),
            *gdn_gating(r(70, 4).to(d), r(70, 4).to(d), A_log.to(d), dt_bias.to(d)),
            state.to(d),
            return_all_states=True,
        ),
        "split_q_gate": lambda d: split_q_gate(r(5, 4 * 2 * 8).to(d), 4, 8),
        "causal_attention": lambda d: causal_attention(aq.to(d), ak.to(d), av.to(d), 0.25),
        "paged_attention": paged,
        "gated_attention_output": lambda d: gated_attention_output(aq.to(d), r(11, 96).to(d)),
        "swiglu_mlp": lambda d: swiglu_mlp(hidden.to(d), *(t.to(d) for t in moe_w[3:6])),
        "moe_block": lambda d: moe_block(hidden.to(d), *(t.to(d) for t in moe_w), 2),
    }


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(_cases()))
def test_op_on_cuda_matches_cpu(name: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # Each call re-seeds its inputs, so CPU and CUDA see identical values.
    cpu = _cases()[name](torch.device("cpu"))
    cuda = _cases()[name](torch.device("cuda"))
    cpu_list = list(cpu) if isinstance(cpu, tuple) else [cpu]
    cuda_list = list(cuda) if isinstance(cuda, tuple) else [cuda]
    for got, expected in zip(cuda_list, cpu_list, strict=True):
        assert got.device.type == "cuda"
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-5)
