"""Measure a model's MTP acceptance through the public Engine: `python -m tools.mtp_acceptance`.

Prompts are windows of the demo model's held-out training split (the standard library's ``asyncio/``,
``json/`` and ``email/`` sources, tools/train_demo/README.md); each is continued for ``--tokens`` tokens
with ``mtp:K`` for every K, greedy and sampled. Reported per K and temperature: the mean accepted length
(tokens a verify round produced: accepted drafts + 1) and the acceptance rate per draft, from the
requests' usage (``drafted_tokens``, ``accepted_draft_tokens``).
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

from ninfer import Engine, EngineConfig, GenerationRequest
from ninfer.cli.common import bundled_artifact

HELD_OUT = ("asyncio", "json", "email")


def held_out_prompts(count: int, chars: int) -> list[str]:
    """``count`` windows of ``chars`` characters, spread over the held-out files (sorted, so fixed)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for d in HELD_OUT for p in (stdlib / d).rglob("*.py") if p.stat().st_size > 4 * chars)
    prompts = []
    for i in range(count):
        text = files[i % len(files)].read_text(encoding="utf-8")
        start = (i * 7919) % (len(text) - 2 * chars)
        prompts.append(text[start : start + chars])
    return prompts


def measure(
    artifact: str, k: int, temperature: float, prompts: list[str], tokens: int, device: str,
    draft_vocab: int | None = None,
) -> dict:  # fmt: skip
    config = EngineConfig(
        device=device, speculative=f"mtp:{k}", max_concurrency=8, max_context=2048, prefix_cache=False,
        queue_capacity=len(prompts), warmup=False, draft_vocab=draft_vocab,
    )  # fmt: skip
    with Engine(artifact, config) as engine:
        handles = [
            engine.submit(
                GenerationRequest(
                    prompt=p, max_tokens=tokens, temperature=temperature, seed=i, ignore_eos=True
                )
            )
            for i, p in enumerate(prompts)
        ]
        usage = [h.result().usage for h in handles]
    drafted = sum(u.drafted_tokens for u in usage)
    accepted = sum(u.accepted_draft_tokens for u in usage)
    rounds = drafted // k
    return {
        "k": k,
        "temperature": temperature,
        "draft_vocab": draft_vocab,
        "requests": len(prompts),
        "rounds": rounds,
        "mean_accepted_length": round(1 + accepted / rounds, 3),
        "acceptance_per_draft": round(accepted / drafted, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "artifact", nargs="?", default=None, help="a .ninfer file (default: the bundled demo model)"
    )
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--chars", type=int, default=600)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ks", default="1,2,3,4", help="draft lengths K")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--draft-vocab", default="", help="draft head shortlists (EngineConfig.draft_vocab)")
    args = p.parse_args()
    prompts = held_out_prompts(args.prompts, args.chars)
    artifact = args.artifact or bundled_artifact()
    vocabs = [int(v) for v in args.draft_vocab.split(",") if v] or [None]
    for vocab in vocabs:
        for temperature in (float(t) for t in args.temperatures.split(",")):
            for k in (int(x) for x in args.ks.split(",")):
                line = measure(artifact, k, temperature, prompts, args.tokens, args.device, vocab)
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
