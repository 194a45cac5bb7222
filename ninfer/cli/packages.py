"""`ninfer packages [--json]`: every registered package with its identity and dims."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("packages", help="list registered packages and the checkpoints they accept")
    p.add_argument("--json", action="store_true", help="list of {package, hf_config} objects")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ninfer.targets.registry import PACKAGES

    if args.json:
        out = [{"package": p.name, "hf_config": p.hf_config()} for p in PACKAGES.values()]
        print(json.dumps(out, indent=2))
        return 0
    for p in PACKAGES.values():
        print(f"{p.name}{'  (test)' if p.test_only else ''}: {p.description}")
        billions = p.parameter_count / 1e9
        print(f"  family {p.family}, hf model_type {p.hf_model_type}, {billions:.3f}B parameters")
        for line in p.summary_lines():
            print(f"  {line}")
    return 0
