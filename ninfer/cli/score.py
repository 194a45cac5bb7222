"""`ninfer score [ARTIFACT] [FILE|-]`: causal log-probs of a text through the causal_scoring purpose.

The text is scored raw: no chat template and no added special tokens. `logprobs[i]` is the natural-log
probability of token i given the tokens before it (None for the first token). Texts longer than the
scoring window are scored in overlapping windows (`--window`, `--stride`; see docs/engine.md). For
scoring, the context limit *is* the window: `--max-context N` sets the window to N unless `--window` is
given too (`ninfer serve --purpose causal_scoring` resolves its `--score-window`/`--score-stride` the same
way, through `scoring_window`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ninfer.cli.common import add_engine_flags, fail, product_errors, split_artifact

DEFAULT_SCORE_WINDOW = 2048  # EngineConfig.score_window; its score_stride (1024) is half of it


def scoring_window(window: int | None, stride: int | None, max_context: int | None) -> tuple[int, int]:
    """(window, stride) of a scoring Engine from the command line. A scoring Engine holds one window at a
    time, so its context limit is the window: ``--max-context`` sets it unless a window is given as well.
    The stride defaults to half the window (EngineConfig's 2048/1024); EngineConfig validates both."""
    if window is None:
        window = max_context if max_context is not None else DEFAULT_SCORE_WINDOW
    return window, stride if stride is not None else max(1, window // 2)


def max_context_note(window: int | None, max_context: int | None) -> str | None:
    """The warning for a ``--max-context`` that a given window overrides, if they differ."""
    if window is None or max_context is None or window == max_context:
        return None
    return (
        f"--max-context {max_context} is ignored: a scoring Engine's context is its window, and the window "
        f"was given as {window}"
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="per-token log-probs and total NLL of a text")
    p.add_argument(
        "positionals",
        nargs="*",
        metavar="[ARTIFACT] [FILE|-]",
        help="a .ninfer file (default: the bundled demo model) and the text file to score (- or none: stdin)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help=f"tokens per scoring window (default: --max-context if given, else {DEFAULT_SCORE_WINDOW})",
    )
    p.add_argument("--stride", type=int, default=None, help="tokens a window advances by (default: window/2)")
    p.add_argument("--json", action="store_true", help='print {"token_ids", "logprobs", "total_nll"}')
    add_engine_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ninfer import Engine, EngineConfig

    positionals = args.positionals or ["-"]
    artifact, (args.file,) = split_artifact(positionals, 1, "FILE")
    window, stride = scoring_window(args.window, args.stride, args.max_context)
    note = max_context_note(args.window, args.max_context)
    if note is not None:
        print(f"ninfer score: warning: {note}", file=sys.stderr)
    try:  # the flags first: a bad one is refused before the input is read
        config = EngineConfig(  # max_context stays None: the Engine's context is the window
            purpose="causal_scoring",
            device=args.device,
            dtype=args.dtype,
            kernels=args.kernels,
            score_window=window,
            score_stride=stride,
            warmup=False,
        )
    except ValueError as e:
        return fail(e)
    try:
        if args.file != "-":
            text = Path(args.file).read_bytes().decode("utf-8")  # strict: undecodable bytes are refused
        elif hasattr(sys.stdin, "buffer"):
            text = sys.stdin.buffer.read().decode("utf-8")
        else:  # a text stream with no bytes underneath (an embedding host's or a test's stdin)
            text = sys.stdin.read()
    except (OSError, UnicodeDecodeError) as e:
        return fail(f"cannot read {args.file}: {e}")
    if not text:
        return fail("nothing to score: the input is empty")
    try:
        with Engine(artifact, config) as engine:
            result = engine.score([text])[0]
            frontend = engine.frontend
    except product_errors() as e:
        return fail(e)
    n_bytes = len(text.encode("utf-8"))
    if args.json:
        print(
            json.dumps(
                {
                    "token_ids": list(result.token_ids),
                    "logprobs": list(result.logprobs),
                    "total_nll": result.total_nll,
                    "bytes": n_bytes,
                    "bits_per_byte": result.total_nll / math.log(2) / n_bytes,
                }
            )
        )
        return 0
    for token, lp in zip(result.token_ids, result.logprobs):
        piece = frontend.decode([token])
        print(f"{token:>8} {repr(piece):<24} {'-' if lp is None else f'{lp:.4f}'}")
    scored = len(result.token_ids) - 1
    print(
        f"tokens {len(result.token_ids)}  total NLL {result.total_nll:.4f} nats  "
        f"mean {result.total_nll / max(scored, 1):.4f} nats/token  "
        f"{result.total_nll / math.log(2) / n_bytes:.4f} bits/byte"
    )
    return 0
