"""Triton fast-path candidates for the reference Ops (GPU; tested on CPU under TRITON_INTERPRET=1).

- gdn_decode: `gdn_decode_step`, the Gated DeltaNet recurrence for decode/verify rows, gating and q/k
  l2norm in-kernel, state read from and written to the StateImage pool by slot index.
- paged_decode_attention: `paged_decode_attention`, one query per row over paged K/V, GQA packed,
  optional split-KV.

Candidates only: not selected by the Program until benchmarked on the GPU (docs/ops.md, "Candidates").
Import the submodule you need; importing this package does not import triton.
"""
