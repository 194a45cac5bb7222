"""Flags and helpers shared by the CLI commands that open an Engine."""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Any


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run (auto)")
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default="auto",
        help="compute dtype (auto: float32 on CPU, the artifact's storage dtype on GPU)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="context limit per request, tokens (default: on CUDA the model's 262,144 when one request "
        "that long fits in the KV pool, else the most that fits; on CPU 32,768)",
    )
    add_memory_flag(p)
    add_graph_flags(p)
    add_lookahead_flag(p)
    add_kernels_flag(p)


def add_graph_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="run decode, prefill and the vision tower eagerly on CUDA",
    )
    p.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=1024,
        metavar="N",
        help="one-row prefill chunks of up to N tokens replay CUDA graphs (EngineConfig.prefill_graph_tokens;"
        " 0: eager)",
    )
    add_vision_graph_flag(p)


def add_vision_graph_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--vision-graph-sizes",
        type=pixel_sizes,
        default=(),
        metavar="WxH[,WxH...]",
        help="image sizes (as sent) whose vision tower is captured as a CUDA graph at start; images of "
        "other sizes run it eagerly (EngineConfig.vision_graph_sizes; default none)",
    )


def pixel_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``"448x448,1024x768"`` -> ((448, 448), (1024, 768)): width x height in pixels, each >= 1."""
    sizes = []
    for part in text.split(","):
        w, sep, h = part.strip().lower().partition("x")
        if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
            raise argparse.ArgumentTypeError(f"expected WxH sizes such as 448x448, got {part!r}")
        sizes.append((int(w), int(h)))
    return tuple(sizes)


def add_memory_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gpu-memory-fraction",
        type=memory_fraction,
        default=None,
        metavar="F",
        help="share of the GPU's total memory NInfer may hold, weights included; the shared KV pool takes "
        "what the weights, working space and state slots leave of it (default 0.9; not used on CPU)",
    )


def memory_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def with_memory_flag(config: Any, args: argparse.Namespace) -> Any:
    """``config`` with ``--gpu-memory-fraction`` when it was given."""
    import dataclasses

    fraction = getattr(args, "gpu_memory_fraction", None)
    return config if fraction is None else dataclasses.replace(config, gpu_memory_fraction=fraction)


def announce_capacity(engine: Any, command: str) -> Any:
    """Say a generation Engine's KV pool and context limit on stderr (one line); returns the Engine."""
    if engine.config.purpose == "generation":
        print(f"ninfer {command}: {engine.capacity().describe()}", file=sys.stderr)
    return engine


def add_lookahead_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-decode-lookahead",
        action="store_true",
        help="on CUDA, wait for each decode step's tokens to be committed before queueing the next "
        "(default: the next step is queued first, so the GPU never waits for the host)",
    )


def decode_lookahead(args: argparse.Namespace) -> bool | None:
    """EngineConfig.decode_lookahead from the flag: off when asked, else the Engine's default."""
    return False if args.no_decode_lookahead else None


def bench_options(args: argparse.Namespace, plan: Any, artifact: str | None, *, prefix_cache: bool) -> Any:
    """`ninfer.bench.runner.BenchOptions` from the bench's Engine flags, for ``plan`` (every bench mode
    that starts an Engine in-process)."""
    from ninfer.bench.runner import BenchOptions

    return BenchOptions(
        plan=plan,
        artifact=artifact,
        synthetic=args.synthetic,
        device=args.device,
        dtype=args.dtype,
        cuda_graphs=not args.no_cuda_graphs,
        prefill_graph_tokens=args.prefill_graph_tokens,
        vision_graph_sizes=args.vision_graph_sizes,
        decode_lookahead=decode_lookahead(args),
        kernels=args.kernels,
        # `ninfer bench --speculative` is a list (a sweep over backends); the options carry the first
        speculative=args.speculative[0] if args.speculative else None,
        draft_vocab=args.draft_vocab,
        seed=args.seed,
        prefix_cache=prefix_cache,
        cache_memory_gb=args.cache_memory_gb,
        host_cache_gb=args.host_cache_gb or 0.0,
        gpu_memory_fraction=args.gpu_memory_fraction,
    )


def add_kernels_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kernels",
        choices=["auto", "reference", "fast"],
        default="auto",
        help="op implementations (auto: the fast Triton/fla-core ops on CUDA, the reference ops on CPU)",
    )


def add_reuse_flags(p: argparse.ArgumentParser) -> None:
    """The context cache and speculative decoding (`serve`, `generate`, `chat`): EngineConfig's
    ``prefix_cache``, ``cache_memory_gb``, ``host_cache_gb``, ``capture_interval`` and ``speculative``. A
    flag left out
    stays ``None`` (the Engine's default), so a command can tell it was not given."""
    p.add_argument(
        "--prefix-cache",
        type=on_off,
        default=None,
        metavar="on|off",
        help="reuse the state of prompt prefixes the Engine has run before (default on); the output is "
        "the same either way",
    )
    p.add_argument(
        "--cache-memory-gb",
        type=cache_memory_gb,
        default=None,
        metavar="GB",
        help="device memory for prefix checkpoints beyond the lanes' own (default: sized from the free "
        "memory on CUDA, a small amount on CPU)",
    )
    p.add_argument(
        "--host-cache-gb",
        type=cache_memory_gb,
        default=None,
        metavar="GB",
        help="host memory (pinned on CUDA) for checkpoints the device has no room for: moved there instead "
        "of dropped, and back when a later prompt continues them (default 0: no host tier)",
    )
    p.add_argument(
        "--capture-interval",
        type=positive_int,
        default=None,
        metavar="N",
        help="prompt tokens between two checkpoints inside a long prompt (default 8192)",
    )
    p.add_argument(
        "--speculative",
        type=speculative_method,
        default=None,
        metavar="mtp:K|dflash:K",
        help="speculative decoding with the model's MTP head (mtp:K, K = 1..8 drafts per verify) or its "
        "DFlash drafter (dflash:K, K = 1..15; an artifact converted with --dflash); default off, the "
        "output is the same as without",
    )
    p.add_argument(
        "--draft-vocab",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --speculative mtp:K or dflash:K, the draft head scores only the first N token ids (the "
        "frequent ones), reading that slice of lm_head per draft; lossless (default: the whole vocabulary)",
    )


def on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def cache_memory_gb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GB >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of GB >= 0, got {text!r}")
    return value


def comma_ints(text: str) -> list[int]:
    """An argparse helper: ``"1,4,8"`` -> [1, 4, 8] in the order given (empty parts skipped)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (token counts, repeats, sizes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def speculative_method(text: str) -> str:
    """``mtp:K`` or ``dflash:K`` checked by the Engine's own parser; the benchmark backend ``known:K@TAU``
    (whose output is scripted, not the model's) belongs to `ninfer bench` only."""
    from ninfer.types import MAX_DFLASH_DRAFT_TOKENS, MAX_DRAFT_TOKENS, parse_speculative

    method, _, count = text.partition(":")
    if method not in ("mtp", "dflash") or not count.isdigit():
        raise argparse.ArgumentTypeError(
            f"expected mtp:K (K = 1..{MAX_DRAFT_TOKENS} draft tokens per verify) or dflash:K (K = "
            f"1..{MAX_DFLASH_DRAFT_TOKENS}), got {text!r}"
            + ("; known:K@TAU is a benchmark backend (ninfer bench)" if text.startswith("known:") else "")
        )
    try:
        parse_speculative(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def reuse_config(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments of the flags `add_reuse_flags` added that were given."""
    given = {
        "prefix_cache": args.prefix_cache,
        "cache_memory_gb": args.cache_memory_gb,
        "host_cache_gb": args.host_cache_gb,
        "capture_interval": args.capture_interval,
        "speculative": args.speculative,
        "draft_vocab": args.draft_vocab,
    }
    return {name: value for name, value in given.items() if value is not None}


def speculative_problem(artifact_path: str, speculative: str | None) -> str | None:
    """Why ``speculative`` cannot run on the artifact's package, from its header alone (before any
    weight is read): ``mtp:K`` needs a package with an MTP layer, ``dflash:K`` an artifact with the
    package's DFlash drafter. None when it can (or when the header cannot be read: opening the Engine
    then reports that)."""
    if speculative is None:
        return None
    from ninfer.artifact import Artifact, ArtifactError
    from ninfer.targets.identity import check_identity

    try:
        with Artifact.open(artifact_path) as artifact:
            package = check_identity(artifact)
    except (ArtifactError, OSError, ValueError):
        return None
    if speculative.startswith("dflash:"):
        if package.has_dflash:
            return None
        return f"--speculative {speculative}: {package.missing_feature('dflash')}; drop --speculative"
    if "mtp" in package.features_off:  # a registered package's artifact converted without them
        return f"--speculative {speculative}: {package.missing_feature('mtp')}; drop --speculative"
    if not package.has_mtp:
        return (
            f"--speculative {speculative}: package {package.name!r} has no MTP layer (no multi-token "
            "prediction weights to draft with); drop --speculative"
        )
    return None


def interactive_engine_config(args: argparse.Namespace) -> Any:
    """The Engine of a one-user command (`generate`, `chat`): one lane, no queue, no warmup request."""
    from ninfer import EngineConfig

    return EngineConfig(
        max_concurrency=1,
        queue_capacity=1,
        device=args.device,
        dtype=args.dtype,
        max_context=args.max_context,
        cuda_graphs=not args.no_cuda_graphs,
        prefill_graph_tokens=args.prefill_graph_tokens,
        vision_graph_sizes=args.vision_graph_sizes,
        decode_lookahead=decode_lookahead(args),
        kernels=args.kernels,
        warmup=False,
        **reuse_config(args),
        **({"gpu_memory_fraction": args.gpu_memory_fraction} if args.gpu_memory_fraction is not None else {}),
    )


def one_line(message: object) -> str:
    """A message on one line (artifact and template errors can span several)."""
    return " ".join(str(message).split())


DEBUG = False  # `--debug`: set by main; an error given as an exception then prints its traceback too


def fail(message: object) -> int:
    """One line on stderr, exit status 1: the CLI's way to report a product error."""
    if DEBUG and isinstance(message, BaseException):
        traceback.print_exception(message, file=sys.stderr)
    print(f"ninfer: error: {one_line(message)}", file=sys.stderr)
    return 1


def product_errors() -> tuple[type[BaseException], ...]:
    """What opening an artifact, building an Engine or running a request raises for bad input (a corrupt
    or mismatched artifact, an invalid setting, a rejected request): reported as one line, exit 1."""
    from ninfer.artifact.errors import ArtifactError
    from ninfer.targets.registry import PackageMismatch
    from ninfer.types import NInferError

    return (OSError, ValueError, ArtifactError, PackageMismatch, NInferError)


def check_text(text: str, what: str) -> str | None:
    """Why ``text`` (from argv, a file or stdin) cannot be a prompt, or None: undecodable bytes reach
    Python as lone surrogates (``surrogateescape``), which no tokenizer takes."""
    for pos, char in enumerate(text):
        if "\ud800" <= char <= "\udfff":
            byte = f" (byte 0x{ord(char) - 0xDC00:02x})" if "\udc80" <= char <= "\udcff" else ""
            return f"{what} is not valid UTF-8 text: undecodable input at character {pos}{byte}"
    return None


BUNDLED_PACKAGE = "qwen3_6_demo"


def bundled_artifact() -> str:
    """Path of the demo model that ships inside the package (tools/train_demo made it)."""
    from importlib.resources import files

    return str(files("ninfer.targets.qwen3_6_demo") / "qwen3_6_demo.ninfer")


def split_artifact(positionals: list[str], inputs: int, what: str) -> tuple[str, list[str]]:
    """``[ARTIFACT] INPUT...``: with one positional more than ``inputs`` the first is the artifact;
    otherwise the bundled demo model is used and said so on stderr."""
    if len(positionals) == inputs + 1:
        return positionals[0], positionals[1:]
    if len(positionals) > inputs + 1:
        raise SystemExit(f"ninfer: error: expected [ARTIFACT] {what}, got {len(positionals)} arguments")
    if what == "PROMPT" and positionals and positionals[0].endswith(".ninfer"):
        # `ninfer generate model.ninfer` with the prompt forgotten: do not feed the path to the demo model
        raise SystemExit(f"ninfer: error: {positionals[0]!r} looks like an artifact; give a prompt after it")
    path = bundled_artifact()
    print(
        f"ninfer: no artifact given, using the bundled demo model {BUNDLED_PACKAGE} ({path})", file=sys.stderr
    )
    return path, positionals
