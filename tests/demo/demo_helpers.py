"""Shared pieces of the tools/train_demo tests: a small fake stdlib tree, a tiny package, oracle inputs."""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import torch
from ninfer_tools.train_demo.corpus import stdlib_root
from ninfer_tools.train_demo.model import DemoModel
from ninfer_tools.train_demo.tokenizer import QWEN_SPECIAL_TOKENS

from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.model import StateStore, StepBatch
from ninfer.targets.qwen3_6.variant import SpecialTokens, Variant

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

# real stdlib files copied into the fake tree: (relative path, expected split or None = excluded)
TRAIN_FILES = ("bisect.py", "colorsys.py", "fnmatch.py", "heapq.py", "keyword.py", "shlex.py", "textwrap.py")
HELDOUT_FILES = ("json/scanner.py", "json/tool.py")
EXCLUDED_COPIES = {  # destination -> a real stdlib source to copy there
    "test/test_fake.py": "bisect.py",
    "idlelib/idle_test/test_fake.py": "heapq.py",
    "lib2to3/tests/data/fake.py": "keyword.py",
    "site-packages/fake_pkg/__init__.py": "colorsys.py",
    "_sysconfigdata__fake.py": "keyword.py",
}


def make_fake_stdlib(root: Path) -> Path:
    """A small stdlib-shaped tree of real stdlib sources, with files in every excluded location."""
    real = stdlib_root()
    for rel in (*TRAIN_FILES, *HELDOUT_FILES):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(real / rel, root / rel)
    for dest, src in EXCLUDED_COPIES.items():
        (root / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(real / src, root / dest)
    (root / "json" / "README.txt").write_text("not python\n")
    return root


def val_modulus_for(paths: tuple[str, ...]) -> int:
    """The smallest modulus that puts at least one and at most half of ``paths`` in val."""
    for m in range(2, 200):
        n_val = sum(zlib.crc32(p.encode()) % m == 0 for p in paths)
        if 1 <= n_val <= len(paths) // 2:
            return m
    raise AssertionError("no usable modulus")


def special_for_vocab(vocab_size: int) -> SpecialTokens:
    """The ids a tokenizer of ``vocab_size`` gives the special tokens (they are the last 33 ids)."""
    first = vocab_size - len(QWEN_SPECIAL_TOKENS)
    at = {t: first + i for i, t in enumerate(QWEN_SPECIAL_TOKENS)}
    return SpecialTokens(
        endoftext=at["<|endoftext|>"],
        im_start=at["<|im_start|>"],
        im_end=at["<|im_end|>"],
        vision_start=at["<|vision_start|>"],
        vision_end=at["<|vision_end|>"],
        image_pad=at["<|image_pad|>"],
        video_pad=at["<|video_pad|>"],
        think_open=at["<think>"],
        think_close=at["</think>"],
        eos=(at["<|im_end|>"], at["<|endoftext|>"]),
    )


def tiny_package(vocab_size: int = 512) -> Package:
    """A 4-layer toy of the demo architecture (tied embeddings, MTP, no vision) for fast CPU training."""
    variant = Variant(
        hidden_size=64,
        num_layers=4,
        vocab_size=vocab_size,
        num_attention_heads=2,
        num_kv_heads=1,
        head_dim=32,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        intermediate_size=128,
        mrope_section=(2, 1, 1),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        mtp_num_hidden_layers=1,
        special=special_for_vocab(vocab_size),
    )
    return Package(name="qwen3_6_demo_test", variant=variant, description="tiny demo-shaped test package")


def perturbed_model(variant: Variant, seed: int) -> DemoModel:
    """Fresh weights with every norm moved off its init and matrices scaled up, so mistakes show."""
    model = DemoModel.fresh(variant, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.tensors().items():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if p.ndim == 1:
                p.add_(torch.rand(p.shape, generator=generator) - 0.5)
            else:
                p.mul_(3.0)
    return model


def fresh_rows_batch(
    variant: Variant, ids: torch.Tensor, page_size: int = 16
) -> tuple[StepBatch, StateStore]:
    """A prefill StepBatch of B equal-length rows [B, T] from zero state, and an empty fp32 store."""
    rows, seq = ids.shape
    pages_per_row = -(-seq // page_size)
    block_table = torch.arange(rows * pages_per_row, dtype=torch.int32).view(rows, pages_per_row)
    offsets = torch.arange(seq)
    slot_mapping = (block_table.long()[:, offsets // page_size] * page_size + offsets % page_size).reshape(-1)
    batch = StepBatch(
        token_ids=ids.reshape(-1),
        positions=torch.arange(seq).repeat(rows).expand(3, -1),
        query_start=torch.arange(rows + 1, dtype=torch.int32) * seq,
        context_lens=torch.full((rows,), seq, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=slot_mapping,
        state_in=torch.arange(rows),
        state_out=torch.arange(rows),
        fresh=torch.ones(rows, dtype=torch.bool),
    )
    store = StateStore.allocate(variant, rows, rows * pages_per_row, page_size, torch.float32, "cpu")
    return batch, store
