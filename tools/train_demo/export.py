"""Write trained demo weights as a Hugging Face checkpoint folder that ``ninfer convert`` accepts.

The folder holds ``config.json`` (the package's ``hf_config()``), the weights under the checkpoint names
of ``Qwen3_5ForConditionalGeneration`` (``model.language_model.*``, ``mtp.*``; no ``lm_head.weight``
since the demo package ties it to the embedding) in safetensors shards with an index, ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template) and ``generation_config.json``.

Shards are capped (12 MiB by default) so that every file of the folder fits the device tool's 16 MiB
per-file limit on what a run can send back. Weights are stored in bf16 by default, which loses nothing
against the bf16 artifact: the GDN decay parameters (A_log, dt_bias) stay fp32, as the artifact keeps
them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.binder import hf_state_dict
from ninfer.targets.qwen3_6.view import ModelView
from ninfer.targets.qwen3_6.weights import weight_schema

from .tokenizer import load_tokenizer, tokenizer_config

DEFAULT_MAX_SHARD_BYTES = 12 * 1024 * 1024

__all__ = ["export_checkpoint", "generation_config", "load_checkpoint_tensors", "DEFAULT_MAX_SHARD_BYTES"]


def generation_config(package: Package) -> dict[str, Any]:
    """Sampling defaults (Qwen3's recommended 0.6 / 0.95 / 20) and the package's stop ids.

    A repetition penalty of 1.1 is the default too: an 11M-parameter model decoded greedily falls into
    loops within a few dozen tokens (measured: ``def fibonacci(n):`` degenerates into "aaaa..." at 1.0
    and stays Python at 1.1). Users override it per request, as every other default.
    """
    s = package.variant.special
    return {
        "bos_token_id": s.endoftext,
        "eos_token_id": list(s.eos),
        "pad_token_id": s.endoftext,
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "repetition_penalty": 1.1,
    }


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split in order into groups of at most ``max_bytes`` (a larger single tensor gets its own shard)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def export_checkpoint(
    out_dir: str | Path,
    package: Package,
    tensors: Mapping[str, torch.Tensor],
    tokenizer_json: str | Path,
    chat_template: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    extra_files: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write the checkpoint folder; ``tensors`` are schema-named (as `DemoModel.tensors()` gives them).

    ``dtype`` applies to every tensor except the fp32-pinned ones. ``extra_files`` maps file names to
    JSON-able objects written beside (e.g. the training metrics). Returns the paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    variant = package.variant
    tok = load_tokenizer(tokenizer_json)
    tok_vocab = tok.get_vocab_size(with_added_tokens=True)
    if tok_vocab != variant.vocab_size:
        raise ValueError(
            f"{tokenizer_json}: {tok_vocab} tokens, package {package.name!r} has {variant.vocab_size}"
        )

    placed = {}
    for spec in weight_schema(variant):
        t = tensors[spec.name].detach().to("cpu")
        placed[spec.name] = t.float() if spec.keep_fp32 else t.to(dtype)
    hf = {name: t.contiguous() for name, t in hf_state_dict(ModelView.from_tensors(variant, placed)).items()}

    written: list[Path] = []

    def write_json(name: str, obj: Any) -> None:
        path = out / name
        path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        written.append(path)

    shards = _shards(hf, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
        written.append(out / file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.numel() * t.element_size() for t in hf.values())
    write_json("model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json("config.json", package.hf_config())
    write_json("generation_config.json", generation_config(package))
    write_json("tokenizer_config.json", tokenizer_config(tok, chat_template))
    tok_path = out / "tokenizer.json"
    tok_path.write_bytes(Path(tokenizer_json).read_bytes())
    written.append(tok_path)
    for name, obj in (extra_files or {}).items():
        write_json(name, obj)
    return written


def load_checkpoint_tensors(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """The folder's weights back under schema names (``model.language_model.`` prefix removed)."""
    root = Path(ckpt_dir)
    index = json.loads((root / "model.safetensors.index.json").read_text(encoding="utf-8"))
    out: dict[str, torch.Tensor] = {}
    for file_name in sorted(set(index["weight_map"].values())):
        for key, t in load_file(str(root / file_name)).items():
            out[key.removeprefix("model.language_model.")] = t
    return out
