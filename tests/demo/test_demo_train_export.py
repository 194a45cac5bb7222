"""A few CPU training steps of a tiny demo-shaped package, and the exported checkpoint end to end.

The export tests use the real ``qwen3_6_demo`` package (random weights, a tokenizer of its exact size)
with the package put into the registry for the test only, as the registry line adds it for good.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from demo_helpers import (
    TRAIN_FILES,
    fresh_rows_batch,
    make_fake_stdlib,
    perturbed_model,
    tiny_package,
    val_modulus_for,
)
from ninfer_tools.convert.qwen3_6 import convert
from ninfer_tools.train_demo.corpus import build_corpus, stdlib_root
from ninfer_tools.train_demo.export import export_checkpoint, load_checkpoint_tensors
from ninfer_tools.train_demo.model import DemoModel, reference_gdn_core, train_forward
from ninfer_tools.train_demo.tokenizer import save_tokenizer, train_tokenizer
from ninfer_tools.train_demo.train import (
    EpochWindows,
    TrainConfig,
    eval_window_losses,
    fixed_windows,
    load_corpus,
    lr_at,
    train,
)

from ninfer.targets import registry
from ninfer.targets.qwen3_6.binder import load_model_view
from ninfer.targets.qwen3_6.model import forward
from ninfer.targets.qwen3_6.resources import RESOURCE_DIR
from ninfer.targets.qwen3_6_demo import PACKAGE

torch.set_num_threads(1)
TINY = tiny_package(512)


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_fake_stdlib(tmp_path_factory.mktemp("stdlib"))
    out = tmp_path_factory.mktemp("corpus")
    build_corpus(out, root, TINY.variant.vocab_size, val_modulus=val_modulus_for(TRAIN_FILES))
    return out / "data"


def _config(data: Path, out: Path, **overrides: object) -> TrainConfig:
    base = dict(
        data_dir=str(data),
        out_dir=str(out),
        seed=7,
        seq_len=32,
        batch_size=8,
        lr=3e-3,
        warmup_steps=5,
        max_steps=30,
        time_budget_s=0.0,
        max_epochs=0.0,
        val_evals=4,
        eval_window=64,
        eval_stride=32,
        eval_batch=64,
        device="cpu",
        dropout=0.0,
        log_every=10,
    )
    base.update(overrides)
    return TrainConfig(**base)  # type: ignore[arg-type]


def test_lr_schedule() -> None:
    cfg = TrainConfig(lr=1e-3, min_lr_ratio=0.1, warmup_steps=10)
    assert lr_at(5, 100, cfg) == pytest.approx(5e-4)
    assert lr_at(10, 100, cfg) == pytest.approx(1e-3)
    assert lr_at(55, 100, cfg) == pytest.approx(0.55e-3)  # cosine midpoint between 1e-3 and 1e-4
    assert lr_at(100, 100, cfg) == pytest.approx(1e-4)
    assert lr_at(500, 100, cfg) == pytest.approx(1e-4)


def test_epoch_windows_cover_the_stream_once_per_epoch() -> None:
    sampler = EpochWindows(n_tokens=1000, seq_len=32, seed=0)
    first = sampler.next_starts(1).tolist()
    while sampler.remaining_in_epoch:
        first += sampler.next_starts(1).tolist()
    assert sampler.epoch == 1
    phase = min(first)
    assert phase < 32 and sorted(first) == list(range(phase, 1000 - 33, 32))  # all windows, each once
    sampler.next_starts(1)
    assert sampler.epoch == 2
    again = EpochWindows(n_tokens=1000, seq_len=32, seed=0)
    assert again.next_starts(len(first)).tolist() == first  # seeded order


def test_fixed_windows_overlap_by_one() -> None:
    w = fixed_windows(np.arange(100), 10)
    assert w.shape == (11, 10) and (w[1:, 0] == w[:-1, -1]).all()


def test_training_steps_lower_the_loss(tiny_corpus: Path, tmp_path: Path) -> None:
    cfg = _config(tiny_corpus, tmp_path / "ckpt")
    corpus = load_corpus(tiny_corpus)
    val = torch.as_tensor(fixed_windows(corpus.val, cfg.seq_len + 1))
    fresh = DemoModel.fresh(TINY.variant, cfg.seed)
    start_main, start_mtp = eval_window_losses(fresh, val, reference_gdn_core, 64, contextlib.nullcontext)
    assert start_main == pytest.approx(np.log(512), abs=0.3)
    assert start_mtp == pytest.approx(np.log(512), abs=0.3)

    lines: list[str] = []
    metrics = train(cfg, TINY, lines.append)
    assert metrics["steps"] == 30 and [h["step"] for h in metrics["val_history"]] == [7, 14, 21, 28, 30]
    assert metrics["best_val_loss"] < start_main - 0.7
    assert metrics["val_history"][-1]["val_mtp_loss"] < start_mtp - 0.7  # the MTP head learns too
    held = metrics["heldout"]["score_windows"]
    docs = corpus.meta["splits"]["heldout"]["docs"]
    assert held["bytes"] == corpus.meta["splits"]["heldout"]["bytes"]
    assert held["tokens_scored"] == sum(d["end"] - d["start"] for d in docs)  # every file token, once
    untrained_bpb = start_main / np.log(2) * held["tokens_scored"] / held["bytes"]
    assert 0.0 < held["bits_per_byte"] < 0.9 * untrained_bpb
    acc = metrics["heldout"]
    assert 0.01 < acc["mtp_acc"] < 1 and 0 < acc["mtp_agree_main"] <= 1 and acc["main_acc"] > 0.02
    assert any(line.startswith("step 30/30") for line in lines)

    out = Path(cfg.out_dir)
    assert json.loads((out / "config.json").read_text()) == TINY.hf_config()
    assert json.loads((out / "metrics.json").read_text())["best_val_loss"] == metrics["best_val_loss"]


def test_training_is_seed_reproducible(tiny_corpus: Path, tmp_path: Path) -> None:
    def run(seed: int) -> list[float]:
        cfg = _config(tiny_corpus, tmp_path, seed=seed, max_steps=6, val_evals=2, export=False, dropout=0.1)
        return [h["val_loss"] for h in train(cfg, TINY, lambda _: None)["val_history"]]

    first = run(7)
    assert len(first) == 2 and run(7) == first


@pytest.fixture(scope="module")
def demo_tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = [p.read_text(encoding="utf-8") for p in sorted(stdlib_root().glob("*.py"))[:30]]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    save_tokenizer(train_tokenizer(texts, PACKAGE.variant.vocab_size), path)
    return path


@pytest.fixture(scope="module")
def demo_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, demo_tokenizer_json: Path
) -> tuple[DemoModel, Path]:
    model = perturbed_model(PACKAGE.variant, seed=11)
    out = tmp_path_factory.mktemp("hf")
    export_checkpoint(
        out,
        PACKAGE,
        model.tensors(),
        demo_tokenizer_json,
        (RESOURCE_DIR / "qwen3_6.jinja").read_text(encoding="utf-8"),
        dtype=torch.float32,
    )
    return model, out


def test_export_folder_maps_to_the_demo_package(
    demo_checkpoint: tuple[DemoModel, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, out = demo_checkpoint
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00004.safetensors",
        "model-00002-of-00004.safetensors",
        "model-00003-of-00004.safetensors",
        "model-00004-of-00004.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert max((out / n).stat().st_size for n in names) < 16 * 2**20  # device-tool per-file limit
    config = json.loads((out / "config.json").read_text())
    monkeypatch.setitem(registry.PACKAGES, PACKAGE.name, PACKAGE)
    assert registry.package_for_hf_config(config) is PACKAGE
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert all(k.startswith(("model.language_model.", "mtp.")) for k in index["weight_map"])
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embedding
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(PACKAGE.variant.special.eos)


def test_exported_weights_give_the_training_logits(demo_checkpoint: tuple[DemoModel, Path]) -> None:
    """Reloaded export -> family inference forward (StateStore) == training forward, fp32."""
    model, out = demo_checkpoint
    tensors = load_checkpoint_tensors(out)
    reloaded = DemoModel(PACKAGE.variant, tensors)
    ids = torch.randint(0, PACKAGE.variant.vocab_size, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = train_forward(model.view(), PACKAGE.variant, ids).logits
        batch, store = fresh_rows_batch(PACKAGE.variant, ids)
        got = forward(reloaded.view(), PACKAGE.variant, batch, store, logits="all").logits
    assert got is not None
    torch.testing.assert_close(got.view(2, 70, -1), want, rtol=1e-4, atol=1e-4)


def test_convert_and_load_artifact(
    demo_checkpoint: tuple[DemoModel, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ninfer convert`'s converter accepts the folder; the artifact's weights give the same logits."""
    model, out = demo_checkpoint
    monkeypatch.setitem(registry.PACKAGES, PACKAGE.name, PACKAGE)
    artifact = convert(out, tmp_path / "demo.ninfer", dtype="fp32", progress=False)
    package, view = load_model_view(artifact, "cpu")
    assert package is PACKAGE
    ids = torch.randint(0, PACKAGE.variant.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = train_forward(model.view(), PACKAGE.variant, ids).logits
        batch, store = fresh_rows_batch(PACKAGE.variant, ids)
        got = forward(view, PACKAGE.variant, batch, store, logits="all").logits
    assert got is not None
    torch.testing.assert_close(got.view(1, 40, -1), want, rtol=1e-4, atol=1e-4)
