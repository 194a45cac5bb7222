"""`check_identity`: an artifact binds only to the registered package it names, with exact dims."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ninfer.artifact import Artifact, ArtifactError, ArtifactWriter, TensorSpec
from ninfer.targets.identity import IdentityMismatchError, check_identity
from ninfer.targets.registry import PackageMismatch, get_package

torch.set_num_threads(1)

TINY = get_package("qwen3_6_tiny")


def make(path: Path, identity: dict[str, str], dims: dict[str, Any]) -> Artifact:
    spec = TensorSpec("norm.weight", torch.bfloat16, (TINY.variant.hidden_size,))
    with ArtifactWriter(path, identity=identity, dims=dims, tensors=[spec], frontend={}, provenance={}) as w:
        w.write_tensor(spec.name, torch.ones(spec.shape, dtype=spec.dtype))
    return Artifact.open(path)


def test_matching_identity_binds(tmp_path: Path) -> None:
    with make(tmp_path / "ok.ninfer", TINY.identity("bf16"), TINY.variant.dims()) as a:
        assert check_identity(a) is TINY
        assert check_identity(a, "qwen3_6_tiny") is TINY
        assert check_identity(a, TINY) is TINY


def test_wrong_dims_are_refused_with_the_field(tmp_path: Path) -> None:
    dims = TINY.variant.dims()
    dims["hidden_size"] = 128
    dims["special"]["eos"] = [1]
    path = tmp_path / "dims.ninfer"
    with make(path, TINY.identity("bf16"), dims) as a, pytest.raises(IdentityMismatchError) as e:
        check_identity(a)
    msg = str(e.value)
    assert msg.startswith(f"{path}: dims do not match package 'qwen3_6_tiny'"), msg
    assert "hidden_size: 64 != 128" in msg and "special" in msg
    assert isinstance(e.value, PackageMismatch) and isinstance(e.value, ArtifactError)


def test_unreadable_dims_are_refused(tmp_path: Path) -> None:
    dims = {**TINY.variant.dims(), "not_a_field": 1}
    with make(tmp_path / "d.ninfer", TINY.identity("bf16"), dims) as a, \
            pytest.raises(IdentityMismatchError, match="dims are not readable .*not_a_field"):
        check_identity(a)


def test_unknown_package_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "u.ninfer"
    ident = {"family": "qwen3_6", "package": "qwen3_6_999b", "storage_profile": "bf16"}
    with make(path, ident, TINY.variant.dims()) as a, pytest.raises(IdentityMismatchError) as e:
        check_identity(a)
    assert str(e.value).startswith(f"{path}: identity names unknown package 'qwen3_6_999b'")
    assert "qwen3_6_tiny" in str(e.value)  # lists the registered ones


def test_wrong_family_profile_or_requested_package_is_refused(tmp_path: Path) -> None:
    cases = [
        ({**TINY.identity("bf16"), "family": "llama"}, None, "identity family 'llama' != package"),
        (TINY.identity("int3"), None, "unknown storage profile 'int3'"),
        (TINY.identity("bf16"), "qwen3_6_tiny_moe",
         "is package 'qwen3_6_tiny', not the requested 'qwen3_6_tiny_moe'"),
    ]
    for i, (ident, wanted, message) in enumerate(cases):
        with make(tmp_path / f"{i}.ninfer", ident, TINY.variant.dims()) as a, \
                pytest.raises(IdentityMismatchError, match=message):
            check_identity(a, wanted)
