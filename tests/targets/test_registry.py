"""The closed registry: exact dims of the real packages, `ninfer packages`, and refusals that name the
mismatch."""

from __future__ import annotations

import copy
import json

import pytest

from ninfer.cli.main import main
from ninfer.targets.registry import PACKAGES, PackageMismatch, check_dims, package_for_hf_config


def test_real_package_dims() -> None:
    dense, moe = PACKAGES["qwen3_6_27b"].variant, PACKAGES["qwen3_6_35b_a3b"].variant
    assert (dense.hidden_size, dense.num_layers, len(dense.gdn_layers), len(dense.attention_layers)) == (
        5120,
        64,
        48,
        16,
    )
    assert dense.attention_layers[:2] == (3, 7) and dense.conv_dim == 10240 and dense.rotary_dim == 64
    assert (moe.hidden_size, moe.num_layers, moe.num_experts, moe.num_experts_per_tok) == (2048, 40, 256, 8)
    assert moe.conv_dim == 8192 and moe.vocab_size == 248320
    assert PACKAGES["qwen3_8_27b"].variant == dense  # same architecture, told apart by model_type


def test_every_hf_config_maps_back_to_its_package() -> None:
    for name, package in PACKAGES.items():
        assert package_for_hf_config(package.hf_config()) is package, name


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (("text_config", "num_hidden_layers"), 63, "num_hidden_layers=63"),
        (("text_config", "linear_num_value_heads"), 32, "linear_num_value_heads"),
        (("vision_config", "depth"), 26, "vision"),
        (("text_config", "rope_parameters", "mrope_section"), [12, 10, 10], "mrope_section"),
    ],
)
def test_mismatch_is_refused_naming_the_field(path: tuple[str, ...], value: object, named: str) -> None:
    cfg = copy.deepcopy(PACKAGES["qwen3_6_27b"].hf_config())
    node = cfg
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(PackageMismatch, match=named):
        package_for_hf_config(cfg)


def test_unknown_family_and_stored_dims_mismatch() -> None:
    with pytest.raises(PackageMismatch, match="not a Qwen3.5/3.6"):
        package_for_hf_config({"model_type": "llama", "hidden_size": 4096})
    dims = PACKAGES["qwen3_6_tiny"].variant.dims()
    dims["head_dim"] = 64
    with pytest.raises(PackageMismatch, match="head_dim"):
        check_dims(PACKAGES["qwen3_6_tiny"], dims, "x.ninfer")


def test_packages_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["packages", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [p["package"] for p in listed] == list(PACKAGES)
    for entry in listed:
        cfg = entry["hf_config"]
        assert {"text_config", "model_type", "architectures"} <= cfg.keys()
        assert ("vision_config" in cfg) == (PACKAGES[entry["package"]].variant.vision is not None)
        assert package_for_hf_config(cfg) is PACKAGES[entry["package"]]
    assert main(["packages"]) == 0
    text = capsys.readouterr().out
    assert "qwen3_6_27b" in text and "48 GDN + 16 attention" in text


def test_real_configs_build_transformers_models_of_the_schema_shapes() -> None:
    import torch
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    from ninfer.targets.qwen3_6.weights import weight_schema

    for name in ("qwen3_6_27b", "qwen3_6_35b_a3b"):
        package = PACKAGES[name]
        cfg = {k: v for k, v in package.hf_config().items() if k not in ("architectures", "model_type")}
        config_cls, model_cls = (
            (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)
            if package.variant.moe
            else (Qwen3_5Config, Qwen3_5ForConditionalGeneration)
        )
        with torch.device("meta"):
            model = model_cls(config_cls(**cfg))
        hf = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        ours = {
            (
                "model." + s.name
                if s.name.startswith("visual.")
                else s.name
                if s.name == "lm_head.weight"
                else "model.language_model." + s.name
            ): s.shape
            for s in weight_schema(package.variant)
            if s.group != "mtp"
        }
        assert hf == ours, name


def test_state_bytes_of_the_27b_match_the_reference_table() -> None:
    import torch

    from ninfer.targets.qwen3_6.open import state_bytes

    v = PACKAGES["qwen3_6_27b"].variant
    # one StateImage slot: conv 48 x 10240 x 3 x 2 B + recurrent 144 MiB fp32; KV 64 KiB per token
    slot = 48 * 10240 * 3 * 2 + 144 * 2**20
    assert state_bytes(v, 1, 0, 64, torch.bfloat16) == slot
    assert state_bytes(v, 0, 32, 64, torch.bfloat16) == 2048 * 64 * 2**10
