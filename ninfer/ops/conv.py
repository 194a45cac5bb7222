"""Reference depthwise causal conv1d with SiLU (the GDN short conv), plain PyTorch, fp32 math.

Layout is token-major ([T, C] / [B, C]) because the engine keeps flattened token batches; the state is
channel-major [C, K-1] (the last K-1 inputs), as vLLM/SGLang-style conv caches keep it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "causal_conv1d_update"]


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """y = silu(depthwise causal conv of x [T, C] with weight [C, K]), left context = initial_state.

    initial_state [C, K-1] holds the K-1 inputs before x (zeros when None). Returns y [T, C] in x's dtype
    and final_state [C, K-1] (the last K-1 inputs of initial_state ++ x, so it still contains part of the
    initial state when T < K-1), in x's dtype.
    """
    channels = x.shape[1]
    kernel = weight.shape[1]
    history = x.new_zeros(channels, kernel - 1) if initial_state is None else initial_state.to(x.dtype)
    padded = torch.cat((history, x.t()), dim=1)  # [C, K-1+T] in x's dtype: the state keeps model dtype
    out = F.conv1d(padded.float().unsqueeze(0), weight.float().unsqueeze(1), groups=channels)[0]  # [C, T]
    y = F.silu(out).t().to(x.dtype)
    final_state = padded[:, padded.shape[1] - (kernel - 1) :].contiguous()
    return y, final_state


def causal_conv1d_update(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a batch: x [B, C], state [B, C, K-1], weight [C, K] -> (y [B, C], new_state).

    Pure: the input state is not modified; new_state [B, C, K-1] is the window shifted by x.
    """
    window = torch.cat((state.to(x.dtype), x.unsqueeze(-1)), dim=-1)  # [B, C, K]
    y = F.silu((window.float() * weight.float()).sum(-1)).to(x.dtype)
    return y, window[..., 1:].contiguous()
