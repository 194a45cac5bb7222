"""The Qwen3.6 vision tower: preprocessed patches -> one embedding per merged 2 x 2 patch block.

PyTorch, the same code on CPU (the reference) and GPU, equal to transformers' ``Qwen3_5VisionModel``
(its ``pooler_output``):

1. patch embed: the Conv3d with kernel = stride = (temporal, patch, patch) is a linear map of each
   flattened ``pixel_values`` row (c, t, py, px), computed as one GEMM;
2. learned position table (``num_position_embeddings`` = side^2 entries) resampled to each image's
   (h, w) patch grid bilinearly with align_corners=True, in the merge-block row order of the patches;
3. 2-D rotary over the whole head: ``head_dim/4`` inverse frequencies (base ``rope_theta``), angles
   ``cat(row * inv, col * inv)`` duplicated to head_dim, rotate-half in fp32;
4. ``depth`` pre-LayerNorm blocks (eps 1e-6): bidirectional attention within each frame of each image,
   MLP with GELU-tanh;
5. merger: LayerNorm per patch, 4 consecutive patches (one 2 x 2 block) concatenated, fc1, exact GELU,
   fc2 to the text model's hidden size.

Attention over images of different sizes runs as one ``scaled_dot_product_attention`` call per distinct
frame length (frames of equal length are stacked into a batch), so there is no Python loop over patches
or frames and no [N, N] mask; on CUDA SDPA picks its flash / memory-efficient kernels. The rotary and the
q/k/v relayout SDPA reads are the op table's ``vision_qkv_rotary`` (on the fast table one Triton launch a
block, `ninfer.ops.triton.vision_rope`, the same fp32 arithmetic).

`image_pad_rows` gives the prompt rows the output goes to (``PreparedImage.token_offset`` and
``num_tokens``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ninfer.targets.qwen3_6.kernels import REFERENCE, Kernels
from ninfer.targets.qwen3_6.variant import VisionDims
from ninfer.targets.qwen3_6.view import VisionBlockView, VisionView

Tensor = torch.Tensor
Grid = tuple[int, int, int]

__all__ = ["check_grids", "image_pad_rows", "vision_embeddings", "vision_tokens"]

_LN_EPS = 1e-6
_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def vision_tokens(grids: Sequence[Grid], dims: VisionDims) -> int:
    """Output rows (prompt image tokens) for these grids: sum of t*h*w / merge^2."""
    m2 = dims.spatial_merge_size**2
    return sum(t * h * w // m2 for t, h, w in grids)


def check_grids(pixel_values: Tensor, grids: Sequence[Grid], dims: VisionDims) -> None:
    """ValueError naming what does not fit: grid shapes, row count, row width."""
    m = dims.spatial_merge_size
    for i, grid in enumerate(grids):
        if len(grid) != 3 or min(grid) < 1:
            raise ValueError(f"image {i}: grid {tuple(grid)} is not three positive sizes (t, h, w)")
        if grid[1] % m or grid[2] % m:
            raise ValueError(f"image {i}: grid {tuple(grid)} h and w must be multiples of the merge size {m}")
    rows = sum(t * h * w for t, h, w in grids)
    width = dims.in_channels * dims.temporal_patch_size * dims.patch_size**2
    if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (rows, width):
        raise ValueError(
            f"pixel_values is {tuple(pixel_values.shape)}, the grids need ({rows}, {width}) "
            f"(sum of t*h*w rows of in_channels*temporal*patch^2)"
        )


def vision_embeddings(
    view: VisionView,
    dims: VisionDims,
    pixel_values: Tensor,
    grids: Sequence[Grid],
    kernels: Kernels = REFERENCE,
) -> Tensor:
    """``[sum t*h*w/merge^2, out_hidden_size]`` in the weights' dtype, images in ``grids`` order.

    ``pixel_values`` is the row-concatenation of the images' ``PreparedImage.pixel_values`` (any float
    dtype, on the weights' device); ``grids`` their ``grid_thw``. ``kernels``: the op table whose
    ``vision_qkv_rotary`` the attention takes (the Program's). Raises ValueError for mismatches.
    """
    grids = [tuple(int(v) for v in g) for g in grids]
    check_grids(pixel_values, grids, dims)
    if dims.hidden_act not in _ACTIVATIONS:
        raise ValueError(f"vision hidden_act {dims.hidden_act!r} is not one of {sorted(_ACTIVATIONS)}")
    weight = view.patch_embed_weight
    dtype, device = weight.dtype, weight.device
    x = pixel_values.to(device=device, dtype=dtype)
    x = F.linear(x, weight.reshape(weight.shape[0], -1), view.patch_embed_bias)
    row, col = _patch_coords(grids, dims.spatial_merge_size, device)
    x = x + _position_embeddings(view.pos_embed, grids, row, col).to(dtype)
    cos, sin = _rotary(row, col, dims)
    frames = _frame_groups(grids, device)
    approximate = _ACTIVATIONS[dims.hidden_act]
    for block in view.blocks:
        h = F.layer_norm(x, (x.shape[-1],), block.norm1_weight, block.norm1_bias, _LN_EPS)
        x = x + _attention(h, block, dims, cos, sin, frames, kernels)
        h = F.layer_norm(x, (x.shape[-1],), block.norm2_weight, block.norm2_bias, _LN_EPS)
        h = F.gelu(F.linear(h, block.fc1_weight, block.fc1_bias), approximate=approximate)
        x = x + F.linear(h, block.fc2_weight, block.fc2_bias)
    merger = view.merger
    h = F.layer_norm(x, (x.shape[-1],), merger.norm_weight, merger.norm_bias, _LN_EPS)
    h = h.reshape(-1, x.shape[-1] * dims.spatial_merge_size**2)  # 4 consecutive patches = one 2x2 block
    h = F.gelu(F.linear(h, merger.fc1_weight, merger.fc1_bias))
    return F.linear(h, merger.fc2_weight, merger.fc2_bias)


def image_pad_rows(spans: Sequence[tuple[int, int]], device: torch.device | str = "cpu") -> Tensor:
    """Prompt row indices the tower's output rows go to, in output order, from each image's
    (``token_offset``, ``num_tokens``): ``embeds[rows] = vision_embeddings(...)``."""
    parts = [torch.arange(offset, offset + n, device=device) for offset, n in spans]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)


# ---- pieces -----------------------------------------------------------------------------------------


def _patch_coords(grids: Sequence[Grid], merge: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(row, col) of every patch, in the processor's merge-block order, repeated for each frame."""
    rows, cols = [], []
    for t, h, w in grids:
        r = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        c = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # (block_row, in_row, block_col, in_col) -> (block_row, block_col, in_row, in_col)
        rows.append(r.permute(0, 2, 1, 3).reshape(-1).repeat(t))
        cols.append(c.permute(0, 2, 1, 3).reshape(-1).repeat(t))
    return torch.cat(rows), torch.cat(cols)


def _position_embeddings(table: Tensor, grids: Sequence[Grid], row: Tensor, col: Tensor) -> Tensor:
    """The side x side table resampled (bilinear, align_corners=True) to each grid, per patch, fp32."""
    side = math.isqrt(table.shape[0])
    if side * side != table.shape[0]:
        raise ValueError(f"the vision position table has {table.shape[0]} rows, not a square number")
    device = table.device
    height = torch.cat([torch.full((t * h * w,), h, device=device) for t, h, w in grids])
    width = torch.cat([torch.full((t * h * w,), w, device=device) for t, h, w in grids])

    def taps(index: Tensor, size: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # align_corners: output 0 and size-1 land on table entries 0 and side-1
        src = index.float() * (side - 1) / torch.clamp(size - 1, min=1).float()
        lo = src.floor()
        frac = src - lo
        lo = lo.long().clamp(0, side - 1)
        return lo, (lo + 1).clamp(max=side - 1), frac

    r0, r1, fr = taps(row, height)
    c0, c1, fc = taps(col, width)
    t = table.float()
    top = t[r0 * side + c0] * (1 - fc)[:, None] + t[r0 * side + c1] * fc[:, None]
    bottom = t[r1 * side + c0] * (1 - fc)[:, None] + t[r1 * side + c1] * fc[:, None]
    return top * (1 - fr)[:, None] + bottom * fr[:, None]


def _rotary(row: Tensor, col: Tensor, dims: VisionDims) -> tuple[Tensor, Tensor]:
    """cos, sin [patches, head_dim] fp32 of the 2-D rotary (row angles, then column angles, twice)."""
    spatial = dims.head_dim // 2
    inv_freq = 1.0 / (
        dims.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=row.device) / spatial)
    )
    angles = torch.cat([row[:, None].float() * inv_freq, col[:, None].float() * inv_freq], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _frame_groups(grids: Sequence[Grid], device: torch.device) -> list[tuple[int, Tensor | None]]:
    """(frame length, rows of all frames of that length, or None when that is every row in order):
    attention runs within each frame, frames of one length as one batch. Built once per call, from
    device ranges only (no host copy, so the forward can be captured in a CUDA graph)."""
    starts: dict[int, list[int]] = {}
    offset = 0
    for t, h, w in grids:
        for _ in range(t):
            starts.setdefault(h * w, []).append(offset)
            offset += h * w
    if len(starts) == 1:
        return [(next(iter(starts)), None)]
    groups: list[tuple[int, Tensor | None]] = []
    for length, firsts in starts.items():
        groups.append((length, torch.cat([torch.arange(f, f + length, device=device) for f in firsts])))
    return groups


def _attention(
    x: Tensor,
    block: VisionBlockView,
    dims: VisionDims,
    cos: Tensor,
    sin: Tensor,
    frames: list[tuple[int, Tensor | None]],
    kernels: Kernels,
) -> Tensor:
    n, hidden = x.shape
    heads, head_dim = dims.num_heads, dims.head_dim
    qkv = F.linear(x, block.qkv_weight, block.qkv_bias).view(n, 3, heads, head_dim)
    q, k, v = kernels.vision_qkv_rotary(qkv, cos, sin)  # [heads, n, D] each, q and k rotated
    out = torch.empty(n, heads, head_dim, dtype=x.dtype, device=x.device)
    for length, rows in frames:

        def frames_of(t: Tensor, rows: Tensor | None = rows, length: int = length) -> Tensor:
            picked = t if rows is None else t[:, rows]
            return picked.view(heads, -1, length, head_dim).transpose(0, 1)  # [frames, heads, len, dim]

        o = F.scaled_dot_product_attention(frames_of(q), frames_of(k), frames_of(v))
        o = o.transpose(1, 2).reshape(-1, heads, head_dim)
        if rows is None:
            out = o
        else:
            out[rows] = o
    return F.linear(out.reshape(n, hidden), block.proj_weight, block.proj_bias)
