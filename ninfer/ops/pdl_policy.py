"""The programmatic-dependent-launch flags of a step's fast kernels, decided in one place.

Every fast composition (`ninfer.ops.norm`, `linear`, `attention`, `gdn`, `moe`) asks `pdl_policy` with
the step's shape and passes its answers to the Triton wrappers; nothing else sets these flags. What each
flag lets a kernel do, and what it then assumes of the kernels around it, is in `ninfer.ops.triton.pdl`;
`ninfer.ops.triton.schedule` checks a recorded step against those assumptions (`checked_schedule`).

- ``launch_next_early``: the small decode kernels (the norms, the gated norm, the attention prologue,
  the split-KV attention and its merge, the output gate, the conv step, the recurrence, the one-token
  MoE down launch) let the next kernel start before their own wait, so that the one-wave GEMV that ends
  each of their chains streams its weights while they run. Only in one-token steps: measured faster at
  one row and slower at eight (docs/benchmarks.md, "Why the kernels are as they are", PDL).
- ``settled``: the kernels that can read data no running kernel writes load it before their wait: the
  norms their bound weight and the residual stream (written by a norm four or more launches back), the
  attention prologue its KV slot, the conv step, its GEMV-epilogue form and the recurrence their state
  pools (written by an earlier step), parameters and slots. Always on in the fast table.
- ``settled_kv``: the split-KV decode attention loads its first key block's K and V before its wait. Only
  when every query is its row's one new token (``tokens_per_row == 1``): every position but a query's
  newest was then written by an earlier step, and the program holding the newest loads it again after
  the wait; with T > 1 tokens per row a query's earlier positions include its row's tokens of this step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["PdlPolicy", "pdl_policy"]


@dataclass(frozen=True)
class PdlPolicy:
    """The flags the fast kernels of one step take (module docstring)."""

    launch_next_early: bool
    settled: bool
    settled_kv: bool


@functools.cache  # a pure function of two ints, asked once per kernel call
def pdl_policy(tokens: int, tokens_per_row: int | None = None) -> PdlPolicy:
    """The flags of a step of ``tokens`` tokens (N = B * T, the rows of every activation the kernels see)
    and, when every row has the same count, ``tokens_per_row`` T (None: rows of any length, or not known
    to the caller: the flags that depend on it stay off)."""
    return PdlPolicy(launch_next_early=tokens == 1, settled=True, settled_kv=tokens_per_row == 1)
