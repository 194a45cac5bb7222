"""Tiny Hugging Face checkpoints of the test packages, and ways to damage or re-lay them out.

`save_tiny_checkpoint` saves a real transformers model (random weights, norms randomised too) with
``save_pretrained`` so names, shapes and sharding are what transformers writes, then adds the MTP
tensors transformers drops on save as an extra shard. `rewrite_checkpoint` makes a variant of a
checkpoint folder, loading and re-saving only the shards it edits (the 30 MB embedding shards are
linked, not copied).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ninfer.targets.qwen3_6.resources import RESOURCE_DIR
from ninfer.targets.qwen3_6.weights import weight_schema
from ninfer.targets.registry import PACKAGES

# tokenizer_config.json (with the chat template) stays a test fixture; tokenizer.json ships in the package
TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "fixtures"
INDEX = "model.safetensors.index.json"
MTP_SHARD = "model-mtp.safetensors"
_PER_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

Tensors = dict[str, torch.Tensor]


def _randomize_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Random values everywhere: a swapped or dropped tensor can never compare equal by accident."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name and p.dim() == 1:
                p.copy_(0.2 * noise)  # norm weights near their init, but never all equal
            else:
                p.copy_(0.05 * noise)


def mtp_tensors(package_name: str, gen: torch.Generator, dtype: torch.dtype) -> Tensors:
    """The MTP block as a real checkpoint stores it: per-expert MoE weights under ``mtp.``."""
    v = PACKAGES[package_name].variant
    out: Tensors = {}
    for spec in weight_schema(v):
        if spec.group != "mtp":
            continue
        t = (0.05 * torch.randn(spec.shape, generator=gen)).to(dtype)
        if spec.name.endswith("experts.gate_up_proj"):
            base = spec.name.removesuffix("gate_up_proj")
            inter = spec.shape[1] // 2
            for e in range(spec.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif spec.name.endswith("experts.down_proj"):
            base = spec.name.removesuffix("down_proj")
            for e in range(spec.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[spec.name] = t
    return out


def save_tiny_checkpoint(package_name: str, path: Path, *, seed: int = 0) -> Path:
    """A complete checkpoint folder of a tiny package (bf16), as a Hub download would look."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    package = PACKAGES[package_name]
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if package.variant.moe:
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**package.hf_config()))
    else:
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**package.hf_config()))
    _randomize_(model, gen)
    model = model.to(torch.bfloat16)
    # 20 MB shards: embed_tokens and lm_head alone, everything else in one ~1 MB shard
    model.save_pretrained(path, max_shard_size="20MB")
    save_file(
        mtp_tensors(package_name, gen, torch.bfloat16), str(path / MTP_SHARD), metadata={"format": "pt"}
    )
    _write_index(path)
    shutil.copyfile(RESOURCE_DIR / "tokenizer.json", path / "tokenizer.json")
    shutil.copyfile(TOKENIZER_DIR / "tokenizer_config.json", path / "tokenizer_config.json")
    assert (path / "generation_config.json").is_file()
    return path


def read_all(path: Path) -> Tensors:
    """Every tensor of a checkpoint folder, by checkpoint key."""
    out: Tensors = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                out[key] = f.get_tensor(key)
    return out


def rewrite_checkpoint(
    src: Path,
    dst: Path,
    edit: Callable[[Tensors], Tensors] | None = None,
    *,
    touches: Callable[[str], bool] = lambda key: True,
) -> Path:
    """Copy a checkpoint folder into ``dst`` applying ``edit`` to the tensors of each shard.

    Only shards holding a key for which ``touches`` is true are loaded, edited and re-saved (same
    name); the others are symlinked. The index is rebuilt from what the shards then hold.
    """
    dst.mkdir(parents=True)
    for item in sorted(src.iterdir()):
        if item.suffix != ".safetensors":
            if item.name != INDEX:
                shutil.copyfile(item, dst / item.name)
            continue
        with safe_open(str(item), framework="pt") as f:
            keys = list(f.keys())
        if edit is None or not any(touches(k) for k in keys):
            os.symlink(item.resolve(), dst / item.name)
            continue
        with safe_open(str(item), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in keys}
        tensors = edit(tensors)
        if tensors:
            save_file(
                {k: t.contiguous() for k, t in tensors.items()},
                str(dst / item.name),
                metadata={"format": "pt"},
            )
    _write_index(dst)
    return dst


def fuse_experts(tensors: Tensors) -> Tensors:
    """Per-expert MoE keys -> the fused ``experts.gate_up_proj`` / ``experts.down_proj`` layout."""
    out: Tensors = {}
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _PER_EXPERT.match(key)
        if m:
            groups.setdefault(m[1], {})[(int(m[2]), m[3])] = t
        else:
            out[key] = t
    for base, g in groups.items():
        n = 1 + max(e for e, _ in g)
        out[base + "gate_up_proj"] = torch.stack(
            [torch.cat([g[(e, "gate_proj")], g[(e, "up_proj")]], dim=0) for e in range(n)]
        )
        out[base + "down_proj"] = torch.stack([g[(e, "down_proj")] for e in range(n)])
    return out


def is_expert_key(key: str) -> bool:
    return ".experts." in key


def schema_view(tensors: Tensors) -> Tensors:
    """Checkpoint tensors under schema names, experts fused (an independent reading of the mapping)."""
    named: Tensors = {}
    for key, t in tensors.items():
        for prefix, repl in (("model.language_model.", ""), ("model.visual.", "visual."), ("model.", "")):
            if key.startswith(prefix):
                key = repl + key[len(prefix) :]
                break
        named[key] = t
    return fuse_experts(named)


def edit_config(path: Path, fn: Callable[[dict], None]) -> None:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def _write_index(path: Path) -> None:
    weight_map: dict[str, str] = {}
    total = 0
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                weight_map[key] = shard.name
                sl = f.get_slice(key)
                n = 1
                for s in sl.get_shape():
                    n *= s
                total += n * {"BF16": 2, "F16": 2, "F32": 4}[sl.get_dtype()]
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX).write_text(json.dumps(index, indent=2))


def save_text_only_checkpoint(
    package_name: str, path: Path, *, source: Path | None = None, seed: int = 0
) -> Path:
    """A text-only checkpoint as transformers' ``Qwen3_5(Moe)ForCausalLM`` saves it: config.json is the
    text config itself (no ``text_config`` nesting, no ``vision_config``), names are ``model.*`` and
    ``lm_head.weight``, and there are no vision or MTP tensors. ``source``: a checkpoint folder whose
    text weights it takes (so both convert to the same text model); else random weights."""
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    package = PACKAGES[package_name]
    text_config = package.hf_config()["text_config"]
    if package.variant.moe:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text_config))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_config))
    if source is None:
        torch.manual_seed(seed)
        _randomize_(model, torch.Generator().manual_seed(seed))
    else:
        text = {
            key.replace("model.language_model.", "model.", 1): t
            for key, t in read_all(source).items()
            if key.startswith(("model.language_model.", "lm_head."))
        }
        model.load_state_dict(text, strict=True)
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="20MB")
    shutil.copyfile(RESOURCE_DIR / "tokenizer.json", path / "tokenizer.json")
    shutil.copyfile(TOKENIZER_DIR / "tokenizer_config.json", path / "tokenizer_config.json")
    return path
