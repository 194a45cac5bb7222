"""`ninfer bench [ARTIFACT] [--synthetic PACKAGE]`: decode and prefill speed through the public Engine.

Prints decode ms/step and tok/s per batch size B at a given context, prefill tok/s, TTFT and TPOT, each
beside the roofline of the package measured in the same run (bytes a decode step must read over the
measured memory bandwidth; prefill FLOPs over the measured matmul throughput), and the start-up time.
Without an artifact and without ``--synthetic`` the bundled demo model runs. docs/benchmarks.md has the
method and the recorded runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from ninfer.cli.common import add_kernels_flag, add_lookahead_flag, decode_lookahead, fail, split_artifact
from ninfer.types import MAX_CONCURRENCY_LIMIT

DEFAULT_BATCHES = (1, 2, 4, 8)
DEFAULT_PREFILL_TOKENS = 8192


def batch_list(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> (1, 2, 4, 8): distinct, ascending, each 1..MAX_CONCURRENCY_LIMIT."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or not all(1 <= v <= MAX_CONCURRENCY_LIMIT for v in values):
        raise argparse.ArgumentTypeError(f"batch sizes must be 1..{MAX_CONCURRENCY_LIMIT}, got {text!r}")
    return tuple(values)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure decode/prefill speed beside the package's roofline",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "artifact", nargs="?", metavar="ARTIFACT", help="a .ninfer file (default: the bundled demo model)"
    )
    p.add_argument(
        "--synthetic",
        metavar="PACKAGE",
        default=None,
        help="random weights of this registered package's exact dims, made on the device (no artifact)",
    )
    p.add_argument("--batch", type=batch_list, default=DEFAULT_BATCHES, help="batch sizes B (1,2,4,8)")
    p.add_argument("--context", type=positive_int, default=2048, help="prompt tokens per decode request")
    p.add_argument("--decode-steps", type=positive_int, default=64, help="timed decode rounds per B")
    p.add_argument(
        "--prefill-tokens",
        type=positive_int,
        default=None,
        help=f"prompt tokens of the prefill/TTFT request (default {DEFAULT_PREFILL_TOKENS}, capped to fit "
        "the model's positions)",
    )
    p.add_argument("--prefill-repeats", type=positive_int, default=3, help="prefill runs (median)")
    p.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=None,
        help="prompt tokens per prefill unit (EngineConfig.prefill_chunk_tokens; default 8192 with the "
        "fast op table, 2048 with the reference one)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run (auto)")
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default="auto",
        help="compute dtype (auto: float32 on CPU; on GPU the artifact's storage dtype, bf16 if synthetic)",
    )
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode eagerly on CUDA")
    add_lookahead_flag(p)
    add_kernels_flag(p)
    p.add_argument(
        "--speculative",
        metavar="SPEC",
        default=None,
        help="decode backend: mtp:K, or known:K@TAU (a benchmark backend: K drafts a verify, TAU tokens "
        "accepted per row on average, through the real verify and commit; output text is meaningless)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights and the prompt ids")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run)


def _prefill_tokens(args: argparse.Namespace, max_positions: int) -> int:
    """The requested prefill length, or the default capped so prompt + decoded tokens fit the model."""
    if args.prefill_tokens is not None:
        return int(args.prefill_tokens)
    cap = max_positions - args.decode_steps - 1
    if cap < DEFAULT_PREFILL_TOKENS:
        print(f"ninfer: the model holds {max_positions} positions; prefill uses {cap}", file=sys.stderr)
    return max(1, min(DEFAULT_PREFILL_TOKENS, cap))


def _tokens_per_round(speculative: str | None) -> int:
    """The most tokens a row may produce per decode round (the bench's budgets must cover its rounds)."""
    from ninfer.types import parse_speculative

    spec = parse_speculative(speculative)
    return 1 if spec is None else spec.draft_tokens + 1


def run(args: argparse.Namespace) -> int:
    import torch

    from ninfer.artifact.errors import ArtifactError
    from ninfer.bench.drive import BenchError, BenchPlan
    from ninfer.bench.report import render_table
    from ninfer.bench.runner import BenchOptions, run_bench
    from ninfer.targets.open import artifact_package, prefill_unit, resolve_device
    from ninfer.targets.registry import PackageMismatch, get_package
    from ninfer.types import NInferError

    if args.artifact is not None and args.synthetic is not None:
        return fail("give an ARTIFACT or --synthetic PACKAGE, not both")
    try:
        if args.synthetic is not None:
            artifact = None
            package = get_package(args.synthetic)
        else:
            artifact, _ = split_artifact([args.artifact] if args.artifact else [], 0, "")
            package, _ = artifact_package(artifact)
        plan = BenchPlan(
            batches=args.batch,
            context=args.context,
            decode_steps=args.decode_steps,
            prefill_tokens=_prefill_tokens(args, package.variant.max_position_embeddings),
            prefill_repeats=args.prefill_repeats,
            # the Engine's own unit unless given: the plan needs it before the Engine starts
            prefill_chunk=prefill_unit(args.prefill_chunk, resolve_device(args.device), args.kernels),
            tokens_per_round=_tokens_per_round(args.speculative),
        )
        options = BenchOptions(
            plan=plan,
            artifact=artifact,
            synthetic=args.synthetic,
            device=args.device,
            dtype=args.dtype,
            cuda_graphs=not args.no_cuda_graphs,
            decode_lookahead=decode_lookahead(args),
            kernels=args.kernels,
            speculative=args.speculative,
            seed=args.seed,
        )
        report = run_bench(options, log=lambda line: print(f"ninfer bench: {line}", file=sys.stderr))
    except torch.cuda.OutOfMemoryError as e:
        return fail(f"out of device memory: {e}; lower --batch, --context or --prefill-tokens")
    except (OSError, ValueError, PackageMismatch, ArtifactError, NInferError, BenchError) as e:
        return fail(str(e))
    print(json.dumps(report.to_json()) if args.json else render_table(report))
    return 0
