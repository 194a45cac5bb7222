"""`ninfer score [ARTIFACT] [FILE|-]`: causal log-probs of a text through the causal_scoring purpose.

The text is scored raw: no chat template and no added special tokens. `logprobs[i]` is the natural-log
probability of token i given the tokens before it (None for the first token). Texts longer than the
scoring window are scored in overlapping windows (`--window`, `--stride`; see docs/engine.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ninfer.cli.common import add_engine_flags, fail, split_artifact


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="per-token log-probs and total NLL of a text")
    p.add_argument(
        "positionals", nargs="*", metavar="[ARTIFACT] [FILE|-]",
        help="a .ninfer file (default: the bundled demo model) and the text file to score (- or none: stdin)",
    )
    p.add_argument("--window", type=int, default=2048, help="tokens per scoring window")
    p.add_argument("--stride", type=int, default=1024, help="tokens a window advances by")
    p.add_argument("--json", action="store_true", help='print {"token_ids", "logprobs", "total_nll"}')
    add_engine_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ninfer import Engine, EngineConfig, NInferError

    positionals = args.positionals or ["-"]
    artifact, (args.file,) = split_artifact(positionals, 1, "FILE")
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return fail(f"cannot read {args.file}: {e}")
    if not text:
        return fail("nothing to score: the input is empty")
    try:
        config = EngineConfig(
            purpose="causal_scoring", device=args.device, dtype=args.dtype, max_context=args.max_context,
            score_window=args.window, score_stride=args.stride, warmup=False,
        )
        with Engine(artifact, config) as engine:
            result = engine.score([text])[0]
            frontend = engine.frontend
    except (OSError, ValueError, NInferError) as e:
        return fail(str(e))
    n_bytes = len(text.encode("utf-8"))
    if args.json:
        print(json.dumps({
            "token_ids": list(result.token_ids),
            "logprobs": list(result.logprobs),
            "total_nll": result.total_nll,
            "bytes": n_bytes,
            "bits_per_byte": result.total_nll / math.log(2) / n_bytes,
        }))
        return 0
    for token, lp in zip(result.token_ids, result.logprobs):
        piece = frontend.decode([token])
        print(f"{token:>8} {repr(piece):<24} {'-' if lp is None else f'{lp:.4f}'}")
    scored = len(result.token_ids) - 1
    print(f"tokens {len(result.token_ids)}  total NLL {result.total_nll:.4f} nats  "
          f"mean {result.total_nll / max(scored, 1):.4f} nats/token  "
          f"{result.total_nll / math.log(2) / n_bytes:.4f} bits/byte")
    return 0
