"""`ninfer bench [ARTIFACT] [--synthetic PACKAGE]`: decode and prefill speed through the public Engine.

Prints decode ms/step and tok/s per batch size B at a given context, prefill tok/s, TTFT and TPOT, each
beside the roofline of the package measured in the same run (bytes a decode step must read over the
measured memory bandwidth; prefill FLOPs over the measured matmul throughput), and the start-up time.
``--context 32768,131072,262144`` (several contexts, or one above 8,192) decodes each context's B rows
from one shared prefilled prompt through the context cache, beside the weights + KV floor. Without an
artifact and without ``--synthetic`` the bundled demo model runs. ``--multi-turn TURNS`` runs a
synthetic agent conversation through the context cache instead (per turn: TTFT and reused tokens beside
the TTFT of a cold prompt of only the new tokens), ``--image WxH[,WxH...]`` the vision tower and
one-image prompts beside the tower's FLOP floor. docs/benchmarks.md has the method and the recorded runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from ninfer.cli.bench_serving import add_serving_flags, run_serving, serving_mode
from ninfer.cli.common import (
    add_graph_flags,
    add_kernels_flag,
    add_lookahead_flag,
    add_memory_flag,
    bench_options,
    comma_ints,
    fail,
    positive_int,
    split_artifact,
)
from ninfer.types import MAX_CONCURRENCY_LIMIT

DEFAULT_BATCHES = (1, 2, 4, 8)
DEFAULT_PREFILL_TOKENS = 8192
DEFAULT_CONTEXT = 2048
SHARED_CONTEXT_ABOVE = 8192  # ninfer.bench.context's (not imported here: it pulls in the Engine)
PREFILL_OUTPUT_MIN = 2  # a prefill request's least output: its first token and one TPOT interval
DEFAULT_TURN_TOKENS = 2048
DEFAULT_REPLY_TOKENS = 32
DEFAULT_IMAGE_REPEATS = 5


def batch_list(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> (1, 2, 4, 8): distinct, ascending, each 1..MAX_CONCURRENCY_LIMIT."""
    values = sorted(set(comma_ints(text)))
    if not values or not all(1 <= v <= MAX_CONCURRENCY_LIMIT for v in values):
        raise argparse.ArgumentTypeError(f"batch sizes must be 1..{MAX_CONCURRENCY_LIMIT}, got {text!r}")
    return tuple(values)


def context_list(text: str) -> tuple[int, ...]:
    """``"32768,131072"`` -> (32768, 131072): distinct, ascending, each >= 1 (the model's limit is checked
    once the package is known)."""
    values = sorted(set(comma_ints(text)))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"contexts must be >= 1, got {text!r}")
    return tuple(values)


def nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def bound_list(text: str) -> tuple[float, ...]:
    """``"100,120"`` -> (100.0, 120.0): each > 0, in the order given."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds such as 100,120, got {text!r}") from None
    if not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"pacing bounds must be > 0 ms, got {text!r}")
    return values


def image_sizes(text: str) -> tuple[tuple[int, int], ...]:
    from ninfer.bench.image import parse_sizes

    try:
        return parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    p.add_argument("--batch", type=batch_list, default=None, help="batch sizes B (1,2,4,8)")
    p.add_argument(
        "--context",
        type=context_list,
        default=(DEFAULT_CONTEXT,),
        metavar="N[,N...]",
        help=f"prompt tokens per decode request ({DEFAULT_CONTEXT}); several, or one above "
        f"{SHARED_CONTEXT_ABOVE}: the long-context decode, whose B rows share one prefilled prompt per "
        "context through the context cache",
    )
    p.add_argument("--decode-steps", type=positive_int, default=64, help="timed decode rounds per B")
    p.add_argument(
        "--prefill-tokens",
        type=positive_int,
        default=None,
        help=f"prompt tokens of the prefill/TTFT request, up to the model's positions (default "
        f"{DEFAULT_PREFILL_TOKENS}, capped to fit them); near the limit it decodes fewer TPOT tokens",
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
    add_graph_flags(p)
    add_memory_flag(p)
    add_lookahead_flag(p)
    add_kernels_flag(p)
    p.add_argument(
        "--speculative",
        metavar="SPEC[,SPEC...]",
        type=speculative_list,
        default=None,
        help="decode backend: mtp:K, dflash:K, or known:K@TAU (a benchmark backend: K drafts a verify, "
        "TAU tokens accepted per row on average, through the real verify and commit; output text is "
        "meaningless); "
        "several, comma-separated (off: plain decoding), run the standard suite once each over one set "
        "of weights, e.g. off,mtp:1,mtp:3",
    )
    p.add_argument(
        "--draft-vocab",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --speculative mtp:K or dflash:K: the draft head scores only the first N token ids "
        "(EngineConfig.draft_vocab; default: the whole vocabulary)",
    )
    p.add_argument(
        "--prefix-cache",
        choices=["on", "off"],
        default=None,
        help="the context cache (EngineConfig.prefix_cache): off by default (cold prompts), always on with "
        "--multi-turn",
    )
    p.add_argument(
        "--cache-memory-gb",
        type=nonnegative_float,
        default=None,
        help="device memory for checkpoints beyond the lanes' (EngineConfig.cache_memory_gb; default: sized "
        "by the Engine); needs the cache on",
    )
    p.add_argument(
        "--host-cache-gb",
        type=nonnegative_float,
        default=None,
        help="host memory for checkpoints offloaded from the device (EngineConfig.host_cache_gb; default 0: "
        "no host tier); needs the cache on",
    )
    p.add_argument(
        "--multi-turn",
        type=positive_int,
        metavar="TURNS",
        default=None,
        help="run a synthetic agent conversation of TURNS turns (e.g. 10) through the context cache instead "
        "of the standard suite; --context and --decode-steps then set its B=1 decode comparison",
    )
    p.add_argument(
        "--turn-tokens",
        type=positive_int,
        default=None,
        help=f"new user-message tokens per turn of --multi-turn (default {DEFAULT_TURN_TOKENS})",
    )
    p.add_argument(
        "--reply-tokens",
        type=positive_int,
        default=None,
        help=f"reply tokens per turn of --multi-turn (>= 2, default {DEFAULT_REPLY_TOKENS})",
    )
    p.add_argument(
        "--image",
        type=image_sizes,
        metavar="WxH[,WxH...]",
        default=None,
        help="time the vision tower and one-image prompts at these sizes instead of the standard suite",
    )
    p.add_argument(
        "--image-repeats", type=positive_int, default=None, help="timed runs per size of --image (median; 5)"
    )
    p.add_argument(
        "--interference",
        type=positive_int,
        metavar="PROMPT_TOKENS",
        default=None,
        help="decoding streams' inter-token gaps while a prompt of this many tokens arrives, with prefill "
        "pacing on and off, instead of the standard suite",
    )
    p.add_argument(
        "--streams", type=positive_int, default=None, help="requests decoding in --interference (default 4)"
    )
    p.add_argument(
        "--max-decode-gap-ms",
        type=bound_list,
        default=None,
        help="MS[,MS...]: the pacing bounds of --interference's paced runs, one Engine each, before the "
        "unpaced one (default: the Engine's bound, 100 ms on CUDA)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights and the prompt ids")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_serving_flags(p)
    p.set_defaults(func=run)


def _prefill_tokens(args: argparse.Namespace, max_positions: int) -> int:
    """The requested prefill length (up to the model's positions: a prompt needs room for its least
    output, `PREFILL_OUTPUT_MIN` tokens, so one at the limit is shortened by that, said on stderr), or the
    default capped so prompt + decoded tokens fit the model. Beyond the positions: refused later."""
    if args.prefill_tokens is not None:
        tokens = int(args.prefill_tokens)
        room = max_positions - PREFILL_OUTPUT_MIN
        if room < tokens <= max_positions:
            print(
                f"ninfer: the model holds {max_positions} positions and a prefill request also outputs "
                f"{PREFILL_OUTPUT_MIN} tokens; prefill uses {room}",
                file=sys.stderr,
            )
            return room
        return tokens
    cap = max_positions - args.decode_steps - 1
    if cap < DEFAULT_PREFILL_TOKENS:
        print(f"ninfer: the model holds {max_positions} positions; prefill uses {cap}", file=sys.stderr)
    return max(1, min(DEFAULT_PREFILL_TOKENS, cap))


def _prefill_output_tokens(args: argparse.Namespace, prefill_tokens: int, max_positions: int) -> int | None:
    """Output tokens of each prefill request: ``decode_steps + 1`` (None) unless the prompt leaves fewer
    positions, then what is left (at least `PREFILL_OUTPUT_MIN`; less is refused by the plan's check)."""
    room = max_positions - prefill_tokens
    if room >= args.decode_steps + 1:
        return None
    return max(PREFILL_OUTPUT_MIN, room)


def is_long_context(contexts: tuple[int, ...]) -> bool:
    """Several contexts, or one above `SHARED_CONTEXT_ABOVE`: the long-context decode."""
    return len(contexts) > 1 or max(contexts) > SHARED_CONTEXT_ABOVE


def speculative_list(text: str) -> tuple[str | None, ...]:
    """``--speculative``: one decode backend or a comma-separated sweep of them (``off``: plain decoding);
    ArgumentTypeError names a bad entry."""
    from ninfer.types import parse_speculative

    out: list[str | None] = []
    for item in (part.strip() for part in text.split(",")):
        if item == "off":
            out.append(None)
            continue
        try:
            parse_speculative(item)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        out.append(item)
    return tuple(out)


def mode_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the mode flags together, or None."""
    multi, image = args.multi_turn is not None, args.image is not None
    interference = args.interference is not None
    if multi + image + interference > 1:
        return "give one of --multi-turn, --image and --interference"
    long_context = is_long_context(args.context)
    if (multi or interference) and len(args.context) > 1:
        return f"--context takes one value with {'--multi-turn' if multi else '--interference'}"
    if long_context and not (multi or image or interference) and args.prefix_cache == "off":
        return (
            "the long-context decode (several --context values, or one above "
            f"{SHARED_CONTEXT_ABOVE}) shares one prefilled prompt per context through the context cache; "
            "drop --prefix-cache off"
        )
    if not interference:
        for flag in ("streams", "max_decode_gap_ms"):
            if getattr(args, flag) is not None:
                return f"--{flag.replace('_', '-')} needs --interference"
    elif args.batch is not None or args.speculative is not None or args.prefix_cache == "on":
        return (
            "--interference runs its own streams, cold and without drafts: drop --batch, --speculative "
            "and --prefix-cache"
        )
    if not multi:
        for flag in ("turn_tokens", "reply_tokens"):
            if getattr(args, flag) is not None:
                return f"--{flag.replace('_', '-')} needs --multi-turn"
    if not image and args.image_repeats is not None:
        return "--image-repeats needs --image"
    if multi and args.prefix_cache == "off":
        return "--multi-turn always runs with the context cache on; drop --prefix-cache off"
    cache_on = multi or args.prefix_cache == "on" or (long_context and not (image or interference))
    if args.cache_memory_gb is not None and not cache_on:
        return "--cache-memory-gb needs the context cache: add --prefix-cache on (or --multi-turn)"
    if args.host_cache_gb is not None and not cache_on:
        return "--host-cache-gb needs the context cache: add --prefix-cache on (or --multi-turn)"
    if (multi or image) and args.batch is not None:
        return f"--batch is for the standard suite; {'--multi-turn' if multi else '--image'} runs B=1"
    if (multi or image) and args.speculative is not None:
        return f"--speculative is for the standard suite, not {'--multi-turn' if multi else '--image'}"
    if multi and (args.reply_tokens or DEFAULT_REPLY_TOKENS) < 2:
        return "--reply-tokens must be >= 2 (a decode unit follows each turn's prefill)"
    return None


def run(args: argparse.Namespace) -> int:
    import torch

    from ninfer.artifact.errors import ArtifactError
    from ninfer.bench.drive import BenchError, BenchPlan
    from ninfer.bench.report import BenchReport, render_table
    from ninfer.bench.runner import run_bench, run_bench_sweep
    from ninfer.targets.open import artifact_package, prefill_unit, resolve_device
    from ninfer.targets.registry import PackageMismatch, get_package
    from ninfer.types import NInferError

    if serving_mode(args):  # the serving workload (ninfer/cli/bench_serving.py)
        return run_serving(args)
    if args.artifact is not None and args.synthetic is not None:
        return fail("give an ARTIFACT or --synthetic PACKAGE, not both")
    problem = mode_problem(args)
    if problem is not None:
        return fail(problem)
    multi, image = args.multi_turn is not None, args.image is not None
    interference = args.interference is not None
    try:
        if args.synthetic is not None:
            artifact = None
            package = get_package(args.synthetic)
        else:
            artifact, _ = split_artifact([args.artifact] if args.artifact else [], 0, "")
            package, _ = artifact_package(artifact)
        # the Engine's own unit unless given: the plan needs it before the Engine starts
        chunk = prefill_unit(args.prefill_chunk, resolve_device(args.device), args.kernels)
        batches = args.batch or DEFAULT_BATCHES
        standard = not (multi or image or interference)
        positions = package.variant.max_position_embeddings
        prefill_tokens = _prefill_tokens(args, positions) if standard else 1
        contexts = args.context if standard and is_long_context(args.context) else ()
        plan = BenchPlan(
            batches=batches,
            context=args.context[-1],
            decode_steps=args.decode_steps,
            prefill_tokens=prefill_tokens,
            prefill_repeats=args.prefill_repeats,
            prefill_chunk=chunk,
            contexts=contexts,
            prefill_output_tokens=(
                _prefill_output_tokens(args, prefill_tokens, positions) if standard else None
            ),
        )
        options = bench_options(args, plan, artifact, prefix_cache=multi or args.prefix_cache == "on")
        log = lambda line: print(f"ninfer bench: {line}", file=sys.stderr)  # noqa: E731
        if multi:
            from ninfer.bench.multiturn import MultiTurnPlan, render_multi_turn, run_multi_turn

            turn_plan = MultiTurnPlan(
                turns=args.multi_turn,
                turn_tokens=args.turn_tokens or DEFAULT_TURN_TOKENS,
                reply_tokens=args.reply_tokens or DEFAULT_REPLY_TOKENS,
                context=args.context[0],
                decode_steps=args.decode_steps,
                prefill_chunk=chunk,
            )
            report: object = run_multi_turn(options, turn_plan, log=log)
            render = render_multi_turn
        elif interference:
            from ninfer.bench.interference import InterferencePlan, render_interference, run_interference

            interference_plan = InterferencePlan(
                prompt_tokens=args.interference,
                streams=args.streams or 4,
                context=args.context[0],
                bounds_ms=args.max_decode_gap_ms or (None,),
            )
            report = run_interference(options, interference_plan, log=log)
            render = render_interference
        elif image:
            from ninfer.bench.image import ImagePlan, render_image, run_image

            image_plan = ImagePlan(
                sizes=args.image, repeats=args.image_repeats or DEFAULT_IMAGE_REPEATS, prefill_chunk=chunk
            )
            report = run_image(options, image_plan, log=log)
            render = render_image
        elif args.speculative is not None and len(args.speculative) > 1:
            # one report per backend as it finishes (with --json: one JSON object per line)
            def show(r: BenchReport) -> None:
                speculative = r.settings["speculative"] or "off"
                text = (
                    json.dumps(r.to_json())
                    if args.json
                    else f"== speculative: {speculative}\n{render_table(r)}\n"
                )
                print(text, flush=True)

            run_bench_sweep(options, args.speculative, log=log, finished=show)
            return 0
        else:
            report = run_bench(options, log=log)
            render = render_table
    except torch.cuda.OutOfMemoryError as e:
        return fail(f"out of device memory: {e}; lower --batch, --context or --prefill-tokens")
    except (OSError, ValueError, PackageMismatch, ArtifactError, NInferError, BenchError) as e:
        return fail(str(e))
    print(json.dumps(report.to_json()) if args.json else render(report))  # type: ignore[attr-defined,arg-type]
    return 0
