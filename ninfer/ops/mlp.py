"""Reference SwiGLU MLP of Qwen3.6 (dense layers and the MoE shared expert).

Projections run as `F.linear` in the input dtype (fp32 accumulation, like HF's nn.Linear and cuBLAS):
upcasting real-size weights to fp32 on every call would triple the reference's memory traffic without
changing fp32 results. The SiLU gate product is formed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["swiglu", "swiglu_mlp"]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, cast to gate's dtype."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def swiglu_mlp(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """down(silu(x @ w_gate.T) * (x @ w_up.T)); w_gate/w_up [I, H], w_down [H, I]; x [..., H] -> [..., H]."""
    dtype = x.dtype
    hidden = swiglu(F.linear(x, w_gate.to(dtype)), F.linear(x, w_up.to(dtype)))
    return F.linear(hidden, w_down.to(dtype))
