"""`ninfer convert HF_DIR -o OUT.ninfer [--dtype bf16|fp16|fp32] [--package NAME] [--dflash DIR]`."""

from __future__ import annotations

import argparse
import sys

from ninfer.targets.package import STORAGE_PROFILES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint folder into a .ninfer artifact",
        description="Convert a Hugging Face Qwen3.5/3.6 checkpoint folder (config.json, safetensors "
        "shards, tokenizer.json, chat template) into one .ninfer artifact of a registered package.",
    )
    p.add_argument("hf_dir", metavar="HF_DIR", help="checkpoint folder")
    p.add_argument("-o", "--output", required=True, metavar="OUT.ninfer", help="artifact to write")
    p.add_argument(
        "--dtype",
        choices=list(STORAGE_PROFILES),
        default=None,
        help="storage profile (default: the source precision)",
    )
    p.add_argument(
        "--package", metavar="NAME", default=None, help="force a registered package (dims must match)"
    )
    p.add_argument(
        "--dflash", metavar="DRAFTER_DIR", default=None,
        help="a DFlash drafter checkpoint folder (z-lab's DFlashDraftModel) to store with the model, for "
        "--speculative dflash:K",
    )  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ninfer_tools.convert.qwen3_6 import ConvertError, convert

    from ninfer.artifact import ArtifactError

    try:
        out = convert(
            args.hf_dir, args.output, dtype=args.dtype, package=args.package, dflash_dir=args.dflash,
            progress=not args.no_progress,
        )  # fmt: skip
    except (ConvertError, ArtifactError, OSError) as e:
        print(f"ninfer convert: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    print(out)
    return 0
