"""Semantic Ops of the Qwen3.6 family: reference implementations (plain PyTorch, fp32 math, CPU and GPU,
differentiable). They are the oracles for any fast implementation; see docs/ops.md for the admission rules.

- norm: `rms_norm` (zero-centred, 1 + w), `gated_rms_norm` (GDN output, plain w, silu(z) gate), `l2norm`
- rope: `mrope_cos_sin` (interleaved M-RoPE tables), `apply_partial_rope` (rotate-half on the first dims)
- conv: `causal_conv1d` (prefill, with state), `causal_conv1d_update` (one decode step, pure)
- gated_delta: `gdn_gating`, `chunk_gated_delta_rule` (prefill), `recurrent_gated_delta_rule` (decode/verify)
- attention: `split_q_gate`, `causal_attention`, `kv_write`, `paged_attention`, `gated_attention_output`
- mlp: `swiglu_mlp`
- moe: `moe_route`, `moe_experts`, `moe_block`

Nothing is re-exported here so that importing `ninfer.ops` stays cheap; import the submodule you need.
"""
