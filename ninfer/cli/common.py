"""Flags and helpers shared by the CLI commands that open an Engine."""

from __future__ import annotations

import argparse
import sys


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run (auto)")
    p.add_argument(
        "--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
        help="compute dtype (auto: float32 on CPU, the artifact's storage dtype on GPU)",
    )
    p.add_argument("--max-context", type=int, default=None, help="context limit per request (tokens)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode eagerly on CUDA")


def fail(message: str) -> int:
    """One line on stderr, exit status 1: the CLI's way to report a product error."""
    print(f"ninfer: error: {message}", file=sys.stderr)
    return 1
