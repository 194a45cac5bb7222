"""Training corpus of the demo model: the Python standard library source of the running interpreter.

Split (by path relative to sysconfig's ``stdlib`` directory, all ``*.py`` files, sorted):

- excluded: ``site-packages/``, the ``test/`` tree, ``idlelib/idle_test/``, ``lib2to3/tests/`` (test
  data there includes deliberately broken and non-UTF-8 files) and the build-generated, machine-specific
  ``_sysconfigdata_*.py``;
- heldout: the ``asyncio/``, ``json/`` and ``email/`` packages (evaluation only: bits per byte, MTP
  accuracy);
- val: about 2% of the remaining files, picked by a hash of the path (stable when files come and go),
  used only to watch overfitting while training;
- train: the rest; the tokenizer is trained on these files only.

`build_corpus` writes, under ``out_dir``:

- ``text/{train,val,heldout}.txt``: the split's files concatenated byte-exactly in path order (no
  separators), so ``xz -9`` on ``heldout.txt`` is the compression baseline; ``text/manifest.json``
  gives each file's split, byte range and sha256;
- ``data/``: everything the GPU machine needs, no tokenizer run there: ``tokenizer.json``,
  ``chat_template.jinja`` (the real Qwen3.6 template),
  ``{train,val,heldout}.npy`` (uint16 token streams: ``<|endoftext|>`` then the file's tokens, per file)
  and ``meta.json`` (per-file token spans and byte counts, special ids, provenance).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import numpy as np

from ninfer.targets.qwen3_6.resources import RESOURCE_DIR

from .tokenizer import load_tokenizer, save_tokenizer, special_tokens_of, train_tokenizer

Split = Literal["train", "val", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "val", "heldout")

HELDOUT_PACKAGES = ("asyncio", "json", "email")
EXCLUDED_TREES = ("site-packages", "test", "idlelib/idle_test", "lib2to3/tests")
VAL_MODULUS = 50  # a file is in val when crc32(path) % VAL_MODULUS == 0 (about 2%)
DEFAULT_VOCAB_SIZE = 8192
# the real Qwen3.6 chat template, copied into data/ so the GPU machine needs nothing else
DEFAULT_CHAT_TEMPLATE = RESOURCE_DIR / "qwen3_6.jinja"


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib root, POSIX separators
    split: Split


def stdlib_root() -> Path:
    """The running interpreter's standard library directory (sysconfig 'stdlib')."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(rel: PurePosixPath, val_modulus: int = VAL_MODULUS) -> Split | None:
    """Which split a stdlib-relative ``*.py`` path belongs to; None when it is excluded."""
    text = rel.as_posix()
    if any(text == tree or text.startswith(tree + "/") for tree in EXCLUDED_TREES):
        return None
    if rel.name.startswith("_sysconfigdata_"):
        return None
    if rel.parts[0] in HELDOUT_PACKAGES and len(rel.parts) > 1:
        return "heldout"
    if zlib.crc32(text.encode("utf-8")) % val_modulus == 0:
        return "val"
    return "train"


def list_sources(root: Path, val_modulus: int = VAL_MODULUS) -> list[SourceFile]:
    """Every included ``*.py`` file under ``root`` with its split, in sorted path order."""
    out = []
    for path in root.rglob("*.py"):
        if not path.is_file():
            continue
        rel = PurePosixPath(path.relative_to(root).as_posix())
        split = split_of(rel, val_modulus)
        if split is not None:
            out.append(SourceFile(rel.as_posix(), split))
    return sorted(out, key=lambda f: f.path)


def read_source(root: Path, rel: str) -> str:
    """A source file as text; stdlib sources are UTF-8 (the excluded test trees hold the exceptions)."""
    return (root / rel).read_bytes().decode("utf-8")


def build_corpus(
    out_dir: str | Path,
    root: str | Path | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    val_modulus: int = VAL_MODULUS,
    chat_template: str | Path = DEFAULT_CHAT_TEMPLATE,
    log: bool = False,
) -> dict[str, Any]:
    """Split the stdlib, train the tokenizer on the train split, write text, tokens and meta; returns meta."""
    t0 = time.perf_counter()
    root = Path(root) if root is not None else stdlib_root()
    out = Path(out_dir)
    (out / "text").mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(parents=True, exist_ok=True)
    files = list_sources(root, val_modulus)
    texts = {f.path: read_source(root, f.path) for f in files}
    by_split: dict[Split, list[str]] = {s: [f.path for f in files if f.split == s] for s in SPLITS}
    for split in SPLITS:
        if not by_split[split]:
            raise ValueError(f"{root}: no files in the {split} split")

    manifest: dict[str, Any] = {"root": str(root), "files": []}
    for split in SPLITS:
        offset = 0
        with open(out / "text" / f"{split}.txt", "wb") as fh:
            for rel in by_split[split]:
                raw = texts[rel].encode("utf-8")
                fh.write(raw)
                manifest["files"].append(
                    {
                        "path": rel,
                        "split": split,
                        "start": offset,
                        "bytes": len(raw),
                        "sha256": hashlib.sha256(raw).hexdigest(),
                    }
                )
                offset += len(raw)
    (out / "text" / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    t_split = time.perf_counter()

    tok = train_tokenizer((texts[p] for p in by_split["train"]), vocab_size)
    save_tokenizer(tok, out / "data" / "tokenizer.json")
    (out / "data" / "chat_template.jinja").write_bytes(Path(chat_template).read_bytes())
    tok = load_tokenizer(out / "data" / "tokenizer.json")  # encode with exactly the saved file
    special = special_tokens_of(tok)
    t_tok = time.perf_counter()

    meta: dict[str, Any] = {
        "python": platform.python_version(),
        "stdlib": str(root),
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "endoftext_id": special.endoftext,
        "special": {k: v for k, v in special.__dict__.items() if k != "eos"} | {"eos": list(special.eos)},
        "layout": "per file: <|endoftext|> then the file's tokens; docs are [start, end) token spans",
        "splits": {},
    }
    for split in SPLITS:
        encodings = tok.encode_batch([texts[p] for p in by_split[split]], add_special_tokens=False)
        stream: list[int] = []
        docs = []
        for rel, enc in zip(by_split[split], encodings, strict=True):
            stream.append(special.endoftext)
            start = len(stream)
            stream.extend(enc.ids)
            docs.append({"path": rel, "start": start, "end": len(stream), "bytes": len(texts[rel].encode())})
        tokens = np.asarray(stream, dtype=np.uint16)
        if int(tokens.max()) >= meta["vocab_size"]:
            raise AssertionError("token id outside the vocabulary")
        np.save(out / "data" / f"{split}.npy", tokens)
        meta["splits"][split] = {
            "files": len(docs),
            "bytes": sum(d["bytes"] for d in docs),
            "tokens": len(stream),
            "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
            "docs": docs,
        }
    t_enc = time.perf_counter()
    meta["seconds"] = {
        "split_and_text": round(t_split - t0, 2),
        "tokenizer_training": round(t_tok - t_split, 2),
        "encoding": round(t_enc - t_tok, 2),
    }
    (out / "data" / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    if log:
        for split in SPLITS:
            s = meta["splits"][split]
            print(
                f"{split:8s} {s['files']:5d} files {s['bytes']:>10,d} bytes {s['tokens']:>9,d} tokens "
                f"({s['bytes'] / max(s['tokens'], 1):.2f} bytes/token)"
            )
        print(f"timings (s): {meta['seconds']}")
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--out", default="build/train_demo", help="output folder (git-ignored build/)")
    p.add_argument("--root", default=None, help="stdlib folder (default: this interpreter's)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = p.parse_args(argv)
    print(f"python {sys.version.split()[0]}, stdlib {args.root or stdlib_root()}")
    build_corpus(args.out, args.root, args.vocab_size, log=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
