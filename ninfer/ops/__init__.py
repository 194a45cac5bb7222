"""Semantic Ops of the Qwen3.6 family: reference implementations (plain PyTorch, fp32 math, CPU and GPU,
differentiable), the oracles for any fast implementation, and beside them the fast forms the op table
runs on CUDA (Triton kernels in `ninfer.ops.triton`, fla-core, SDPA), with their device dispatch. See
docs/ops.md for the admission rules and the layout.

- norm: `rms_norm` (zero-centred, 1 + w), `gated_rms_norm` (GDN output, plain w, silu(z) gate), `l2norm`
- rope: `mrope_cos_sin` (interleaved M-RoPE tables), `apply_partial_rope` (rotate-half on the first dims)
- conv: `causal_conv1d` (prefill, with state), `causal_conv1d_update` (one decode step, pure)
- gated_delta: `gdn_gating`, `chunk_gated_delta_rule` (prefill), `recurrent_gated_delta_rule` (decode/verify)
- attention: `split_q_gate`, `causal_attention`, `kv_write`, `paged_attention`, `gated_attention_output`
- mlp: `swiglu_mlp`
- moe: `moe_route`, `moe_experts`, `moe_block`; the whole block from its weights `moe_mlp` / `fast_moe_mlp`
- linear: `logits`, `linear_add_rms_norm` and their fast forms, `fast_linear` (our GEMV or cuBLAS)
- gdn: the GDN layer's step over the state slot pools, `gdn_decode` / `fast_gdn_decode`, `gdn_prefill` /
  `fast_gdn_prefill` (fla-core, its per-step chunk table `fla_varlen`)
- attention (step ops): `attention_prologue`, `gated_decode_attention`, `gated_prefill_attention` and
  their fast forms; norm: `add_rms_norm` and the fast norms
- sampling: the counter-based sampler, `argmax_rows`
- pdl_policy: `pdl_policy`, the PDL flags of a step's fast kernels; step: `StepFacts`, what ops read of a step

Nothing is re-exported here so that importing `ninfer.ops` stays cheap; import the submodule you need.
"""
