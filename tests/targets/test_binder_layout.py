"""The binder's device layout: stacked row groups, exact members, the load report, peak memory.

Loading the tiny artifacts (fp32 as stored) with a cast to bf16 on CPU runs the same staging plan and
the same allocation as a GPU load; `gpu` tests load to CUDA and compare with the CPU load.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ninfer.artifact import Artifact
from ninfer.targets.qwen3_6.binder import (
    allocate_text_weights,
    load_model,
    load_model_view,
    random_model_view,
    random_weight,
)
from ninfer.targets.qwen3_6.view import ModelView, place_tensor, stacked_rows
from ninfer.targets.qwen3_6.weights import fused_row_groups, weight_schema
from ninfer.targets.registry import PACKAGES

torch.set_num_threads(1)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PACKAGE_FIXTURES = [("qwen3_6_tiny", "tiny_artifact"), ("qwen3_6_tiny_moe", "tiny_moe_artifact")]


def _stacked_matrices(view: ModelView) -> list[torch.Tensor | None]:
    """The view's stacked matrix of every fused group, in `fused_row_groups` order."""
    out: list[torch.Tensor | None] = []
    for layer in view.text.layers:
        out.append(getattr(layer.mixer, "qkv_proj" if layer.kind == "full_attention" else "in_proj"))
        out.append(getattr(layer.mlp, "input_proj" if view.variant.moe else "gate_up_proj"))
    return out


def _assert_stacked(view: ModelView) -> None:
    """Every group is one buffer: members are consecutive row blocks (views) of the stacked matrix."""
    groups = fused_row_groups(view.variant)
    stacked = _stacked_matrices(view)
    assert len(groups) == len(stacked)
    for group, matrix in zip(groups, stacked):
        assert matrix is not None, group
        members = [view.tensors[name] for name in group]
        assert matrix.shape == (sum(m.shape[0] for m in members), members[0].shape[1])
        row = 0
        for name, member in zip(group, members):
            assert member.untyped_storage().data_ptr() == matrix.untyped_storage().data_ptr(), name
            assert member.data_ptr() == matrix[row].data_ptr(), name  # its own row block, in group order
            row += member.shape[0]
        assert torch.equal(matrix, torch.cat(members))
    # distinct groups are distinct buffers (writing one never shows in another)
    storages = {m.untyped_storage().data_ptr() for m in stacked if m is not None}
    assert len(storages) == len(groups)


def _stored(path: Path) -> dict[str, torch.Tensor]:
    with Artifact.open(path) as artifact:
        return {name: artifact.tensor(name).clone() for name in artifact.tensor_names()}


@pytest.mark.parametrize(("package_name", "fixture"), PACKAGE_FIXTURES)
@pytest.mark.parametrize("staging", [64 << 10, 256 << 20])
def test_cast_load_stacks_groups_and_keeps_members_exact(
    package_name: str, fixture: str, staging: int, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(fixture)
    stored = _stored(path)
    loaded = load_model(path, "cpu", torch.bfloat16, staging_bytes=staging)
    view = loaded.view
    assert loaded.package.name == package_name
    for spec in weight_schema(view.variant):
        tensor, original = view.tensors[spec.name], stored[spec.name]
        if spec.group != "text":  # MTP and vision stay host-side, as stored
            assert tensor.dtype == original.dtype and tensor.device.type == "cpu", spec.name
            assert torch.equal(tensor, original), spec.name
            continue
        assert tensor.dtype == (torch.float32 if spec.keep_fp32 else torch.bfloat16), spec.name
        assert torch.equal(tensor, original.to(tensor.dtype)), spec.name
    _assert_stacked(view)

    report = loaded.report
    text_bytes = sum(stored[s.name].nbytes for s in weight_schema(view.variant) if s.group == "text")
    assert report.nbytes == text_bytes and not report.zero_copy
    assert report.num_tensors == sum(1 for s in weight_schema(view.variant) if s.group == "text")
    assert report.num_batches > 1 if staging == 64 << 10 else report.num_batches == 1
    assert report.seconds > 0 and report.gb_per_s > 0


def test_cpu_load_without_cast_stays_zero_copy(tiny_artifact: Path) -> None:
    loaded = load_model(tiny_artifact, "cpu")
    assert loaded.report.zero_copy and loaded.report.nbytes == 0
    assert all(m is None for m in _stacked_matrices(loaded.view))  # the mapped reference layout
    with Artifact.open(tiny_artifact) as artifact:
        embed = artifact.tensor("embed_tokens.weight")
        assert torch.equal(loaded.view.text.embed, embed)
    # the old entry point returns (package, view) as before
    package, view = load_model_view(tiny_artifact, "cpu", torch.float32)
    assert package.name == "qwen3_6_tiny" and all(m is None for m in _stacked_matrices(view))


def test_load_model_view_keeps_its_signature(tiny_moe_artifact: Path) -> None:
    package, view = load_model_view(tiny_moe_artifact, "cpu", torch.float16)
    assert package.name == "qwen3_6_tiny_moe" and view.dtype == torch.float16
    _assert_stacked(view)


@pytest.mark.parametrize("package_name", ["qwen3_6_tiny", "qwen3_6_tiny_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_random_view_stacks_groups_with_per_tensor_values(package_name: str, dtype: torch.dtype) -> None:
    variant = PACKAGES[package_name].variant
    view = random_model_view(variant, seed=11, dtype=dtype)
    _assert_stacked(view)
    generator = torch.Generator()
    for spec in weight_schema(variant):  # values depend only on (seed, name): regenerate one by one
        expected = place_tensor(random_weight(spec, variant, 11, generator), spec, "cpu", dtype)
        assert view.tensors[spec.name].dtype == expected.dtype, spec.name
        assert torch.equal(view.tensors[spec.name], expected), spec.name


def test_groups_that_cannot_stack_are_placed_member_by_member() -> None:
    variant = PACKAGES["qwen3_6_tiny"].variant
    schema = {s.name: s for s in weight_schema(variant) if s.group == "text"}
    shapes = {name: spec.shape for name, spec in schema.items()}
    dtypes = {name: torch.float32 for name in schema}
    groups = fused_row_groups(variant)
    mixed, narrow = groups[0], groups[1]
    dtypes[mixed[2]] = torch.float16  # one member in another dtype
    rows, cols = shapes[narrow[1]]
    shapes[narrow[1]] = (rows, cols + 1)  # one member of another width (a wrong-shape artifact)
    tensors = allocate_text_weights(variant, shapes, dtypes, "cpu")
    for group in (mixed, narrow):
        members = tuple(tensors[name] for name in group)
        assert stacked_rows(members) is None
        assert len({m.untyped_storage().data_ptr() for m in members}) == len(group)
    assert tensors[mixed[2]].dtype == torch.float16 and tensors[narrow[1]].shape == (rows, cols + 1)
    assert all(stacked_rows(tuple(tensors[n] for n in group)) is not None for group in groups[2:])


def test_tied_package_stacks_without_lm_head() -> None:
    variant = dataclasses.replace(PACKAGES["qwen3_6_tiny"].variant, tie_word_embeddings=True, vision=None)
    view = random_model_view(variant, seed=0, dtype=torch.bfloat16)
    _assert_stacked(view)
    assert view.text.lm_head is view.text.embed


# ---- GPU ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("package_name", "fixture"), PACKAGE_FIXTURES)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["as_stored", "bf16"])
@pytest.mark.parametrize("staging", [64 << 10, 2 << 20, 256 << 20])
def test_cuda_load_equals_cpu_load(
    package_name: str, fixture: str, dtype: torch.dtype | None, staging: int, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(fixture)
    reference = load_model(path, "cpu", dtype or torch.float32, staging_bytes=staging).view
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loaded = load_model(path, "cuda", dtype, staging_bytes=staging, progress=True)
    peak = torch.cuda.max_memory_allocated() - before
    view = loaded.view
    for spec in weight_schema(view.variant):
        tensor = view.tensors[spec.name]
        want = "cuda" if spec.group == "text" else "cpu"
        assert tensor.device.type == want, spec.name
        assert not tensor.isnan().any(), spec.name
        assert torch.equal(tensor.cpu(), reference.tensors[spec.name].to(tensor.dtype)), spec.name
    _assert_stacked(view)
    # the model once, plus at most one device staging buffer: never a second copy of the weights (nor of
    # its largest tensor). Slack: the caching allocator may hand a large tensor up to 2 MiB more.
    text = [view.tensors[s.name] for s in weight_schema(view.variant) if s.group == "text"]
    buffers = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in text}
    slack = (1 << 20) + (2 << 20) * sum(1 for nbytes in buffers.values() if nbytes > 1 << 20)
    assert slack < max(t.nbytes for t in text)
    assert peak <= sum(buffers.values()) + staging + slack, (peak, sum(buffers.values()), slack)
    report = loaded.report
    assert report.device.startswith("cuda") and report.gb_per_s > 0
    print(f"{package_name} dtype={dtype} staging={staging}: {report}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_random_view_stacks_groups_with_per_tensor_values(dtype: torch.dtype) -> None:
    variant = PACKAGES["qwen3_6_tiny_moe"].variant
    view = random_model_view(variant, seed=3, dtype=dtype, device="cuda")
    _assert_stacked(view)
    generator = torch.Generator(device="cuda")
    for spec in weight_schema(variant):
        expected = place_tensor(random_weight(spec, variant, 3, generator), spec, "cuda", dtype)
        assert torch.equal(view.tensors[spec.name], expected), spec.name
