"""ModelView binding and schema checks; the binder's random weights, HF names and artifact loading."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from qwen3_6_model_harness import TINY_PACKAGES, tiny_view

from ninfer.targets.qwen3_6.binder import hf_state_dict, load_model_view, random_model_view
from ninfer.targets.qwen3_6.view import (
    AttentionLayerView,
    DenseMlpView,
    GdnLayerView,
    ModelView,
    ModelViewError,
    MoeMlpView,
)
from ninfer.targets.qwen3_6.weights import weight_schema
from ninfer.targets.registry import PACKAGES, PackageMismatch

torch.set_num_threads(1)


@pytest.mark.parametrize("package_name", TINY_PACKAGES)
def test_view_binds_every_schema_tensor_by_role(package_name: str) -> None:
    view = tiny_view(package_name)
    variant = view.variant
    schema = weight_schema(variant)
    assert list(view.tensors) == [spec.name for spec in schema]

    layers = view.text.layers
    assert tuple(layer.kind for layer in layers) == variant.layer_types
    gdn = [layer for layer in layers if layer.kind == "linear_attention"]
    attn = [layer for layer in layers if layer.kind == "full_attention"]
    assert all(isinstance(layer.mixer, GdnLayerView) for layer in gdn)
    assert all(isinstance(layer.mixer, AttentionLayerView) for layer in attn)
    assert [layer.state_index for layer in gdn] == list(range(len(variant.gdn_layers)))
    assert [layer.state_index for layer in attn] == list(range(len(variant.attention_layers)))
    mlp_type = MoeMlpView if variant.moe else DenseMlpView
    assert all(isinstance(layer.mlp, mlp_type) for layer in layers)

    # roles point at the right tensors, without copies
    t = view.tensors
    first_attn = variant.attention_layers[0]
    assert attn[0].mixer.q_proj is t[f"layers.{first_attn}.self_attn.q_proj.weight"]
    assert gdn[0].mixer.A_log is t["layers.0.linear_attn.A_log"]
    assert gdn[0].mixer.conv_weight.shape == (variant.conv_dim, variant.linear_conv_kernel_dim)
    assert gdn[0].mixer.conv_weight.data_ptr() == t["layers.0.linear_attn.conv1d.weight"].data_ptr()
    assert view.text.lm_head is t["lm_head.weight"]
    assert view.mtp is not None and len(view.mtp.layers) == variant.mtp_num_hidden_layers
    assert view.mtp.layers[0].kind == "full_attention"
    assert view.vision is not None and variant.vision is not None
    assert len(view.vision.blocks) == variant.vision.depth


def test_view_reports_every_schema_violation_at_once() -> None:
    view = tiny_view("qwen3_6_tiny")
    tensors = dict(view.tensors)
    del tensors["layers.0.linear_attn.A_log"]
    del tensors["norm.weight"]
    tensors["layers.3.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    tensors["layers.99.mystery.weight"] = torch.zeros(1)
    with pytest.raises(ModelViewError) as err:
        ModelView.from_tensors(view.variant, tensors)
    message = str(err.value)
    for name in (
        "layers.0.linear_attn.A_log",
        "norm.weight",
        "layers.3.self_attn.q_proj.weight",
        "layers.99.mystery",
    ):
        assert name in message
    assert "2 missing" in message and "1 with a wrong shape" in message and "1 not in the schema" in message


def test_tied_package_reads_lm_head_from_the_embedding() -> None:
    variant = dataclasses.replace(PACKAGES["qwen3_6_tiny"].variant, tie_word_embeddings=True, vision=None)
    view = random_model_view(variant, seed=0, dtype=torch.float32)
    assert "lm_head.weight" not in view.tensors and view.vision is None
    assert view.text.lm_head is view.text.embed
    assert "lm_head.weight" not in hf_state_dict(view)


@pytest.mark.parametrize("package_name", TINY_PACKAGES)
def test_hf_state_dict_names_and_shapes_match_transformers(package_name: str) -> None:
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    package = PACKAGES[package_name]
    cfg = package.hf_config()
    if package.variant.moe:
        vlm_cls, lm_cls, config_cls, text_cls = (
            Qwen3_5MoeForConditionalGeneration,
            Qwen3_5MoeForCausalLM,
            Qwen3_5MoeConfig,
            Qwen3_5MoeTextConfig,
        )
    else:
        vlm_cls, lm_cls, config_cls, text_cls = (
            Qwen3_5ForConditionalGeneration,
            Qwen3_5ForCausalLM,
            Qwen3_5Config,
            Qwen3_5TextConfig,
        )
    with torch.device("meta"):
        vlm_shapes = {k: tuple(v.shape) for k, v in vlm_cls(config_cls(**cfg)).state_dict().items()}
        lm_shapes = {
            k: tuple(v.shape) for k, v in lm_cls(text_cls(**cfg["text_config"])).state_dict().items()
        }

    view = tiny_view(package_name)
    full = {k: tuple(v.shape) for k, v in hf_state_dict(view).items()}
    mtp = {k: s for k, s in full.items() if k.startswith("mtp.")}
    assert len(mtp) == sum(1 for spec in weight_schema(view.variant) if spec.group == "mtp")
    assert {k: s for k, s in full.items() if not k.startswith("mtp.")} == vlm_shapes
    assert {k: tuple(v.shape) for k, v in hf_state_dict(view, text_only=True).items()} == lm_shapes


def test_random_view_is_seeded_realistic_and_keeps_fp32_pins() -> None:
    variant = PACKAGES["qwen3_6_tiny_moe"].variant
    view = random_model_view(variant, seed=5, dtype=torch.bfloat16)
    again = random_model_view(variant, seed=5, dtype=torch.bfloat16)
    other = random_model_view(variant, seed=6, dtype=torch.bfloat16)
    for spec in weight_schema(variant):
        tensor = view.tensors[spec.name]
        assert tensor.dtype == (torch.float32 if spec.keep_fp32 else torch.bfloat16), spec.name
        assert torch.equal(tensor, again.tensors[spec.name]), spec.name
        assert not torch.equal(tensor, other.tensors[spec.name]), spec.name
        assert tensor.float().std() > 0 if tensor.numel() > 1 else True, spec.name

    layer0 = view.text.layers[0]
    gdn = layer0.mixer
    assert isinstance(gdn, GdnLayerView)
    # zero-centred norms are randomised around 0, the gated norm around 1: a 1+w / w mix-up shows
    assert layer0.input_norm.float().abs().max() > 0.1 and layer0.input_norm.float().abs().mean() < 0.5
    assert (gdn.norm.float() - 1).abs().max() > 0.1 and gdn.norm.float().min() > 0.4
    decay_rate = gdn.A_log.exp()
    dt = F.softplus(gdn.dt_bias)
    assert decay_rate.min() >= 1 - 1e-5 and decay_rate.max() <= 16 + 1e-4
    assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 1e-1 * (1 + 1e-4)
    # linear layers keep activations O(1): std ~ fan_in^-0.5
    assert math.isclose(gdn.in_proj_qkv.float().std().item(), variant.hidden_size**-0.5, rel_tol=0.1)


def test_view_to_casts_all_but_fp32_pins() -> None:
    view = tiny_view("qwen3_6_tiny").to(dtype=torch.float16)
    assert view.dtype == torch.float16
    for spec in weight_schema(view.variant):
        assert view.tensors[spec.name].dtype == (torch.float32 if spec.keep_fp32 else torch.float16)


def _write_artifact(path: str, view: ModelView, package_name: str, dims: dict | None = None) -> None:
    from ninfer.artifact import ArtifactWriter, TensorSpec

    package = PACKAGES[package_name]
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in view.tensors.items()]
    with ArtifactWriter(
        path,
        identity=package.identity("fp32"),
        dims=dims if dims is not None else package.variant.dims(),
        tensors=specs,
        frontend={},
        provenance={"test": "tests/model"},
    ) as writer:
        for name, tensor in view.tensors.items():
            writer.write_tensor(name, tensor)


def test_load_model_view_from_artifact(tmp_path: pytest.TempPathFactory) -> None:
    package_name = "qwen3_6_tiny_moe"
    source = tiny_view(package_name)
    path = str(tmp_path / "tiny_moe.ninfer")  # type: ignore[operator]
    _write_artifact(path, source, package_name)

    package, view = load_model_view(path, "cpu", dtype=torch.bfloat16)
    assert package.name == package_name
    for spec in weight_schema(package.variant):
        loaded, original = view.tensors[spec.name], source.tensors[spec.name]
        if spec.group != "text":  # MTP and vision stay in host memory, as stored, until a forward reads them
            assert loaded.dtype == original.dtype and loaded.device.type == "cpu", spec.name
            continue
        assert loaded.dtype == (torch.float32 if spec.keep_fp32 else torch.bfloat16), spec.name
        assert torch.equal(loaded, original.to(loaded.dtype)), spec.name

    # without a cast on CPU the tensors are the file's mapped bytes, not copies
    _, mapped = load_model_view(path, "cpu")
    assert torch.equal(mapped.text.embed, source.text.embed)


def test_load_model_view_refuses_wrong_dims(tmp_path: pytest.TempPathFactory) -> None:
    package_name = "qwen3_6_tiny"
    path = str(tmp_path / "wrong.ninfer")  # type: ignore[operator]
    dims = PACKAGES[package_name].variant.dims()
    dims["rms_norm_eps"] = 1e-5
    _write_artifact(path, tiny_view(package_name), package_name, dims=dims)
    with pytest.raises(PackageMismatch, match="rms_norm_eps"):
        load_model_view(path, "cpu")
