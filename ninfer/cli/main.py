"""`ninfer` console entry point: one subcommand per module in ``ninfer/cli``.

Each subcommand module defines ``register(subparsers)`` (adds its parser and sets ``func``).
Modules are imported only for the command that runs, so ``ninfer packages`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module under ninfer.cli (each owns its flags and its run function)
COMMANDS: dict[str, str] = {
    "packages": "packages",
    "inspect": "inspect_cmd",
    "convert": "convert",
    "generate": "generate",
    "chat": "chat",
    "score": "score",
    "serve": "serve",
    "bench": "bench",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description="Qwen3.6-family inference engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name)  # listed in --help; its flags load only when it runs
            continue
        importlib.import_module(f"ninfer.cli.{module}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(only=command)
    args = parser.parse_args(argv)
    if command is None or not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
