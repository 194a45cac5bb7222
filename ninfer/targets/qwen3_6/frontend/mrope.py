"""3-D M-RoPE positions of a multimodal prompt, as transformers' ``Qwen3_5Model.get_rope_index``.

The prompt is walked in runs with a running position ``p`` (vision start/end tokens are text):
- a text run of n tokens gets ``p .. p+n-1`` on all three axes, then ``p += n``;
- an image run (grid t x h x w patches, merge m) is the llm grid (t, h/m, w/m) in raster order with
  ``T = p + frame``, ``H = p + row``, ``W = p + col``, then ``p += max(h, w) / m``.
``delta = max(position) + 1 - len(prompt)``; decode token n (cache position) then sits at ``n + delta``
on every axis.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["ImageSpan", "mrope_positions"]

ImageSpan = tuple[int, tuple[int, int, int]]  # (token_offset, grid_thw in patches)


def mrope_positions(num_tokens: int, images: Sequence[ImageSpan], merge_size: int) -> tuple[np.ndarray, int]:
    """[3, num_tokens] int64 positions (read-only) and the decode delta; ``images`` in prompt order."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    pos = cursor = 0
    for offset, (t, h, w) in images:
        if offset < cursor or h % merge_size or w % merge_size:
            raise ValueError(
                f"image span at {offset} (grid {t}x{h}x{w}) overlaps or does not merge by {merge_size}"
            )
        gh, gw = h // merge_size, w // merge_size
        n = t * gh * gw
        if offset + n > num_tokens:
            raise ValueError(
                f"image span at {offset} with {n} tokens runs past the prompt ({num_tokens} tokens)"
            )
        out[:, cursor:offset] = np.arange(pos, pos + offset - cursor)
        pos += offset - cursor
        frame, row, col = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[0, offset : offset + n] = pos + frame.ravel()
        out[1, offset : offset + n] = pos + row.ravel()
        out[2, offset : offset + n] = pos + col.ravel()
        pos += max(h, w) // merge_size
        cursor = offset + n
    out[:, cursor:] = np.arange(pos, pos + num_tokens - cursor)
    out.setflags(write=False)
    delta = int(out.max()) + 1 - num_tokens if num_tokens else 0
    return out, delta
