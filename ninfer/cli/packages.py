"""`ninfer packages [--json]`: every registered package with its identity and dims."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("packages", help="list registered packages and the checkpoints they accept")
    p.add_argument("--json", action="store_true", help="list of {package, hf_config} objects")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ninfer.targets.qwen3_6.weights import weight_schema
    from ninfer.targets.registry import PACKAGES

    if args.json:
        out = [{"package": p.name, "hf_config": p.hf_config()} for p in PACKAGES.values()]
        print(json.dumps(out, indent=2))
        return 0
    for p in PACKAGES.values():
        v = p.variant
        params = sum(_numel(w.shape) for w in weight_schema(v))
        mlp = (
            f"MoE {v.num_experts}x{v.moe_intermediate_size} top-{v.num_experts_per_tok} "
            f"+ shared {v.shared_expert_intermediate_size}"
            if v.moe
            else f"dense MLP {v.intermediate_size}"
        )
        print(f"{p.name}{'  (test)' if p.test_only else ''}: {p.description}")
        print(f"  family {p.family}, hf model_type {p.hf_model_type}, {params / 1e9:.3f}B parameters")
        print(
            f"  hidden {v.hidden_size}, {v.num_layers} layers ({len(v.gdn_layers)} GDN + "
            f"{len(v.attention_layers)} attention), vocab {v.vocab_size}, {mlp}"
        )
        print(
            f"  attention {v.num_attention_heads}q:{v.num_kv_heads}kv x {v.head_dim} "
            f"(rotary {v.rotary_dim}), "
            f"GDN {v.linear_num_key_heads}k:{v.linear_num_value_heads}v x {v.linear_key_head_dim}, "
            f"MTP layers {v.mtp_num_hidden_layers}, vision {'yes' if v.vision else 'no'}"
        )
    return 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
