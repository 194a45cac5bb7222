"""`ninfer bench`'s serving workload (``--server URL`` / ``--concurrency``): flags, checks and the run.

Kept out of ``ninfer/cli/bench.py`` (which only adds these flags and dispatches here) so the engine-level
suite and the serving client change independently. ``ninfer/bench/serving.py`` holds the workload.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from ninfer.cli.common import comma_ints, fail, positive_int

if TYPE_CHECKING:
    from ninfer.bench.serving import ServingPlan

API_KEY_ENV = "NINFER_API_KEY"  # the variable `ninfer serve` reads its key from
DEFAULT_CONCURRENCY = (1, 4, 8)
# bench flags the serving workload uses; any other flag given with it is refused, never ignored
WORKLOAD_FLAGS = {
    "server", "concurrency", "prompt_tokens", "max_tokens", "requests", "duration", "seed", "json",
}  # fmt: skip
CLIENT_FLAGS = WORKLOAD_FLAGS | {"api_key"}
ENGINE_FLAGS = WORKLOAD_FLAGS | {
    "artifact", "synthetic", "device", "dtype", "no_cuda_graphs", "prefill_graph_tokens",
    "vision_graph_sizes", "no_decode_lookahead", "kernels", "gpu_memory_fraction", "prefill_chunk",
    "speculative", "draft_vocab", "prefix_cache", "cache_memory_gb",
}  # fmt: skip
NOT_FLAGS = {"func", "command", "debug"}


def concurrency_list(text: str) -> tuple[int, ...]:
    """``"1,4,8"`` -> (1, 4, 8): positive integers, in the order given (one level each), no repeats."""
    values = tuple(comma_ints(text))
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct integers >= 1, got {text!r}")
    return values


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def add_serving_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "serving workload (concurrent streams, as vllm bench serve; docs/benchmarks.md, 'Serving')"
    )
    g.add_argument(
        "--server",
        metavar="URL",
        default=None,
        help="send the serving workload to this running server (http://127.0.0.1:8000) instead of an "
        "in-process Engine",
    )
    g.add_argument(
        "--concurrency",
        type=concurrency_list,
        default=None,
        metavar="C[,C...]",
        help="concurrent streams, one level each (default with --server: 1,4,8); without --server the "
        "same workload runs through the in-process Engine",
    )
    g.add_argument("--prompt-tokens", type=positive_int, default=1024, help="token ids per prompt (1024)")
    g.add_argument(
        "--max-tokens", type=positive_int, default=128, help="output tokens per request, ignore_eos (128)"
    )
    g.add_argument("--requests", type=positive_int, default=4, help="requests a stream sends per level (4)")
    g.add_argument(
        "--duration",
        type=positive_float,
        default=None,
        metavar="S",
        help="per level, start no request after S seconds (default: --requests alone bounds the run)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help=f"with --server: the server's key (default: ${API_KEY_ENV}, else none)",
    )


def serving_mode(args: argparse.Namespace) -> bool:
    return args.server is not None or args.concurrency is not None


def _flag(dest: str) -> str:
    return "ARTIFACT" if dest == "artifact" else "--" + dest.replace("_", "-")


def flag_problem(args: argparse.Namespace) -> str | None:
    """A flag the chosen serving run would not use (given with a value other than its default), or a
    value it cannot take; None when all is well."""
    from ninfer.cli.main import build_parser

    defaults = vars(build_parser(only="bench").parse_args(["bench"]))
    allowed = CLIENT_FLAGS if args.server is not None else ENGINE_FLAGS
    for dest, value in vars(args).items():
        if dest in allowed or dest in NOT_FLAGS or value == defaults.get(dest, value):
            continue
        if args.server is not None and dest in ENGINE_FLAGS:
            return f"{_flag(dest)} configures an in-process Engine; with --server the server's own flags do"
        return f"{_flag(dest)} is not used by the serving workload (--server / --concurrency)"
    if args.max_tokens < 2:
        return "--max-tokens must be >= 2 (TPOT needs two tokens)"
    if args.speculative is not None and len(args.speculative) > 1:
        return "--speculative takes one decode backend with the serving workload (a sweep: standard suite)"
    return None


def serving_plan(args: argparse.Namespace) -> ServingPlan:
    """The workload the serving flags describe."""
    from ninfer.bench.serving import ServingPlan

    return ServingPlan(
        concurrency=args.concurrency or DEFAULT_CONCURRENCY,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        requests_per_stream=args.requests,
        duration_s=args.duration,
    )


def run_serving(args: argparse.Namespace) -> int:
    from ninfer.artifact.errors import ArtifactError
    from ninfer.bench.drive import BenchError
    from ninfer.bench.serving import HttpServer, render, run_engine, run_http
    from ninfer.targets.registry import PackageMismatch
    from ninfer.types import NInferError

    problem = flag_problem(args)
    if problem is not None:
        return fail(problem)
    plan = serving_plan(args)
    log = lambda line: print(f"ninfer bench: {line}", file=sys.stderr)  # noqa: E731
    try:
        if args.server is not None:
            server = HttpServer(args.server, api_key=args.api_key or os.environ.get(API_KEY_ENV))
            report = run_http(server, plan, args.seed, log=log)
        else:
            report = run_engine(engine_options(args, plan), plan, log=log)
    except (OSError, ValueError, BenchError, ArtifactError, PackageMismatch, NInferError) as e:
        return fail(" ".join(str(e).split()))
    print(json.dumps(report.to_json()) if args.json else render(report))
    return 0


def engine_options(args: argparse.Namespace, plan: object) -> object:
    """`BenchOptions` for the in-process run: the bench's Engine flags, one request shape."""
    from ninfer.bench.drive import BenchPlan
    from ninfer.cli.common import bench_options, split_artifact
    from ninfer.targets.open import prefill_unit, resolve_device
    from ninfer.types import MAX_CONCURRENCY_LIMIT

    assert args.server is None
    levels = args.concurrency or DEFAULT_CONCURRENCY
    if max(levels) > MAX_CONCURRENCY_LIMIT:
        raise ValueError(f"--concurrency: an Engine runs at most {MAX_CONCURRENCY_LIMIT} requests at once")
    if args.artifact is not None and args.synthetic is not None:
        raise ValueError("give an ARTIFACT or --synthetic PACKAGE, not both")
    artifact = None
    if args.synthetic is None:
        artifact, _ = split_artifact([args.artifact] if args.artifact else [], 0, "")
    bench_plan = BenchPlan(
        batches=(max(levels),),
        context=args.prompt_tokens,
        decode_steps=args.max_tokens,
        prefill_tokens=args.prompt_tokens,
        prefill_repeats=1,
        prefill_chunk=prefill_unit(args.prefill_chunk, resolve_device(args.device), args.kernels),
    )
    return bench_options(args, bench_plan, artifact, prefix_cache=args.prefix_cache == "on")
