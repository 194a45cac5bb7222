"""Triton fast implementations of the reference Ops (GPU; tested on CPU under TRITON_INTERPRET=1).

Called by the fast forms in `ninfer.ops` (`norm`, `linear`, `attention`, `gdn`, `moe`), which the fast op
table (`ninfer.targets.qwen3_6.kernels.fast_kernels`) names:
- gdn_decode: `gdn_decode_step`, the Gated DeltaNet recurrence for decode/verify rows, gating and q/k
  l2norm in-kernel, state read from and written to the state pool by slot index.
- conv_update: `causal_conv1d_update_slots`, the GDN conv step over the slot pool, in place.
- paged_decode_attention: `paged_decode_attention`, one query per row over paged K/V, GQA packed,
  optional split-KV, optionally gated (the output gate applied where the output is written).
- norm: `rms_norm`, `add_rms_norm`, `gated_rms_norm`; activation: `swiglu`.
- fused_moe: `fused_moe`, routed experts (sorted grouped GEMMs; a two-launch decode path), with the
  shared expert as one more weighted slot (`SharedExpert`).
- moe_routing: `moe_route_topk`, softmax + top-k + renormalise + the shared expert's sigmoid gate.
- moe_decode: `moe_decode_block`, the decode MoE block after the stacked input GEMV in two launches (the
  routing inside the experts' gate/up launch).
- attention_prologue: `qk_norm_rope_kv_write` (q/k norm + partial RoPE + K/V page write in one launch)
  and `sigmoid_gate` (the attention output gate read in place from the projection output: the reference
  the gated attention kernels equal bit for bit).
- paged_prefill_attention: `paged_prefill_attention`, varlen paged causal attention for prefill (GQA and
  pages read in place, bounds on the device, the gate where it writes).
- skinny_gemm: `skinny_linear`, the GEMV for one-row projections (decode at B = 1).
- rope: `mrope_cos_sin`, the M-RoPE cos/sin tables in one launch.
- argmax: `argmax_rows`, the greedy draw over the vocabulary at the end of a decode graph.
- step_unpack: `unpack_step`, `StepBuilder.unpack`'s casts and table gather in one launch (not in the table).
- pdl: programmatic dependent launch, the prologue of every kernel here.
- schedule: the recorder every launch here reports to and the check of a recorded step's PDL distances
  (`pdl.checked_schedule`).

Import the submodule you need; importing this package does not import triton.
"""
