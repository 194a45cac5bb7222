"""`ninfer serve ARTIFACT`: the OpenAI-compatible HTTP server over one Engine (FastAPI + uvicorn).

The server listens at once (``/health`` answers while the model loads) and ``/ready`` turns 200 when
the Engine is ready. Loopback by default; binding another address without ``--api-key`` prints a
warning. With ``--purpose causal_scoring`` the context limit is the scoring window: ``--max-context``
sets the window unless ``--score-window`` is given (resolved as for ``ninfer score``).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from typing import TYPE_CHECKING, Any

from ninfer.cli.common import (
    add_engine_flags,
    add_reuse_flags,
    announce_capacity,
    decode_lookahead,
    fail,
    reuse_config,
    speculative_problem,
    split_artifact,
    with_memory_flag,
)
from ninfer.cli.score import DEFAULT_SCORE_WINDOW, max_context_note, scoring_window
from ninfer.serve.limits import RequestLimits

if TYPE_CHECKING:
    from ninfer.serve.gateway import ServeConfig
    from ninfer.types import EngineConfig

API_KEY_ENV = "NINFER_API_KEY"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        description="Serve one .ninfer artifact over an OpenAI-compatible HTTP API "
        "(/v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, /health, /ready, "
        "/metrics, /reset_prefix_cache).",
    )
    p.add_argument(
        "artifact", nargs="?", default=None, help="a .ninfer file (default: the bundled demo model)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=tcp_port, default=8000, help="TCP port, 1..65535 (default 8000)")
    p.add_argument("--max-concurrency", type=int, default=4, help="requests generating at once, 1..8 (4)")
    p.add_argument(
        "--queue-capacity",
        type=int,
        default=64,
        help="requests waiting beyond the active ones (64); more get 429",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="longest wait for admission; then 503 (600)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else no key)",
    )
    p.add_argument(
        "--public-metrics",
        action="store_true",
        help="serve /metrics without the API key (default: only /health and /ready are open)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) clients may send; answers report the first (default: the package name). "
        "Give ARTIFACT before this flag",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        default=(),
        metavar="ORIGIN",
        help="CORS: browser origins (https://app.example.com, or * for any) allowed to call the API "
        "(default: none, no CORS headers)",
    )
    p.add_argument(
        "--synthetic",
        default=None,
        metavar="PACKAGE",
        help="serve random weights of PACKAGE's exact dims (load tests; the output is meaningless) "
        "instead of an artifact, as ninfer bench --synthetic",
    )
    limits = RequestLimits()
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=limits.max_body_bytes,
        help=f"largest request body; larger ones get 413 before they are read ({limits.max_body_bytes})",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=limits.header_timeout_s,
        metavar="S",
        help=f"seconds a connection may take to send a request's headers ({limits.header_timeout_s:g})",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=limits.body_timeout_s,
        metavar="S",
        help=f"seconds a request body may take after its headers; then 408 ({limits.body_timeout_s:g})",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=limits.max_connections,
        help=f"open connections (and requests in flight) beyond which uvicorn answers 503 "
        f"({limits.max_connections})",
    )
    p.add_argument(
        "--purpose",
        choices=["generation", "causal_scoring"],
        default="generation",
        help="generation (chat, completions) or causal_scoring (prompt log-probs only)",
    )
    p.add_argument(
        "--score-window",
        type=int,
        default=None,
        help="causal_scoring: tokens per scoring window, which is also the server's context "
        f"(default: --max-context if given, else {DEFAULT_SCORE_WINDOW})",
    )
    p.add_argument(
        "--score-stride",
        type=int,
        default=None,
        help="causal_scoring: tokens a scoring window advances by (default: half the window)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_media_flags(p)
    add_engine_flags(p)
    add_reuse_flags(p)
    p.set_defaults(func=run)


def add_media_flags(p: argparse.ArgumentParser) -> None:
    """Where chat image_url parts may come from (data: URLs always) and how large they may be."""
    from ninfer.product.media_acquire import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT_S

    g = p.add_argument_group("images (image_url content parts; data: URLs are always accepted)")
    g.add_argument(
        "--media-root",
        default=None,
        metavar="DIR",
        help="accept local image paths, only inside DIR (relative paths are taken from it; default: none)",
    )
    g.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="fetch http(s) image URLs (default: off); loopback/private/link-local addresses stay refused",
    )
    g.add_argument(
        "--allow-media-network",
        action="append",
        default=[],
        metavar="CIDR",
        help="with --allow-remote-media, also fetch from this otherwise refused network, e.g. an "
        "intranet image host's 10.1.2.0/24 (repeatable)",
    )
    g.add_argument(
        "--max-image-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help=f"largest image (data: payload, file or download) in bytes ({DEFAULT_MAX_BYTES})",
    )
    g.add_argument(
        "--media-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds one remote image fetch may take, redirects included ({DEFAULT_TIMEOUT_S:g})",
    )
    g.add_argument("--max-images", type=int, default=None, help="images per request (default 32)")
    g.add_argument(
        "--max-image-tokens",
        type=int,
        default=None,
        help="image tokens one request may carry; the vision tower's memory is reserved for this many "
        "(default 16384; a 1024 x 1024 image is 1024)",
    )


def image_input(args: argparse.Namespace, vision: bool | None = None) -> Any:
    """The gateway's ImageInput from the media flags; ValueError names an invalid one."""
    from ninfer.product.media_acquire import MediaPolicy
    from ninfer.product.prompt_input import DEFAULT_MAX_IMAGES
    from ninfer.serve.images import ImageInput

    if args.allow_media_network and not args.allow_remote_media:
        raise ValueError("--allow-media-network needs --allow-remote-media")
    if args.media_root is not None and not os.path.isdir(args.media_root):
        raise ValueError(f"--media-root {args.media_root!r} is not a directory")
    policy = MediaPolicy(
        media_root=args.media_root,
        allow_remote=args.allow_remote_media,
        allowed_networks=tuple(args.allow_media_network),
        max_bytes=args.max_image_bytes,
        timeout_s=args.media_timeout,
    )
    max_images = DEFAULT_MAX_IMAGES if args.max_images is None else args.max_images
    return ImageInput(policy=policy, max_images=max_images, vision=vision)


def tcp_port(text: str) -> int:
    """A TCP port to listen on, 1..65535 (uvicorn would silently listen elsewhere on 99999)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1..65535, got {port}")
    return port


def serve_config(args: argparse.Namespace, package_name: str, vision: bool | None = None) -> ServeConfig:
    """The gateway's settings from the flags; ValueError names an invalid one (a blank API key too).
    ``vision``: whether the package has a vision tower (None: unknown; the Engine refuses images then)."""
    from ninfer.serve.gateway import ServeConfig

    limits = RequestLimits(
        max_body_bytes=args.max_body_bytes,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
    )
    names = served_names(args.served_model_name)
    return ServeConfig(
        model_name=names[0] if names else package_name,
        model_aliases=tuple(names[1:]),
        api_key=args.api_key,
        limits=limits,
        public_metrics=args.public_metrics,
        images=image_input(args, vision),
        allowed_origins=tuple(args.allowed_origins),
    )


def served_names(names: list[str] | None) -> list[str]:
    """``--served-model-name`` values, checked: a name that is an artifact path means ARTIFACT came after
    the flag (argparse gave it to the names), which is refused rather than served as a model name."""
    names = list(names or ())
    for name in names:
        if not name.strip():
            raise ValueError("--served-model-name: a model name must not be empty")
        if name.endswith(".ninfer") or os.path.isfile(name):
            raise ValueError(
                f"--served-model-name {' '.join(names)}: {name!r} is a file, not a model name; give "
                "ARTIFACT before --served-model-name (ninfer serve ARTIFACT --served-model-name NAME ...)"
            )
    return list(dict.fromkeys(names))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The Engine's config from the flags. For causal_scoring the Engine's context is the scoring window
    (it holds one window at a time), so ``--max-context`` becomes the window rather than a limit the
    scoring Program could never hold; ``ValueError`` names an invalid value."""
    from ninfer.types import EngineConfig

    common: dict[str, Any] = {
        "purpose": args.purpose,
        "max_concurrency": args.max_concurrency,
        "queue_capacity": args.queue_capacity,
        "queue_timeout_s": args.queue_timeout,
        "device": args.device,
        "dtype": args.dtype,
        "cuda_graphs": not args.no_cuda_graphs,
        "prefill_graph_tokens": args.prefill_graph_tokens,
        "vision_graph_sizes": args.vision_graph_sizes,
        "decode_lookahead": decode_lookahead(args),
        "kernels": args.kernels,
    }
    if args.max_image_tokens is not None:
        common["max_image_tokens"] = args.max_image_tokens
    reuse = reuse_config(args)
    if args.purpose != "causal_scoring":
        if args.score_window is not None or args.score_stride is not None:
            raise ValueError("--score-window and --score-stride apply to --purpose causal_scoring only")
        return EngineConfig(max_context=args.max_context, **common, **reuse)
    if reuse:
        flags = ", ".join("--" + name.replace("_", "-") for name in reuse)
        raise ValueError(
            f"{flags}: for --purpose generation only (a scoring server neither caches nor drafts)"
        )
    note = max_context_note(args.score_window, args.max_context)
    if note is not None:
        print(f"ninfer serve: warning: {note}", file=sys.stderr)
    window, stride = scoring_window(args.score_window, args.score_stride, args.max_context)
    return EngineConfig(score_window=window, score_stride=stride, **common)


def run(args: argparse.Namespace) -> int:
    from ninfer.artifact import Artifact, ArtifactError
    from ninfer.runtime.engine.engine import Engine
    from ninfer.serve import create_app, serve_forever
    from ninfer.serve.observability import configure_logging
    from ninfer.targets.identity import check_identity
    from ninfer.targets.open import load_frontend

    try:
        config = with_memory_flag(engine_config(args), args)
        serve_config(args, "")  # flags first: a bad one is refused before the artifact is read
    except ValueError as e:
        return fail(str(e))
    if args.synthetic is not None:
        if args.artifact is not None:
            return fail("give an ARTIFACT or --synthetic PACKAGE, not both")
        return _run_synthetic(args, config)
    if args.artifact is None:
        args.artifact, _ = split_artifact([], 0, "")
    try:
        with Artifact.open(args.artifact) as artifact:
            package = check_identity(artifact)
        frontend = load_frontend(args.artifact)
    except (ArtifactError, OSError, ValueError) as e:
        return fail(" ".join(str(e).split()))
    problem = speculative_problem(args.artifact, config.speculative)
    if problem is not None:  # refused before listening, not as a failed /ready after the load
        return fail(problem)
    configure_logging(args.log_level)
    if not _is_loopback(args.host) and not args.api_key:
        print(
            f"ninfer serve: warning: listening on {args.host} without an API key; anyone who can reach the "
            f"port can use the model (set --api-key or ${API_KEY_ENV})",
            file=sys.stderr,
        )
    app = create_app(
        lambda: announce_capacity(Engine(args.artifact, config), "serve"),
        serve_config(args, package.name, vision=package.has_vision),
        frontend=frontend,
    )
    serve_forever(app, args.host, args.port, log_level=args.log_level)
    return 0


def _run_synthetic(args: argparse.Namespace, config: EngineConfig) -> int:
    """``--synthetic PACKAGE``: the package's real Program and Frontend over random weights materialised on
    the device (``ninfer.bench.startup``, as ``ninfer bench --synthetic``), served like an artifact."""
    from ninfer.bench.startup import start_synthetic, synthetic_frontend
    from ninfer.serve import create_app, serve_forever
    from ninfer.serve.observability import configure_logging
    from ninfer.targets.registry import PackageMismatch, get_package

    try:
        package = get_package(args.synthetic)
        frontend = synthetic_frontend(package)
    except (PackageMismatch, KeyError, ValueError) as e:
        return fail(f"--synthetic {args.synthetic}: {' '.join(str(e).split())}")
    if config.speculative is not None and not package.has_mtp:
        return fail(f"--speculative: package {package.name!r} has no MTP layer; drop --speculative")
    configure_logging(args.log_level)
    note = f"ninfer serve: synthetic weights of {package.name}: the output text is meaningless"
    print(note, file=sys.stderr)
    app = create_app(
        lambda: announce_capacity(start_synthetic(package.name, config, seed=0).engine, "serve"),
        serve_config(args, package.name, vision=package.has_vision),
        frontend=frontend,
    )
    serve_forever(app, args.host, args.port, log_level=args.log_level)
    return 0
