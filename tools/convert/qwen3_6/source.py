"""Reading a Hugging Face Qwen3.5/3.6 checkpoint folder: config, shard headers, frontend files.

Only headers are read here (safetensors ``safe_open`` maps the file; no tensor data is touched), so
every input problem is found before the converter writes a byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json", "chat_template.json")
# optional frontend files stored verbatim under their own names
OPTIONAL_JSON_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")


class ConvertError(ValueError):
    """A checkpoint the converter refuses; the message says which file and what is wrong, on one line."""


@dataclass(frozen=True)
class SourceTensor:
    """Where one checkpoint tensor lives (header facts only)."""

    key: str
    file: str  # shard file name, relative to the checkpoint folder
    dtype: str  # safetensors dtype string: "BF16", "F16", "F32", ...
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class HFCheckpoint:
    """A checkpoint folder after reading every header it holds."""

    root: Path
    config: dict[str, Any]
    tensors: dict[str, SourceTensor]  # checkpoint key -> location
    shard_files: list[str]
    # files read, name -> size in bytes (for provenance: names only, never absolute paths)
    files_read: dict[str, int] = field(default_factory=dict)

    def path(self, name: str) -> Path:
        return self.root / name


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: not a readable JSON file ({_one_line(e)})") from None


def read_checkpoint(hf_dir: str | Path) -> HFCheckpoint:
    """Read config.json and every shard header; refuse unreadable, truncated or inconsistent shards."""
    root = Path(hf_dir)
    if not root.is_dir():
        raise ConvertError(f"{root}: not a directory")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ConvertError(f"{root}: no config.json (not a Hugging Face checkpoint folder)")
    config = read_json(config_path)
    if not isinstance(config, dict):
        raise ConvertError(f"{config_path}: top level is not a JSON object")
    ckpt = HFCheckpoint(root=root, config=config, tensors={}, shard_files=[])
    ckpt.files_read["config.json"] = config_path.stat().st_size

    index_map: dict[str, str] | None = None
    if (root / INDEX_FILE).is_file():
        index = read_json(root / INDEX_FILE)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConvertError(f"{root / INDEX_FILE}: has no 'weight_map' object")
        index_map = {str(k): str(v) for k, v in weight_map.items()}
        ckpt.files_read[INDEX_FILE] = (root / INDEX_FILE).stat().st_size
        ckpt.shard_files = sorted(set(index_map.values()))
        absent = [f for f in ckpt.shard_files if not (root / f).is_file()]
        if absent:
            raise ConvertError(
                f"{root / INDEX_FILE} names shard file(s) that do not exist: {', '.join(absent)}"
            )
    elif (root / SINGLE_FILE).is_file():
        ckpt.shard_files = [SINGLE_FILE]
    else:
        raise ConvertError(f"{root}: no safetensors weights (looked for {INDEX_FILE} and {SINGLE_FILE})")

    problems: list[str] = []
    for shard in ckpt.shard_files:
        path = root / shard
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    sl = f.get_slice(key)
                    t = SourceTensor(key, shard, sl.get_dtype(), tuple(int(s) for s in sl.get_shape()))
                    if key in ckpt.tensors:
                        problems.append(f"{key} is in both {ckpt.tensors[key].file} and {shard}")
                    ckpt.tensors[key] = t
        except (SafetensorError, OSError) as e:
            problems.append(
                f"{shard}: not a readable safetensors file, truncated or corrupt ({_one_line(e)})"
            )
            continue
        ckpt.files_read[shard] = path.stat().st_size
    if index_map is not None:
        misplaced = [
            f"{k} (index says {v})"
            for k, v in sorted(index_map.items())
            if v in ckpt.files_read and (k not in ckpt.tensors or ckpt.tensors[k].file != v)
        ]
        if misplaced:
            problems.append(f"{INDEX_FILE} lists tensors its shards do not hold: {', '.join(misplaced)}")
    if problems:
        raise ConvertError(f"{root}: " + "; ".join(problems))
    return ckpt


def read_frontend(ckpt: HFCheckpoint) -> dict[str, bytes]:
    """The artifact's frontend resources: tokenizer.json, chat_template and generation/vision configs."""
    root = ckpt.root
    tokenizer_path = root / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise ConvertError(f"{root}: no tokenizer.json (the engine needs the Hugging Face tokenizers file)")
    tokenizer_bytes = tokenizer_path.read_bytes()
    ckpt.files_read["tokenizer.json"] = len(tokenizer_bytes)
    out: dict[str, bytes] = {
        "tokenizer.json": tokenizer_bytes,
        "chat_template": _read_chat_template(ckpt).encode("utf-8"),
    }
    gen_path = root / "generation_config.json"
    if gen_path.is_file():
        read_json(gen_path)  # refuse a corrupt file now rather than at load time
        out["generation_config.json"] = gen_path.read_bytes()
        ckpt.files_read[gen_path.name] = len(out["generation_config.json"])
    else:
        out["generation_config.json"] = b"{}"
    for name in OPTIONAL_JSON_FILES:
        path = root / name
        if path.is_file():
            read_json(path)
            out[name] = path.read_bytes()
            ckpt.files_read[name] = len(out[name])
    return out


def _read_chat_template(ckpt: HFCheckpoint) -> str:
    """chat_template.jinja, else tokenizer_config.json's "chat_template", else chat_template.json's."""
    root = ckpt.root
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        try:
            text = jinja.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConvertError(f"{jinja}: not UTF-8 text ({_one_line(e)})") from None
        ckpt.files_read[jinja.name] = jinja.stat().st_size
        return text
    for name in CHAT_TEMPLATE_FILES[1:]:
        path = root / name
        if not path.is_file():
            continue
        template = _template_from(read_json(path), path)
        if template is not None:
            ckpt.files_read[name] = path.stat().st_size
            return template
    looked = ", ".join(
        f"{n}" if n.endswith(".jinja") else f"{n} 'chat_template'" for n in CHAT_TEMPLATE_FILES
    )
    raise ConvertError(f"{root}: no chat template (looked for {looked})")


def _template_from(doc: Any, path: Path) -> str | None:
    if not isinstance(doc, dict) or "chat_template" not in doc:
        return None
    value = doc["chat_template"]
    if isinstance(value, str):
        return value
    # older tokenizer_config.json files hold a list of named templates; the engine uses "default"
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ConvertError(f"{path}: 'chat_template' is neither a string nor a list with a 'default' template")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
