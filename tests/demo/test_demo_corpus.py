"""The demo corpus: split rules on the real stdlib; the built text, tokens and meta on a small tree."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
from demo_helpers import EXCLUDED_COPIES, HELDOUT_FILES, TRAIN_FILES, make_fake_stdlib, val_modulus_for
from ninfer_tools.train_demo.corpus import (
    HELDOUT_PACKAGES,
    build_corpus,
    list_sources,
    split_of,
    stdlib_root,
)
from ninfer_tools.train_demo.tokenizer import QWEN_SPECIAL_TOKENS, load_tokenizer

VOCAB = 512


@pytest.mark.parametrize(
    ("path", "split"),
    [
        ("asyncio/base_events.py", "heldout"),
        ("json/__init__.py", "heldout"),
        ("email/mime/text.py", "heldout"),
        ("test/test_json.py", None),
        ("test/support/__init__.py", None),
        ("idlelib/idle_test/test_run.py", None),
        ("lib2to3/tests/data/bom.py", None),
        ("site-packages/pip/__init__.py", None),
        ("_sysconfigdata__linux_x86_64-linux-gnu.py", None),
    ],
)
def test_split_rules(path: str, split: str | None) -> None:
    assert split_of(PurePosixPath(path)) == split


@pytest.mark.parametrize(
    "path", ["jsonrpc.py", "emailish/x.py", "testing.py", "idlelib/run.py", "unittest/test/x.py"]
)
def test_lookalikes_are_training_text(path: str) -> None:
    assert split_of(PurePosixPath(path)) in ("train", "val")


def test_real_stdlib_split() -> None:
    root = stdlib_root()
    files = list_sources(root)
    paths = [f.path for f in files]
    assert paths == sorted(paths) and len(set(paths)) == len(paths)
    heldout = {f.path for f in files if f.split == "heldout"}
    expected = {
        p.relative_to(root).as_posix() for pkg in HELDOUT_PACKAGES for p in (root / pkg).rglob("*.py")
    }
    assert heldout == expected and any(p.startswith("email/") for p in heldout)
    assert not any(
        p.startswith(("test/", "site-packages/", "idlelib/idle_test/", "lib2to3/tests/")) for p in paths
    )
    n_val = sum(f.split == "val" for f in files)
    n_train = sum(f.split == "train" for f in files)
    assert n_train > 500 and 0.005 < n_val / (n_val + n_train) < 0.05
    assert list_sources(root) == files  # deterministic


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    root = make_fake_stdlib(tmp_path_factory.mktemp("stdlib"))
    out = tmp_path_factory.mktemp("corpus")
    meta = build_corpus(out, root, VOCAB, val_modulus=val_modulus_for(TRAIN_FILES))
    return root, out, meta


def test_built_split_and_text_files(built: tuple[Path, Path, dict]) -> None:
    root, out, meta = built
    manifest = json.loads((out / "text" / "manifest.json").read_text())
    by_split: dict[str, list[str]] = {}
    for entry in manifest["files"]:
        by_split.setdefault(entry["split"], []).append(entry["path"])
    assert by_split["heldout"] == sorted(HELDOUT_FILES)
    assert sorted(by_split["train"] + by_split["val"]) == sorted(TRAIN_FILES)
    assert by_split["val"] and by_split["train"]
    listed = {e["path"] for e in manifest["files"]}
    assert not listed & set(EXCLUDED_COPIES)
    for split, paths in by_split.items():
        blob = (out / "text" / f"{split}.txt").read_bytes()
        assert blob == b"".join((root / p).read_bytes() for p in paths)  # byte-exact, in path order
        for e in (e for e in manifest["files"] if e["split"] == split):
            assert blob[e["start"] : e["start"] + e["bytes"]] == (root / e["path"]).read_bytes()
        assert meta["splits"][split]["bytes"] == len(blob)


def test_built_token_streams(built: tuple[Path, Path, dict]) -> None:
    root, out, meta = built
    tok = load_tokenizer(out / "data" / "tokenizer.json")
    eot = meta["endoftext_id"]
    assert eot == VOCAB - len(QWEN_SPECIAL_TOKENS) == tok.token_to_id("<|endoftext|>")
    assert meta["vocab_size"] == VOCAB
    for split in ("train", "val", "heldout"):
        tokens = np.load(out / "data" / f"{split}.npy")
        assert tokens.dtype == np.uint16 and len(tokens) == meta["splits"][split]["tokens"]
        docs = meta["splits"][split]["docs"]
        assert sum(int(t == eot) for t in tokens) == len(docs)
        end = 0
        for doc in docs:
            assert (
                doc["start"] == end + 1 and tokens[doc["start"] - 1] == eot
            )  # <|endoftext|> before each file
            text = (root / doc["path"]).read_text(encoding="utf-8")
            decoded = tok.decode(tokens[doc["start"] : doc["end"]].tolist(), skip_special_tokens=False)
            assert decoded == unicodedata.normalize("NFC", text)
            assert doc["bytes"] == len(text.encode())
            end = doc["end"]
        assert end == len(tokens)
    assert (out / "data" / "chat_template.jinja").read_text().startswith("{%")


def test_build_is_deterministic(built: tuple[Path, Path, dict], tmp_path: Path) -> None:
    root, out, meta = built
    again = build_corpus(tmp_path, root, VOCAB, val_modulus=val_modulus_for(TRAIN_FILES))
    for name in ("tokenizer.json", "train.npy", "val.npy", "heldout.npy"):
        assert (tmp_path / "data" / name).read_bytes() == (out / "data" / name).read_bytes(), name
    assert again["splits"] == meta["splits"]
