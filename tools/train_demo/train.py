"""Train the bundled demo model (package ``qwen3_6_demo``) on the prepared stdlib corpus in a time budget.

Reads only the prepared files of `tools.train_demo.corpus` (``data/``: token streams, tokenizer.json,
chat template, meta.json), so the GPU machine needs no tokenizer run and no network.

Recipe: AdamW (decoupled weight decay on matrices), linear warmup then cosine decay, bf16 autocast on
CUDA, joint loss ``CE(next token) + mtp_weight * CE(MTP next-next token)``. Each epoch cuts the train
stream into non-overlapping windows at a random phase and visits them in a random order.

Time budget: ``--time-budget-s`` counts from process start. After ``--calibrate-steps`` steps the measured
step time fixes the number of steps that fits before ``budget - eval_reserve``; from then on the learning
rate depends on the step only, so ``--max-steps N`` (with ``--time-budget-s 0``) replays a run exactly,
up to GPU kernel non-determinism. The val split is scored ``--val-evals`` times; the weights with the best
val loss are kept. At the end: held-out bits per byte (per file, scored as ``ninfer score`` does, in
windows), MTP next-next-token accuracy, and the HF checkpoint folder with ``metrics.json``.

    python -m tools.train_demo.train --data build/train_demo/data --out build/train_demo/ckpt
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ninfer.runtime.scoring.core import plan_windows
from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.variant import Variant

from .export import export_checkpoint
from .model import DemoModel, GdnCore, reference_gdn_core, select_gdn_core, train_forward

LN2 = math.log(2.0)


@dataclass
class TrainConfig:
    data_dir: str = "build/train_demo/data"
    out_dir: str = "build/train_demo/checkpoint"
    seed: int = 0
    seq_len: int = 1024
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    dropout: float = 0.1  # on embeddings and residual branches: the corpus is small, training multi-epoch
    mtp_weight: float = 0.3
    time_budget_s: float = 450.0  # whole run from process start; 0: no time limit (needs max_steps)
    eval_reserve_s: float = 60.0  # kept free at the end for the final evaluation and the export
    max_steps: int = 0  # 0: planned from the measured step time (and max_epochs)
    max_epochs: float = 20.0  # cap on the planned steps (0: none), so the cosine ends before overfitting
    calibrate_steps: int = 30
    val_evals: int = 12
    eval_window: int = 2048  # ninfer score's default window / stride
    eval_stride: int = 1024
    eval_batch: int = 16
    device: str = "auto"
    amp: bool = True  # bf16 autocast on CUDA (CPU always runs fp32)
    gdn_impl: str = "auto"  # auto | fla | compiled | reference (see model.select_gdn_core)
    log_every: int = 50
    export: bool = True


# ---- data ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    meta: dict[str, Any]
    train: np.ndarray
    val: np.ndarray
    heldout: np.ndarray


def load_corpus(data_dir: str | Path) -> Corpus:
    root = Path(data_dir)
    meta = json.loads((root / "meta.json").read_text(encoding="utf-8"))
    splits = {s: np.load(root / f"{s}.npy").astype(np.int64) for s in ("train", "val", "heldout")}
    return Corpus(meta=meta, **splits)


def check_corpus(corpus: Corpus, package: Package) -> None:
    """The prepared tokens must be of this package's vocabulary and special ids."""
    variant = package.variant
    if corpus.meta["vocab_size"] != variant.vocab_size:
        raise ValueError(f"corpus vocab {corpus.meta['vocab_size']} != package vocab {variant.vocab_size}")
    special = dataclasses.asdict(variant.special)
    special["eos"] = list(special["eos"])
    if corpus.meta["special"] != special:
        raise ValueError(f"corpus special ids {corpus.meta['special']} != package {special}")


class EpochWindows:
    """Windows of ``seq_len + 1`` tokens: per epoch a random phase, non-overlapping, random order."""

    def __init__(self, n_tokens: int, seq_len: int, seed: int) -> None:
        if n_tokens < 2 * (seq_len + 1):
            raise ValueError(f"train stream of {n_tokens} tokens is too short for seq_len {seq_len}")
        self.n_tokens, self.seq_len = n_tokens, seq_len
        self.rng = np.random.default_rng(seed)
        self.epoch = 0
        self._queue: list[int] = []
        self._served = 0

    def _refill(self) -> None:
        phase = int(self.rng.integers(0, self.seq_len))
        starts = np.arange(phase, self.n_tokens - self.seq_len - 1, self.seq_len)
        self._queue = list(self.rng.permutation(starts))
        self.epoch += 1

    def next_starts(self, count: int) -> np.ndarray:
        out = []
        while len(out) < count:
            if not self._queue:
                self._refill()
            out.append(self._queue.pop())
        self._served += count
        return np.asarray(out, dtype=np.int64)

    @property
    def remaining_in_epoch(self) -> int:
        return len(self._queue)

    @property
    def windows_per_epoch(self) -> int:
        return max(1, (self.n_tokens - 1) // self.seq_len)

    @property
    def epochs_done(self) -> float:
        return self._served / self.windows_per_epoch


def gather_windows(stream: torch.Tensor, starts: np.ndarray, length: int) -> torch.Tensor:
    idx = torch.as_tensor(starts, device=stream.device)[:, None] + torch.arange(length, device=stream.device)
    return stream[idx]


def fixed_windows(tokens: np.ndarray, length: int) -> np.ndarray:
    """Non-overlapping windows of ``length`` tokens from the start (the tail that does not fit is dropped)."""
    n = (len(tokens) - length) // (length - 1) + 1 if len(tokens) >= length else 0
    return np.stack([tokens[i * (length - 1) : i * (length - 1) + length] for i in range(n)])


# ---- schedule ------------------------------------------------------------------------------------


def lr_at(step: int, planned_steps: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr``, then cosine down to ``lr * min_lr_ratio`` at ``planned_steps``."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    span = max(1, planned_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: DemoModel, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # norms, A_log, dt_bias
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=device.type == "cuda"
    )


# ---- losses and evaluation -----------------------------------------------------------------------


def losses(
    model: DemoModel, windows: torch.Tensor, gdn_core: GdnCore, dropout: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token and MTP (next-next-token) cross-entropy over windows [B, T+1]."""
    inputs = windows[:, :-1]
    out = train_forward(model.view(), model.variant, inputs, gdn_core=gdn_core, dropout=dropout)
    vocab = out.logits.shape[-1]
    main = F.cross_entropy(out.logits.reshape(-1, vocab).float(), windows[:, 1:].reshape(-1))
    assert out.mtp_logits is not None
    mtp = F.cross_entropy(out.mtp_logits.reshape(-1, vocab).float(), windows[:, 2:].reshape(-1))
    return main, mtp


@torch.no_grad()
def eval_window_losses(
    model: DemoModel, windows: torch.Tensor, gdn_core: GdnCore, batch: int, autocast: Any
) -> tuple[float, float]:
    """Token-weighted mean main and MTP loss over fixed windows [n, T+1]."""
    main_sum = mtp_sum = 0.0
    for i in range(0, windows.shape[0], batch):
        chunk = windows[i : i + batch]
        with autocast():
            main, mtp = losses(model, chunk, gdn_core)
        main_sum += main.item() * chunk.shape[0]
        mtp_sum += mtp.item() * chunk.shape[0]
    n = windows.shape[0]
    return main_sum / n, mtp_sum / n


@torch.no_grad()
def heldout_bits_per_byte(
    model: DemoModel,
    tokens: np.ndarray,
    docs: list[dict[str, Any]],
    endoftext: int,
    window: int,
    stride: int,
    batch: int,
    gdn_core: GdnCore,
    autocast: Any,
    device: torch.device,
) -> dict[str, float]:
    """Total NLL of every held-out file's tokens in bits over its UTF-8 bytes.

    Each file is scored on its own, preceded by ``<|endoftext|>`` (as in training), so every token of
    the file, the first included, gets a logprob; windows as ``ninfer score`` places them
    (`plan_windows`: each token scored once, with the most context a window gives it).
    """
    jobs: dict[int, list[tuple[np.ndarray, int]]] = {}  # window length -> (ids, first scored index)
    total_bytes = 0
    for doc in docs:
        ids = tokens[doc["start"] - 1 : doc["end"]]
        assert ids[0] == endoftext
        total_bytes += doc["bytes"]
        for w in plan_windows(len(ids), window, stride):
            jobs.setdefault(w.end - w.start, []).append((ids[w.start : w.end], w.first_new - w.start))
    nll = 0.0
    scored = 0
    for length, items in sorted(jobs.items()):
        for i in range(0, len(items), batch):
            group = items[i : i + batch]
            ids_t = torch.as_tensor(np.stack([g[0] for g in group]), device=device)
            with autocast():
                out = train_forward(model.view(), model.variant, ids_t, gdn_core=gdn_core, with_mtp=False)
            logprobs = torch.log_softmax(out.logits.float(), dim=-1)
            token_lp = logprobs[:, :-1].gather(-1, ids_t[:, 1:, None])[..., 0]  # lp of token j+1
            for row, (_, first) in enumerate(group):
                nll -= token_lp[row, first - 1 :].double().sum().item()
                scored += length - first
    return {
        "bits_per_byte": nll / LN2 / total_bytes,
        "nll_bits": nll / LN2,
        "bytes": total_bytes,
        "tokens_scored": scored,
        "window": window,
        "stride": stride,
    }


@torch.no_grad()
def mtp_accuracy(
    model: DemoModel, windows: torch.Tensor, gdn_core: GdnCore, batch: int, autocast: Any
) -> dict[str, float]:
    """Greedy accuracies on fixed held-out windows (teacher forcing).

    ``mtp_acc``: MTP argmax at slot i equals the true x_{i+2}. ``mtp_agree_main``: it equals the main
    model's own greedy token at position i+1, i.e. the acceptance rate a greedy 1-token MTP draft would
    get on this text. ``main_acc``: main argmax equals x_{i+1}.
    """
    counts = {"mtp_acc": 0, "mtp_agree_main": 0, "main_acc": 0}
    n_mtp = n_main = 0
    for i in range(0, windows.shape[0], batch):
        chunk = windows[i : i + batch]
        with autocast():
            out = train_forward(model.view(), model.variant, chunk[:, :-1], gdn_core=gdn_core)
        assert out.mtp_logits is not None
        main_pred = out.logits.argmax(-1)  # [b, T]: prediction of x_{i+1}
        mtp_pred = out.mtp_logits.argmax(-1)  # [b, T-1]: prediction of x_{i+2}
        counts["main_acc"] += int((main_pred == chunk[:, 1:]).sum())
        counts["mtp_acc"] += int((mtp_pred == chunk[:, 2:]).sum())
        counts["mtp_agree_main"] += int((mtp_pred == main_pred[:, 1:]).sum())
        n_main += main_pred.numel()
        n_mtp += mtp_pred.numel()
    return {
        "mtp_acc": counts["mtp_acc"] / n_mtp,
        "mtp_agree_main": counts["mtp_agree_main"] / n_mtp,
        "main_acc": counts["main_acc"] / n_main,
        "mtp_positions": n_mtp,
    }


# ---- training ------------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(cfg: TrainConfig, package: Package, log: Any = print) -> dict[str, Any]:
    """Run the whole recipe; returns the metrics (also written as metrics.json beside the checkpoint)."""
    t_start = time.perf_counter()
    if cfg.time_budget_s <= 0 and cfg.max_steps <= 0 and cfg.max_epochs <= 0:
        raise ValueError("need a time budget, max_steps or max_epochs")
    variant: Variant = package.variant
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    use_amp = cfg.amp and device.type == "cuda"

    def autocast() -> Any:
        if use_amp:
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    corpus = load_corpus(cfg.data_dir)
    check_corpus(corpus, package)
    eot = corpus.meta["endoftext_id"]
    train_stream = torch.as_tensor(corpus.train, device=device)
    val_windows = torch.as_tensor(fixed_windows(corpus.val, cfg.seq_len + 1), device=device)
    heldout_windows = torch.as_tensor(fixed_windows(corpus.heldout, cfg.seq_len + 1), device=device)
    sampler = EpochWindows(len(corpus.train), cfg.seq_len, cfg.seed)

    model = DemoModel.fresh(variant, cfg.seed).to(device)
    gdn_core, gdn_name = select_gdn_core(cfg.gdn_impl, device)  # type: ignore[arg-type]
    # evaluation runs many window lengths: a compiled core would recompile for each, so it runs eager
    eval_core = gdn_core if gdn_name in ("fla", "reference") else reference_gdn_core
    opt = make_optimizer(model, cfg, device)
    n_params = model.num_parameters()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    log(
        f"device {device} ({device_name}), torch {torch.__version__}, gdn core {gdn_name}, "
        f"amp {'bf16' if use_amp else 'off'}"
    )
    log(
        f"package {package.name}: {n_params:,} parameters; train {len(corpus.train):,} tokens, "
        f"val {len(corpus.val):,}, heldout {len(corpus.heldout):,}; batch {cfg.batch_size} x {cfg.seq_len}"
    )

    epoch_cap = (
        math.ceil(cfg.max_epochs * sampler.windows_per_epoch / cfg.batch_size) if cfg.max_epochs > 0 else 0
    )
    planned = cfg.max_steps if cfg.max_steps > 0 else 0
    if not planned and cfg.time_budget_s <= 0:
        planned = epoch_cap  # no clock to calibrate against: the epoch cap is the plan
    train_deadline = t_start + cfg.time_budget_s - cfg.eval_reserve_s if cfg.time_budget_s > 0 else math.inf
    val_every = max(1, planned // max(1, cfg.val_evals)) if planned else 0
    history: list[dict[str, float]] = []
    best: dict[str, Any] = {"val_loss": math.inf, "step": 0, "state": None}
    loss_acc = torch.zeros(2, device=device)
    acc_steps = 0
    step = 0
    t_first_step = t_calib = t_log = None
    last_log_step = 0
    t_train0 = time.perf_counter()
    val_seconds = 0.0

    def run_val(step: int) -> None:
        nonlocal val_seconds
        t0 = time.perf_counter()
        model.eval()
        vl, vm = eval_window_losses(model, val_windows, eval_core, cfg.eval_batch, autocast)
        model.train()
        dt = time.perf_counter() - t0
        val_seconds += dt
        history.append(
            {"step": step, "val_loss": vl, "val_mtp_loss": vm, "time_s": time.perf_counter() - t_start}
        )
        marker = ""
        if vl < best["val_loss"]:
            best.update(
                val_loss=vl, step=step, state={k: v.detach().clone() for k, v in model.state_dict().items()}
            )
            marker = " *"
        log(
            f"  val step {step}: loss {vl:.4f} ({vl / LN2:.3f} bits/token), mtp {vm:.4f}  [{dt:.1f}s]{marker}"
        )

    model.train()
    while True:
        step += 1
        lr = lr_at(step, planned or 10**9, cfg)  # before calibration: warmup, then the peak rate
        for group in opt.param_groups:
            group["lr"] = lr
        windows = gather_windows(train_stream, sampler.next_starts(cfg.batch_size), cfg.seq_len + 1)
        with autocast():
            main, mtp = losses(model, windows, gdn_core, dropout=cfg.dropout)
            loss = main + cfg.mtp_weight * mtp
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_acc += torch.stack((main.detach(), mtp.detach()))
        acc_steps += 1

        if step == 1:
            _sync(device)
            t_first_step = time.perf_counter()
            log(f"first step done at {t_first_step - t_start:.1f}s (kernel compilation included)")
        if step == 5:
            _sync(device)
            t_calib = time.perf_counter()
        if not planned and step == max(cfg.calibrate_steps, 6):
            _sync(device)
            step_s = (time.perf_counter() - t_calib) / (step - 5)
            remaining = train_deadline - time.perf_counter()
            # leave room for the val passes: one costs about as much as its windows' forward
            val_cost = step_s * val_windows.shape[0] / cfg.batch_size / 3 * cfg.val_evals
            planned = step + max(1, int((remaining - val_cost) * 0.97 / step_s))
            if epoch_cap:
                planned = min(planned, epoch_cap)
            val_every = max(1, planned // max(1, cfg.val_evals))
            log(f"calibrated: {step_s * 1000:.0f} ms/step -> planning {planned} steps")

        if step % cfg.log_every == 0 or step == planned:
            main_avg, mtp_avg = (loss_acc / acc_steps).tolist()
            now = time.perf_counter()
            tokens = (step - last_log_step) * cfg.batch_size * cfg.seq_len
            tok_s = tokens / (now - t_log) if t_log else float("nan")
            t_log, last_log_step = now, step
            log(
                f"step {step}/{planned or '?'} ep {sampler.epochs_done:.2f} lr {lr:.2e} loss {main_avg:.4f} "
                f"mtp {mtp_avg:.4f} gnorm {float(grad_norm):.2f} | {tok_s / 1e3:.0f}k tok/s | "
                f"{now - t_start:.0f}s"
            )
            loss_acc.zero_()
            acc_steps = 0
        if val_every and (step % val_every == 0 or step == planned):
            run_val(step)
        if (planned and step >= planned) or time.perf_counter() >= train_deadline:
            break

    _sync(device)
    t_train_end = time.perf_counter()
    if not history or history[-1]["step"] != step:
        run_val(step)
    final_val = history[-1]["val_loss"]
    if best["state"] is not None and best["step"] != step:
        model.load_state_dict(best["state"])
        log(f"restored the best val checkpoint (step {best['step']}, val {best['val_loss']:.4f})")

    model.eval()
    t_eval0 = time.perf_counter()
    docs = corpus.meta["splits"]["heldout"]["docs"]
    bpb_score = heldout_bits_per_byte(
        model,
        corpus.heldout,
        docs,
        eot,
        cfg.eval_window,
        cfg.eval_stride,
        cfg.eval_batch,
        eval_core,
        autocast,
        device,
    )
    bpb_train_len = heldout_bits_per_byte(
        model,
        corpus.heldout,
        docs,
        eot,
        cfg.seq_len,
        cfg.seq_len // 2,
        cfg.eval_batch,
        eval_core,
        autocast,
        device,
    )
    accuracy = mtp_accuracy(model, heldout_windows, eval_core, cfg.eval_batch, autocast)
    heldout_loss, heldout_mtp_loss = eval_window_losses(
        model, heldout_windows, eval_core, cfg.eval_batch, autocast
    )
    _sync(device)
    t_eval1 = time.perf_counter()
    log(
        f"heldout: {bpb_score['bits_per_byte']:.4f} bits/byte (window {cfg.eval_window}/{cfg.eval_stride}), "
        f"{bpb_train_len['bits_per_byte']:.4f} (window {cfg.seq_len}/{cfg.seq_len // 2}); "
        f"loss {heldout_loss:.4f}; MTP acc {accuracy['mtp_acc']:.4f}, MTP agrees with main "
        f"{accuracy['mtp_agree_main']:.4f}, main acc {accuracy['main_acc']:.4f}  [{t_eval1 - t_eval0:.1f}s]"
    )

    tokens_seen = step * cfg.batch_size * cfg.seq_len
    metrics: dict[str, Any] = {
        "package": package.name,
        "parameters": n_params,
        "config": dataclasses.asdict(cfg),
        "environment": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "gdn_core": gdn_name,
            "amp": "bf16" if use_amp else "fp32",
        },
        "corpus": {
            "python": corpus.meta["python"],
            **{
                s: {k: corpus.meta["splits"][s][k] for k in ("files", "bytes", "tokens", "sha256")}
                for s in ("train", "val", "heldout")
            },
        },
        "steps": step,
        "planned_steps": planned,
        "tokens_seen": tokens_seen,
        "epochs": sampler.epochs_done,
        "val_history": history,
        "final_val_loss": final_val,
        "best_val_loss": best["val_loss"],
        "best_step": best["step"],
        "heldout": {
            "score_windows": bpb_score,
            "train_length_windows": bpb_train_len,
            "loss": heldout_loss,
            "mtp_loss": heldout_mtp_loss,
            **accuracy,
        },
        "seconds": {
            "startup_to_first_step": (t_first_step or t_train0) - t_start,
            "training": t_train_end - t_train0,
            "val_passes": val_seconds,
            "final_eval": t_eval1 - t_eval0,
        },
    }
    if device.type == "cuda":
        metrics["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if cfg.export:
        t0 = time.perf_counter()
        data = Path(cfg.data_dir)
        written = export_checkpoint(
            cfg.out_dir,
            package,
            model.tensors(),
            data / "tokenizer.json",
            (data / "chat_template.jinja").read_text(encoding="utf-8"),
        )
        metrics["seconds"]["export"] = time.perf_counter() - t0
        metrics["seconds"]["total"] = time.perf_counter() - t_start
        (Path(cfg.out_dir) / "metrics.json").write_text(
            json.dumps(metrics, indent=2) + "\n", encoding="utf-8"
        )
        size_mb = sum(p.stat().st_size for p in written) / 1e6
        log(f"wrote {len(written)} files to {cfg.out_dir} ({size_mb:.1f} MB) + metrics.json")
    else:
        metrics["seconds"]["total"] = time.perf_counter() - t_start
    log(f"done in {metrics['seconds']['total']:.0f}s")
    return metrics


_ALIASES = {"data_dir": ["--data"], "out_dir": ["--out"]}


def _parser() -> argparse.ArgumentParser:
    """One flag per TrainConfig field (``--seq-len``, ``--amp/--no-amp``, ...), dataclass defaults."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(TrainConfig):
        flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, [])]
        default = f.default
        if isinstance(default, bool):
            p.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default)
        else:
            p.add_argument(*flags, dest=f.name, type=type(default), default=default)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    from ninfer.targets.qwen3_6_demo import PACKAGE

    def log(msg: str) -> None:
        print(msg, flush=True)

    train(cfg, PACKAGE, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
