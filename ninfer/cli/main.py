"""`ninfer` console entry point: one subcommand per module in ``ninfer/cli``.

Each subcommand module defines ``register(subparsers)`` (adds its parser and sets ``func``).
Modules are imported only for the command that runs, so ``ninfer packages`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from argparse import SUPPRESS
from typing import NoReturn

from ninfer.cli import common
from ninfer.cli.common import fail
from ninfer.version import version

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


class CLIParser(argparse.ArgumentParser):
    """argparse with a bad flag reported as one line (``ninfer serve: error: ...``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


DEBUG_HELP = "print the full traceback of an error instead of one line"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = CLIParser(prog="ninfer", description="Qwen3.6-family inference engine")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    parser.add_argument("--version", action="version", version=f"ninfer {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CLIParser)
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name)  # listed in --help; its flags load only when it runs
            continue
        importlib.import_module(f"ninfer.cli.{module}").register(sub)
        # after the command (``ninfer generate ... --debug``) as well as before it
        sub.choices[name].add_argument("--debug", action="store_true", default=SUPPRESS, help=DEBUG_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    command = command if command in COMMANDS else None
    parser = build_parser(only=command)
    args = parser.parse_args(argv)
    if command is None or not hasattr(args, "func"):
        parser.print_help()
        return 2
    common.DEBUG = bool(args.debug)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (``ninfer inspect --json | head``): not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush cannot raise again
        return 141
    except Exception as exc:  # noqa: BLE001 - an unforeseen error is still one line unless --debug
        if args.debug:
            raise
        return fail(f"{type(exc).__name__}: {exc} (run with --debug for the traceback)")


if __name__ == "__main__":
    sys.exit(main())
