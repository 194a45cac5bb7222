"""`ninfer convert`: real transformers checkpoints of the tiny packages -> `.ninfer`, checked bit for bit.

The checkpoints come from transformers' own ``save_pretrained`` (bf16, ~64 MB each because of the real
248,320-token vocabulary), plus the MTP shard transformers drops. Variants (fused experts, text-only
names, damaged inputs) are derived by re-saving only the small shards.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from convert_ckpt_helpers import (
    INDEX,
    MTP_SHARD,
    TOKENIZER_DIR,
    Tensors,
    edit_config,
    fuse_experts,
    is_expert_key,
    read_all,
    rewrite_checkpoint,
    save_tiny_checkpoint,
    schema_view,
)
from ninfer_tools.convert.qwen3_6 import ConvertError, convert
from ninfer_tools.convert.qwen3_6.plan import build_plan
from ninfer_tools.convert.qwen3_6.source import HFCheckpoint, SourceTensor

from ninfer.artifact import Artifact
from ninfer.cli.main import main as cli_main
from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.resources import RESOURCE_DIR
from ninfer.targets.qwen3_6.weights import weight_schema
from ninfer.targets.registry import PACKAGES

torch.set_num_threads(1)

DENSE, MOE = "qwen3_6_tiny", "qwen3_6_tiny_moe"
SMALL_SHARD = "model-00003-of-00003.safetensors"  # everything but embed_tokens and lm_head


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(DENSE, tmp_path_factory.mktemp("hf") / DENSE, seed=1)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(MOE, tmp_path_factory.mktemp("hf") / MOE, seed=2)


@pytest.fixture(scope="module")
def dense_artifact(dense_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(dense_ckpt, tmp_path_factory.mktemp("out") / "dense.ninfer", progress=False)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_tensors_equal(artifact: Artifact, expected: Tensors) -> None:
    """Every stored tensor equals ``expected`` (already in the stored dtype) byte for byte."""
    assert artifact.tensor_names() == list(expected)
    for name, want in expected.items():
        got = artifact.tensor(name)
        assert got.dtype == want.dtype, name
        assert tuple(got.shape) == tuple(want.shape), name
        assert torch.equal(bits(got), bits(want)), f"{name} differs from the source"


def expected_stored(package: str, source: Tensors, dtype: torch.dtype) -> Tensors:
    """Source tensors in schema order, cast like the artifact stores them (A_log/dt_bias stay fp32)."""
    out: Tensors = {}
    for spec in weight_schema(PACKAGES[package].variant):
        out[spec.name] = source[spec.name].to(torch.float32 if spec.keep_fp32 else dtype)
    return out


def assert_same_payload(a: Path, b: Path) -> None:
    """Two artifacts hold the same identity, dims, tensors and frontend resources (provenance may differ)."""
    x, y = Artifact.open(a, verify=True), Artifact.open(b, verify=True)
    assert (x.identity, x.dims, x.frontend_names()) == (y.identity, y.dims, y.frontend_names())
    for name in x.frontend_names():
        assert x.frontend_resource(name) == y.frontend_resource(name), name
    assert_tensors_equal(y, {n: x.tensor(n) for n in x.tensor_names()})


def link_copy(src: Path, dst: Path) -> Path:
    """The same checkpoint under another folder: every file symlinked."""
    dst.mkdir()
    for item in src.iterdir():
        os.symlink(item, dst / item.name)
    return dst


def refused(hf_dir: Path, tmp_path: Path, **kw: object) -> str:
    out = tmp_path / "refused.ninfer"
    with pytest.raises(ConvertError) as info:
        convert(hf_dir, out, progress=False, **kw)  # type: ignore[arg-type]
    assert not out.exists() and not Path(f"{out}.partial").exists(), "a refused input left a file behind"
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# ---- conversion is exact ---------------------------------------------------------------------------


def test_dense_checkpoint_converts_bit_exact(dense_ckpt: Path, dense_artifact: Path) -> None:
    art = Artifact.open(dense_artifact, verify=True)
    package = PACKAGES[DENSE]
    assert art.identity == package.identity("bf16")
    assert art.dims == package.variant.dims()
    assert_tensors_equal(art, expected_stored(DENSE, schema_view(read_all(dense_ckpt)), torch.bfloat16))
    assert art.tensor("layers.0.linear_attn.A_log").dtype == torch.float32  # keep_fp32 in every profile

    assert art.frontend_resource("tokenizer.json") == (RESOURCE_DIR / "tokenizer.json").read_bytes()
    template = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())["chat_template"]
    assert art.frontend_resource("chat_template") == template.encode("utf-8")
    assert (
        art.frontend_resource("generation_config.json")
        == (dense_ckpt / "generation_config.json").read_bytes()
    )

    prov = art.provenance
    assert prov["converter"] == "ninfer_tools.convert.qwen3_6"
    assert prov["source"]["dtype"] == "bf16" and prov["source"]["expert_layout"] == "none"
    files = {f["name"]: f["bytes"] for f in prov["source"]["files"]}
    assert files[SMALL_SHARD] == (dense_ckpt / SMALL_SHARD).stat().st_size
    assert {INDEX, MTP_SHARD, "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert str(dense_ckpt.parent) not in json.dumps(prov), "provenance must not hold absolute paths"


def test_moe_per_expert_and_fused_layouts_convert_alike(moe_ckpt: Path, tmp_path: Path) -> None:
    source = read_all(moe_ckpt)
    assert "model.language_model.layers.0.mlp.experts.7.up_proj.weight" in source  # transformers' layout
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in source
    per_expert = convert(moe_ckpt, tmp_path / "per_expert.ninfer", progress=False)
    art = Artifact.open(per_expert, verify=True)
    assert art.identity == PACKAGES[MOE].identity("bf16")
    assert art.provenance["source"]["expert_layout"] == "per_expert"
    assert_tensors_equal(art, expected_stored(MOE, schema_view(source), torch.bfloat16))
    # the fused layout spelled out once: rows [0:I] gate, [I:2I] up of each expert
    inter = PACKAGES[MOE].variant.moe_intermediate_size
    gate_up = art.tensor("layers.2.mlp.experts.gate_up_proj")
    lm = "model.language_model.layers.2.mlp.experts.5."
    assert torch.equal(gate_up[5, :inter], source[lm + "gate_proj.weight"])
    assert torch.equal(gate_up[5, inter:], source[lm + "up_proj.weight"])
    assert torch.equal(
        art.tensor("mtp.layers.0.mlp.experts.down_proj")[3],
        source["mtp.layers.0.mlp.experts.3.down_proj.weight"],
    )

    fused_dir = rewrite_checkpoint(moe_ckpt, tmp_path / "fused", fuse_experts, touches=is_expert_key)
    assert "model.language_model.layers.2.mlp.experts.gate_up_proj" in read_all(fused_dir)
    fused = convert(fused_dir, tmp_path / "fused.ninfer", progress=False)
    assert Artifact.open(fused).provenance["source"]["expert_layout"] == "fused"
    assert_same_payload(per_expert, fused)


def test_text_only_names_convert_alike(dense_ckpt: Path, dense_artifact: Path, tmp_path: Path) -> None:
    def text_only(t: Tensors) -> Tensors:
        return {k.replace("model.language_model.", "model.", 1): v for k, v in t.items()}

    hf = rewrite_checkpoint(dense_ckpt, tmp_path / "text_only", text_only)
    assert "model.layers.0.input_layernorm.weight" in read_all(hf)
    assert_same_payload(dense_artifact, convert(hf, tmp_path / "a.ninfer", progress=False))


@pytest.mark.parametrize(("profile", "dtype"), [("fp32", torch.float32), ("fp16", torch.float16)])
def test_dtype_option_sets_storage_profile(
    dense_ckpt: Path, tmp_path: Path, profile: str, dtype: torch.dtype
) -> None:
    art = Artifact.open(
        convert(dense_ckpt, tmp_path / "a.ninfer", dtype=profile, progress=False), verify=True
    )
    assert art.identity["storage_profile"] == profile
    assert art.provenance["options"]["dtype"] == profile
    assert_tensors_equal(art, expected_stored(DENSE, schema_view(read_all(dense_ckpt)), dtype))


def test_mixed_precision_source_keeps_majority_dtype(dense_ckpt: Path, tmp_path: Path) -> None:
    """fp32 layer 0 + bf16 rest (most elements): bf16 profile; fp32 values round, A_log stays exact."""

    def to_fp32(t: Tensors) -> Tensors:  # values off the bf16 grid, so rounding is visible
        return {k: v.float() * (1 + 2**-12) for k, v in t.items()}

    hf = rewrite_checkpoint(dense_ckpt, tmp_path / "mixed", to_fp32, touches=lambda k: "layers.0." in k)
    source = schema_view(read_all(hf))
    assert source["layers.0.linear_attn.A_log"].dtype == torch.float32
    assert source["embed_tokens.weight"].dtype == torch.bfloat16
    art = Artifact.open(convert(hf, tmp_path / "a.ninfer", progress=False), verify=True)
    assert art.identity["storage_profile"] == "bf16"
    assert_tensors_equal(art, expected_stored(DENSE, source, torch.bfloat16))
    a_log = art.tensor("layers.0.linear_attn.A_log")
    assert not torch.equal(a_log, a_log.to(torch.bfloat16).float()), "fp32 A_log must not pass through bf16"


def test_fp16_overflow_is_refused(dense_ckpt: Path, tmp_path: Path) -> None:
    name = "model.language_model.layers.1.mlp.down_proj.weight"

    def overflow(t: Tensors) -> Tensors:
        t[name] = t[name].clone()
        t[name][0, 0] = 1e6  # fine in bf16, inf in fp16
        return t

    hf = rewrite_checkpoint(dense_ckpt, tmp_path / "big", overflow, touches=lambda k: k == name)
    msg = refused(hf, tmp_path, dtype="fp16")
    assert "layers.1.mlp.down_proj.weight" in msg and "overflow" in msg


def test_output_is_deterministic(dense_ckpt: Path, dense_artifact: Path, tmp_path: Path) -> None:
    again = convert(link_copy(dense_ckpt, tmp_path / "elsewhere"), tmp_path / "again.ninfer", progress=False)
    assert again.read_bytes() == dense_artifact.read_bytes()


# ---- refused inputs ----------------------------------------------------------------------------------


def test_tensor_mismatches_are_listed_in_one_error(dense_ckpt: Path, tmp_path: Path) -> None:
    drop = {
        "model.language_model.layers.3.self_attn.k_norm.weight",
        "model.visual.blocks.1.attn.qkv.bias",
        "mtp.fc.weight",
    }
    extra = {"model.language_model.layers.0.mlp.extra_proj.weight", "something.else"}
    hidden = PACKAGES[DENSE].variant.hidden_size

    def damage(t: Tensors) -> Tensors:
        out = {k: v for k, v in t.items() if k not in drop}
        if "mtp.norm.weight" in out:
            out["mtp.norm.weight"] = torch.zeros(hidden + 1, dtype=torch.bfloat16)
        else:
            out.update({k: torch.zeros(4, dtype=torch.bfloat16) for k in extra})
        return out

    hf = rewrite_checkpoint(
        dense_ckpt, tmp_path / "bad", damage, touches=lambda k: "mtp." in k or "visual." in k
    )
    msg = refused(hf, tmp_path)
    assert "3 missing" in msg and "2 unexpected" in msg and "1 wrong shape" in msg
    for name in (
        "layers.3.self_attn.k_norm.weight",
        "visual.blocks.1.attn.qkv.bias",
        "mtp.fc.weight",
        *extra,
    ):
        assert name in msg
    assert f"mtp.norm.weight [{hidden + 1}] (expected [{hidden}])" in msg


def test_moe_expert_mismatches_are_listed(moe_ckpt: Path, tmp_path: Path) -> None:
    lm = "model.language_model.layers.2.mlp.experts."

    def damage(t: Tensors) -> Tensors:
        t = {k: v for k, v in t.items() if k != lm + "5.up_proj.weight"}
        t[lm + "8.down_proj.weight"] = t[lm + "0.down_proj.weight"].clone()  # a 9th expert of 8
        return t

    hf = rewrite_checkpoint(moe_ckpt, tmp_path / "bad", damage, touches=lambda k: k.startswith(lm))
    msg = refused(hf, tmp_path)
    assert "1 missing" in msg and "layers.2.mlp.experts.5.up_proj.weight" in msg
    assert "1 unexpected" in msg and lm + "8.down_proj.weight" in msg


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda c: c["text_config"].update(hidden_size=96), "hidden_size: 64 != 96"),
        (lambda c: c["text_config"].update(num_hidden_layers=12, layer_types=None), "num_layers: 8 != 12"),
        (lambda c: c["vision_config"].update(depth=3), "vision"),
        (lambda c: c["text_config"].pop("head_dim"), "'head_dim'"),
        (
            lambda c: c.update(model_type="llama", text_config={**c["text_config"], "model_type": "llama"}),
            "llama",
        ),
    ],
    ids=["hidden_size", "num_layers", "vision_depth", "missing_field", "unknown_model_type"],
)
def test_config_mismatch_is_refused(dense_ckpt: Path, tmp_path: Path, edit: object, needle: str) -> None:
    hf = rewrite_checkpoint(dense_ckpt, tmp_path / "cfg")
    edit_config(hf, edit)  # type: ignore[arg-type]
    msg = refused(hf, tmp_path)
    assert "config.json" in msg and needle in msg


def test_forced_package(dense_ckpt: Path, dense_artifact: Path, tmp_path: Path) -> None:
    forced = convert(dense_ckpt, tmp_path / "forced.ninfer", package=DENSE, progress=False)
    assert_same_payload(dense_artifact, forced)
    msg = refused(dense_ckpt, tmp_path, package=MOE)
    assert f"do not match package {MOE!r}" in msg and "moe: True != False" in msg
    assert "registered packages" in refused(dense_ckpt, tmp_path, package="qwen9_huge")


def test_frontend_files(dense_ckpt: Path, tmp_path: Path) -> None:
    no_tok = rewrite_checkpoint(dense_ckpt, tmp_path / "no_tok")
    (no_tok / "tokenizer.json").unlink()
    assert "tokenizer.json" in refused(no_tok, tmp_path)

    no_template = rewrite_checkpoint(dense_ckpt, tmp_path / "no_template")
    (no_template / "tokenizer_config.json").unlink()
    msg = refused(no_template, tmp_path)
    assert "no chat template" in msg and "chat_template.jinja" in msg and "tokenizer_config.json" in msg

    # chat_template.jinja wins over tokenizer_config.json; optional files travel; no generation config -> {}
    hf = rewrite_checkpoint(dense_ckpt, tmp_path / "files")
    (hf / "chat_template.jinja").write_text("{{ messages }}\n")
    (hf / "preprocessor_config.json").write_text('{"patch_size": 16}')
    (hf / "generation_config.json").unlink()
    art = Artifact.open(convert(hf, tmp_path / "a.ninfer", progress=False), verify=True)
    assert art.frontend_resource("chat_template") == b"{{ messages }}\n"
    assert art.frontend_resource("preprocessor_config.json") == b'{"patch_size": 16}'
    assert art.frontend_resource("generation_config.json") == b"{}"


def test_foreign_tokenizer_is_refused(dense_ckpt: Path, tmp_path: Path) -> None:
    hf = rewrite_checkpoint(dense_ckpt, tmp_path / "tok")
    text = (hf / "tokenizer.json").read_bytes()
    (hf / "tokenizer.json").write_bytes(text.replace(b'"<|im_end|>"', b'"<|im_stop|>"'))
    msg = refused(hf, tmp_path)
    assert "<|im_end|> is None (expected 248046)" in msg


def test_damaged_shards_are_refused(dense_ckpt: Path, tmp_path: Path) -> None:
    truncated = rewrite_checkpoint(dense_ckpt, tmp_path / "truncated")
    data = (dense_ckpt / SMALL_SHARD).read_bytes()
    (truncated / SMALL_SHARD).unlink()
    (truncated / SMALL_SHARD).write_bytes(data[: len(data) - 1000])
    msg = refused(truncated, tmp_path)
    assert SMALL_SHARD in msg and "truncated or corrupt" in msg

    corrupt = rewrite_checkpoint(dense_ckpt, tmp_path / "corrupt")
    (corrupt / SMALL_SHARD).unlink()
    (corrupt / SMALL_SHARD).write_bytes(data[:8] + b"#" * 64 + data[72:])  # garbage JSON header
    assert SMALL_SHARD in refused(corrupt, tmp_path)

    no_shard = rewrite_checkpoint(dense_ckpt, tmp_path / "no_shard")
    (no_shard / MTP_SHARD).unlink()
    msg = refused(no_shard, tmp_path)
    assert INDEX in msg and MTP_SHARD in msg and "do not exist" in msg


def test_tied_package_refuses_checkpoint_with_lm_head(
    dense_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tied = Package(
        name="qwen3_6_tiny_tied",
        variant=dataclasses.replace(PACKAGES[DENSE].variant, tie_word_embeddings=True),
        description="tied test package",
        test_only=True,
    )
    monkeypatch.setitem(PACKAGES, tied.name, tied)
    hf = rewrite_checkpoint(dense_ckpt, tmp_path / "tied")
    edit_config(hf, lambda c: c.update(tie_word_embeddings=True))
    msg = refused(hf, tmp_path)
    assert "lm_head.weight" in msg and "tie_word_embeddings" in msg and tied.name in msg


# ---- command line ------------------------------------------------------------------------------------


def test_cli_convert(dense_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.ninfer"
    assert cli_main(["convert", str(dense_ckpt), "-o", str(out), "--dtype", "bf16"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    assert "convert qwen3_6_tiny" in captured.err and "100%" in captured.err  # tqdm bar, in bytes
    assert Artifact.open(out, verify=True).identity["storage_profile"] == "bf16"

    assert cli_main(["convert", str(tmp_path / "missing"), "-o", str(tmp_path / "x.ninfer")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ninfer convert: error: ") and err.count("\n") == 1 and "not a directory" in err


def test_cli_help_and_tools_import() -> None:
    import ninfer_tools.convert.qwen3_6 as mod

    assert callable(mod.convert)
    proc = subprocess.run(
        [sys.executable, "-m", "ninfer", "convert", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "HF_DIR" in proc.stdout and "--dtype" in proc.stdout and "--package" in proc.stdout


# ---- real package dims (headers only) -------------------------------------------------------------


def hf_headers(package: str) -> dict[str, SourceTensor]:
    """The tensor headers a real Hub checkpoint of ``package`` carries (per-expert MoE, bf16)."""
    v = PACKAGES[package].variant
    out: dict[str, SourceTensor] = {}

    def add(key: str, shape: tuple[int, ...]) -> None:
        out[key] = SourceTensor(key, "model-00001-of-00001.safetensors", "BF16", shape)

    for spec in weight_schema(v):
        if spec.name.startswith("visual."):
            key = "model." + spec.name
        elif spec.name.startswith(("mtp.", "lm_head.")):
            key = spec.name
        else:
            key = "model.language_model." + spec.name
        if key.endswith("experts.gate_up_proj"):
            for e in range(v.num_experts):
                for proj in ("gate_proj", "up_proj"):
                    add(
                        key.replace("gate_up_proj", f"{e}.{proj}.weight"), (spec.shape[1] // 2, spec.shape[2])
                    )
        elif key.endswith("experts.down_proj"):
            for e in range(v.num_experts):
                add(key.replace("down_proj", f"{e}.down_proj.weight"), spec.shape[1:])
        else:
            add(key, spec.shape)
    return out


@pytest.mark.parametrize("package", ["qwen3_6_27b", "qwen3_6_35b_a3b", "qwen3_8_27b"])
def test_plan_for_real_package_dims(package: str, tmp_path: Path) -> None:
    """The mapping covers the full-size packages exactly (no weights needed: the plan reads headers)."""
    pkg = PACKAGES[package]
    ckpt = HFCheckpoint(root=tmp_path, config=pkg.hf_config(), tensors=hf_headers(package), shard_files=[])
    plan = build_plan(ckpt, pkg, None)
    schema = weight_schema(pkg.variant)
    assert [r.spec for r in plan.recipes] == schema
    assert plan.storage_profile == "bf16"
    assert plan.expert_layout == ("per_expert" if pkg.variant.moe else "none")
    fp32 = sum(r.nbytes for r in plan.recipes if r.spec.keep_fp32)
    assert plan.total_bytes == 2 * sum(math.prod(s.shape) for s in schema if not s.keep_fp32) + fp32
    if not pkg.variant.moe:
        return
    # a layer without any expert is reported by its two schema names, a partial one by expert names
    lm = "model.language_model.layers."
    drop = (f"{lm}5.mlp.experts.", f"{lm}7.mlp.experts.100.down_proj.", f"{lm}7.mlp.experts.3.up_proj.")
    damaged = {k: t for k, t in ckpt.tensors.items() if not k.startswith(drop)}
    with pytest.raises(ConvertError) as info:
        build_plan(dataclasses.replace(ckpt, tensors=damaged), pkg, None)
    msg = str(info.value)
    assert "4 missing" in msg and "unexpected" not in msg
    for name in ("layers.5.mlp.experts.gate_up_proj", "layers.5.mlp.experts.down_proj"):
        assert name in msg
    assert (
        "layers.7.mlp.experts.100.down_proj.weight" in msg and "layers.7.mlp.experts.3.up_proj.weight" in msg
    )


def test_plan_source_dtypes(tmp_path: Path) -> None:
    pkg = PACKAGES[DENSE]
    headers = hf_headers(DENSE)
    f64 = {k: dataclasses.replace(t, dtype="F64") for k, t in headers.items()}
    ckpt = HFCheckpoint(root=tmp_path, config=pkg.hf_config(), tensors=f64, shard_files=[])
    with pytest.raises(ConvertError, match="most text weights are F64.*pass --dtype"):
        build_plan(ckpt, pkg, None)
    plan = build_plan(ckpt, pkg, "fp16")
    assert plan.storage_profile == "fp16" and plan.source_profile == "f64"
    assert {r.dtype for r in plan.recipes} == {torch.float16, torch.float32}

    key = "model.language_model.layers.0.mlp.up_proj.weight"
    quantized = {**headers, key: dataclasses.replace(headers[key], dtype="I8")}
    with pytest.raises(ConvertError, match=f"{re.escape(key)} has dtype I8"):
        build_plan(dataclasses.replace(ckpt, tensors=quantized), pkg, None)
