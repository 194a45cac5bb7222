"""Reference interleaved M-RoPE of Qwen3.6 with partial rotary (plain PyTorch, fp32 math), and the
vision tower's 2-D rotary with its q/k/v relayout (`vision_qkv_rotary`; fast form
`ninfer.ops.triton.vision_rope.vision_qkv_rotary`, one launch).

Text tokens have equal T/H/W positions, which reduces this to ordinary partial RoPE; image tokens
carry distinct H/W positions from the frontend's rope index.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["mrope_inv_freq", "mrope_cos_sin", "rope_cos_sin", "apply_partial_rope", "vision_qkv_rotary"]


_CONSTANTS: dict[tuple[object, ...], torch.Tensor] = {}


Builder = Callable[[], torch.Tensor]


def _constant(key: tuple[object, ...], device: torch.device, build: Builder) -> torch.Tensor:
    """A small constant tensor, built once per key and device and shared (read-only): rebuilt per step it
    would be a handful of kernels at the head of every decode graph. Never cached when first built inside
    a CUDA-graph capture, where its values would exist only once the graph replays."""
    key = (*key, device)
    cached = _CONSTANTS.get(key)
    if cached is not None:
        return cached
    with torch.inference_mode(False):  # a plain tensor, usable outside inference mode too
        built = build()
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _CONSTANTS[key] = built
    return built


def mrope_inv_freq(rotary_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """inv_freq_j = theta^(-2j / rotary_dim) for j < rotary_dim / 2, fp32, computed as HF does (a shared
    constant: do not write to it)."""
    device = torch.device(device if device is not None else "cpu")

    def build() -> torch.Tensor:
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
        return 1.0 / (theta**exponents)

    return _constant(("inv_freq", rotary_dim, float(theta)), device, build)


def _axis_of_frequency(half: int, mrope_section: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """Which position row (0 = T, 1 = H, 2 = W) drives each frequency under interleaved M-RoPE."""

    def build() -> torch.Tensor:
        j = torch.arange(half, device=device)
        axis = torch.zeros(half, dtype=torch.long, device=device)
        axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
        return axis

    return _constant(("axis", half, tuple(mrope_section)), device, build)


def mrope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, mrope_section: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [N, rotary_dim] fp32 for 3-D positions [3, N] (rows T, H, W).

    Equals HF `Qwen3_5TextRotaryEmbedding` (interleaved): each frequency takes its angle from one
    position row, and the half-table is duplicated (`cat(angle, angle)`) for rotate-half.
    """
    if positions.dim() != 2 or positions.shape[0] != 3:
        raise ValueError(f"positions must be [3, N], got {tuple(positions.shape)}")
    half = rotary_dim // 2
    inv_freq = mrope_inv_freq(rotary_dim, theta, positions.device)
    angles_per_axis = positions.float()[..., None] * inv_freq  # [3, N, half]
    axis = _axis_of_frequency(half, mrope_section, positions.device)
    # angle[n, j] = angles_per_axis[axis[j], n, j]
    angle = angles_per_axis.gather(0, axis.view(1, 1, half).expand(1, positions.shape[1], half))[0]
    emb = torch.cat((angle, angle), dim=-1)
    return emb.cos(), emb.sin()


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [N, dim] fp32 of plain 1-D RoPE over the whole head (HF `Qwen3RotaryEmbedding`,
    default type) for positions [N]: `apply_partial_rope` with these rotates every dim."""
    angle = positions.float()[:, None] * mrope_inv_freq(dim, theta, positions.device)
    emb = torch.cat((angle, angle), dim=-1)
    return emb.cos(), emb.sin()


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first rotary_dim dims of x [N, heads, head_dim]; the rest pass through.

    Pairs are (i, i + rotary_dim/2) inside the rotary part; cos/sin are [N, rotary_dim]. fp32 math.
    """
    rotary_dim = cos.shape[-1]
    x32 = x.float()
    x_rot, x_pass = x32[..., :rotary_dim], x32[..., rotary_dim:]
    first, second = x_rot[..., : rotary_dim // 2], x_rot[..., rotary_dim // 2 :]
    rotated_half = torch.cat((-second, first), dim=-1)
    cos_b, sin_b = cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)  # broadcast over heads
    x_embed = x_rot * cos_b + rotated_half * sin_b
    return torch.cat((x_embed, x_pass), dim=-1).to(x.dtype)


def vision_qkv_rotary(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The vision tower's qkv projection output [n, 3, heads, D] -> q, k, v, each contiguous [heads, n, D]
    (the layout its attention reads per frame): q and k rotated over the whole head by cos, sin [n, D]
    (`apply_partial_rope` with rotary_dim = D: fp32 math, as transformers); v as it is."""
    q, k, v = qkv.unbind(1)
    q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
    return q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
