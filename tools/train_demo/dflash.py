"""Train a DFlash block drafter for the bundled demo model and write an artifact that holds it.

The recipe is DFlash's (shared/reference/speculative-decoding.md section 1), at toy scale: the target is
frozen; the data are windows of the running interpreter's standard-library source (the demo's own
training text); each example is a random anchor in such a window, the context its tap-layer states
before the anchor, the block [anchor, mask x (T - 1)] and the labels the T - 1
tokens after the anchor, with the cross-entropy of later positions weighted down (exp(-(k - 1) / gamma)).

The forward is the inference math itself (`ninfer.targets.qwen3_6.dflash` over a scratch paged store,
differentiable): what is trained is exactly what the engine runs.

    python -m ninfer_tools.train_demo.dflash OUT.ninfer [--steps N] [--seconds S]
"""

from __future__ import annotations

import argparse
import math
import random
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

from ninfer.artifact import Artifact, ArtifactWriter, TensorSpec
from ninfer.cli.common import bundled_artifact
from ninfer.targets.qwen3_6 import dflash
from ninfer.targets.qwen3_6.binder import load_model_view, random_weight
from ninfer.targets.qwen3_6.model import StateStore, StepBatch, forward
from ninfer.targets.qwen3_6.view import ModelView
from ninfer.targets.qwen3_6.weights import weight_schema
from ninfer.targets.registry import get_package

SEED = 20261207
PAGE = 16


def snippets(count: int, chars: int, seed: int) -> list[str]:
    """``count`` snippets of ``chars`` characters from the running interpreter's stdlib sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 4 * chars)
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text = rng.choice(files).read_text(encoding="utf-8", errors="replace")
        start = rng.randrange(0, len(text) - chars)
        out.append(text[start : start + chars])
    return out


def text_sequences(count: int, tokens: int, seed: int) -> list[list[int]]:
    """``count`` windows of ``tokens`` token ids of stdlib source, in the demo tokenizer's ids."""
    from tokenizers import Tokenizer

    with Artifact.open(bundled_artifact()) as bundled:
        resource = bundled.frontend_resource("tokenizer.json")
    assert resource is not None
    tokenizer = Tokenizer.from_str(resource.decode("utf-8"))
    out = []
    for text in snippets(count, 8 * tokens, seed):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) >= tokens:
            out.append(ids[:tokens])
    return out


def full_view(trained: dict[str, torch.Tensor] | None = None, seed: int = SEED) -> ModelView:
    """The demo package's view with a drafter: the bundled text model, the drafter ``trained`` (or newly
    initialised) in fp32."""
    package = get_package("qwen3_6_demo").with_drafter()
    _, bundled = load_model_view(bundled_artifact(), "cpu", torch.float32)
    tensors = dict(bundled.tensors)
    generator = torch.Generator()
    for spec in weight_schema(package.variant):
        if spec.group == "dflash":
            tensors[spec.name] = (
                trained[spec.name]
                if trained is not None
                else random_weight(spec, package.variant, seed, generator)
            )
    return ModelView.from_tensors(package.variant, tensors)


def taps_of(view: ModelView, ids: list[int]) -> torch.Tensor:
    """The target's tap-layer states [N, n_taps * H] over a whole sequence (one fresh forward)."""
    variant = view.variant
    assert variant.dflash is not None
    n = len(ids)
    pages = -(-n // PAGE)
    store = StateStore.allocate(variant, 1, pages, PAGE, torch.float32, "cpu")
    batch = StepBatch(
        token_ids=torch.tensor(ids),
        positions=torch.arange(n).expand(3, -1),
        query_start=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.arange(pages, dtype=torch.int32)[None],
        slot_mapping=torch.arange(n),
        state_in=torch.zeros(1, dtype=torch.long),
        state_out=torch.zeros(1, dtype=torch.long),
        fresh=torch.ones(1, dtype=torch.bool),
        taps=variant.dflash.target_layer_ids,
    )
    out = forward(view, variant, batch, store, logits="none")
    return torch.cat([out.taps[i] for i in variant.dflash.target_layer_ids], dim=-1)


def block_loss(
    view: ModelView, examples: list[tuple[list[int], torch.Tensor, int]], block: int, gamma: float
) -> torch.Tensor:
    """The weighted cross-entropy of B examples (sequence, its taps, anchor), one block each."""
    dims = view.variant.dflash
    assert dims is not None
    rows = len(examples)
    longest = max(a for _, _, a in examples) + block
    per_row = -(-longest // PAGE)
    store = StateStore.allocate_kv(
        view.variant,
        dims.num_layers,
        rows * per_row,
        PAGE,
        torch.float32,
        "cpu",
        (dims.num_kv_heads, dims.head_dim),
    )
    table = torch.arange(rows * per_row, dtype=torch.int32).view(rows, per_row)

    def slots(row: int, positions: torch.Tensor) -> torch.Tensor:
        return table[row, positions // PAGE].long() * PAGE + positions % PAGE

    tokens, positions, block_slots, labels = [], [], [], []
    for row, (ids, taps, a) in enumerate(examples):
        ctx = torch.arange(a)
        dflash.write_context(view, dflash.context_vectors(view, taps[:a]), ctx, slots(row, ctx), store)
        pos = torch.arange(a, a + block)
        tokens.append(torch.tensor([ids[a]] + [dims.mask_token_id] * (block - 1)))
        positions.append(pos)
        block_slots.append(slots(row, pos))
        labels.append(torch.tensor(ids[a + 1 : a + block]))
    context_lens = torch.tensor([a + block for _, _, a in examples], dtype=torch.int32)
    out = dflash.block(
        view, torch.cat(tokens), torch.cat(positions), torch.cat(block_slots), table, context_lens, store
    )
    hidden = out.view(rows, block, -1)[:, 1:]
    logits = hidden @ view.text.lm_head.T
    weights = torch.tensor([math.exp(-k / gamma) for k in range(block - 1)])
    ce = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), torch.stack(labels).flatten(), reduction="none"
    )
    return (ce.view(rows, block - 1) * weights).sum() / (weights.sum() * rows)


def train(
    *, steps: int, seconds: float | None = None, sequences: int = 256, tokens: int = 192, batch: int = 8,
    block: int = 16, gamma: float = 7.0, lr: float = 2e-3, seed: int = SEED, log: Any = print,
) -> ModelView:  # fmt: skip
    """A trained drafter in the demo package's view (fp32), after ``steps`` updates or ``seconds``."""
    torch.manual_seed(seed)
    started = time.perf_counter()
    data_ids = text_sequences(sequences, tokens, seed)
    init = full_view(seed=seed)
    with torch.no_grad():
        data = [(ids, taps_of(init, ids)) for ids in data_ids]
    params = {
        name: t.clone().requires_grad_(True) for name, t in init.tensors.items() if name.startswith("dflash.")
    }
    optimizer = torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    log(f"data: {len(data)} sequences in {time.perf_counter() - started:.1f} s")
    for step in range(steps):
        if seconds is not None and time.perf_counter() - started > seconds:
            break
        view = ModelView.from_tensors(init.variant, {**init.tensors, **params})
        examples = []
        for _ in range(batch):
            ids, taps = rng.choice(data)
            examples.append((ids, taps, rng.randrange(8, len(ids) - block)))
        for group in optimizer.param_groups:  # cosine decay
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = block_loss(view, examples, block, gamma)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0:
            log(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)")
    return full_view({name: p.detach() for name, p in params.items()})


def write_artifact(view: ModelView, out: Path, storage: str = "bf16") -> Path:
    """The bundled demo artifact's tensors and resources with the drafter ``view`` holds."""
    package = get_package("qwen3_6_demo").with_drafter()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[storage]
    with Artifact.open(bundled_artifact()) as bundled:
        frontend = {name: bundled.frontend_resource(name) for name in bundled.frontend_names()}
        stored = {name: bundled.tensor(name) for name in bundled.tensor_names()}
    tensors = {}
    for spec in weight_schema(package.variant):
        t = stored.get(spec.name)
        tensors[spec.name] = (
            t
            if t is not None and storage == "bf16"
            else view.tensors[spec.name].to(torch.float32 if spec.keep_fp32 else dtype)
        )
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with ArtifactWriter(
        out, identity=package.identity(storage), dims=package.variant.dims(), tensors=specs,
        frontend=frontend, provenance={"source": "tools/train_demo/dflash.py", "seed": SEED},
    ) as writer:  # fmt: skip
        for name, t in tensors.items():
            writer.write_tensor(name, t.contiguous())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--storage", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args(argv)
    write_artifact(train(steps=args.steps, seconds=args.seconds), args.out, args.storage)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
