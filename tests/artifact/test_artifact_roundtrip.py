"""Round trip, zero-copy mapping, layout invariants, determinism and writer misuse of `.ninfer`."""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer.artifact import (
    ALIGNMENT,
    DTYPES,
    Artifact,
    ArtifactError,
    ArtifactWriteError,
    ArtifactWriter,
    MissingTensorError,
    TensorSpec,
)
from ninfer.artifact.format import PREFIX, PREFIX_SIZE
from ninfer.targets.qwen3_6.resources import RESOURCE_DIR

torch.set_num_threads(1)

IDENTITY = {"family": "qwen3_6", "package": "qwen3_6_tiny", "storage_profile": "bf16"}
DIMS = {"hidden_size": 8, "nested": {"eos": [1, 2]}, "rope_theta": 1e7}
PROVENANCE = {"converter": "test 0", "sources": [{"name": "model.safetensors", "bytes": 123}]}


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype`` (covers every bit pattern, NaNs included)."""
    numel = 1
    for s in shape:
        numel *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write(path: Path, tensors: dict[str, torch.Tensor], frontend: dict[str, bytes] | None = None,
          provenance: dict | None = None) -> None:
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    with ArtifactWriter(path, identity=IDENTITY, dims=DIMS, tensors=specs, frontend=frontend or {},
                        provenance=provenance or PROVENANCE) as w:
        for name, t in tensors.items():
            w.write_tensor(name, t)


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed_tokens.weight": random_tensor(torch.bfloat16, (17, 8), gen),
        "layers.0.linear_attn.A_log": random_tensor(torch.float32, (3,), gen),
        "scalar": random_tensor(torch.float16, (), gen),
        "visual.patch_embed.proj.weight": random_tensor(torch.bfloat16, (2, 3, 2, 2, 2), gen),
        "empty": random_tensor(torch.float32, (0, 5), gen),
        "ids": random_tensor(torch.int64, (4,), gen),
        "mask": random_tensor(torch.bool, (3, 3), gen),
        "fp8": random_tensor(torch.float8_e4m3fn, (5,), gen),
        "big": random_tensor(torch.bfloat16, (3000,), gen),  # spans two pages
    }


def test_round_trip_exact_bytes_and_metadata(tmp_path: Path) -> None:
    tensors = sample_tensors()
    tokenizer = (RESOURCE_DIR / "tokenizer.json").read_bytes()
    template = (RESOURCE_DIR / "qwen3_6.jinja").read_text()
    path = tmp_path / "m.ninfer"
    write(path, tensors, frontend={"tokenizer.json": tokenizer, "chat_template": template,
                                   "generation_config.json": b'{"temperature": 0.7}'})
    assert not (tmp_path / "m.ninfer.partial").exists()

    with Artifact.open(path, verify=True) as a:
        assert a.format_version == 1
        assert a.identity == IDENTITY and a.dims == DIMS and a.provenance == PROVENANCE
        assert a.tensor_names() == list(tensors)
        assert a.tensor_specs() == [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
        assert a.total_tensor_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
        for name, expected in tensors.items():
            got = a.tensor(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            assert as_bytes(got) == as_bytes(expected), name
        assert a.frontend_names() == ["chat_template", "generation_config.json", "tokenizer.json"]
        assert a.frontend_resource("tokenizer.json") == tokenizer
        assert a.frontend_resource("chat_template") == template.encode("utf-8")
        assert a.frontend_resource("preprocessor_config.json") is None
        media = {r.name: r.media_type for r in a.frontend_descriptors()}
        assert media["tokenizer.json"] == "application/json"
        assert media["chat_template"].startswith("text/x-jinja2")
        with pytest.raises(MissingTensorError, match="'nope'") as e:
            a.tensor("nope")
        assert e.value.tensor == "nope" and str(path) in str(e.value)


def test_layout_is_aligned_and_file_ends_at_last_blob(tmp_path: Path) -> None:
    path = tmp_path / "m.ninfer"
    write(path, sample_tensors(), frontend={"chat_template": b"x" * 5000})
    raw = path.read_bytes()
    magic, version, _, json_len, payload_offset = PREFIX.unpack(raw[:PREFIX_SIZE])
    assert magic == b"NINFER\0\0" and version == 1
    assert payload_offset % ALIGNMENT == 0 and payload_offset >= PREFIX_SIZE + json_len
    assert raw[PREFIX_SIZE + json_len : payload_offset] == bytes(payload_offset - PREFIX_SIZE - json_len)
    with Artifact.open(path) as a:
        blobs = sorted([(d.offset, d.nbytes) for d in a.descriptors()]
                       + [(r.offset, r.nbytes) for r in a.frontend_descriptors()])
        assert all(off % ALIGNMENT == 0 for off, _ in blobs)
        for (o1, n1), (o2, _) in zip(blobs, blobs[1:]):
            assert o1 + n1 <= o2
        assert a.file_bytes == len(raw) == payload_offset + max(o + n for o, n in blobs)
        # resources come first (name order), then tensors in declared order
        assert a.frontend_descriptors()[0].offset == 0
        offsets = [d.offset for d in a.descriptors()]
        assert offsets == sorted(offsets)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 5), min_size=0, max_size=5)),
        min_size=0, max_size=6,
    ),
    st.integers(0, 2**31),
)
def test_round_trip_property(layout: list[tuple[str, list[int]]], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": random_tensor(DTYPES[dt], tuple(shape), gen) for i, (dt, shape) in enumerate(layout)}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "p.ninfer"
        write(path, tensors)
        with Artifact.open(path, verify=True) as a:
            assert a.tensor_names() == list(tensors)
            for name, t in tensors.items():
                got = a.tensor(name)
                assert got.dtype == t.dtype and tuple(got.shape) == tuple(t.shape)
                assert as_bytes(got) == as_bytes(t)
                assert a.descriptor(name).offset % ALIGNMENT == 0


def _mapping_of(path: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            lo, hi = fields[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_tensor_is_zero_copy_view_of_the_mapped_file(tmp_path: Path) -> None:
    path = tmp_path / "m.ninfer"
    tensors = sample_tensors()
    write(path, tensors)
    a = Artifact.open(path)
    ranges = _mapping_of(path)
    assert ranges, "the file is not memory-mapped"
    for name in ("embed_tokens.weight", "big", "scalar"):
        t = a.tensor(name)
        ptr = t.data_ptr()
        assert any(lo <= ptr and ptr + t.numel() * t.element_size() <= hi for lo, hi in ranges), name
        assert ptr % ALIGNMENT == 0  # page-aligned, so the mapping start is too
    # two views of one tensor share memory (no copy per call)
    assert a.tensor("big").data_ptr() == a.tensor("big").data_ptr()

    # a view outlives close(): the mapping stays until the last view is gone
    keep = a.tensor("big")
    a.close()
    with pytest.raises(ArtifactError, match="closed"):
        a.tensor("big")
    del a
    gc.collect()
    assert as_bytes(keep) == as_bytes(tensors["big"])
    # writes to a view are private (copy-on-write): the file is unchanged
    before = path.read_bytes()
    keep.zero_()
    assert path.read_bytes() == before
    del keep, t
    gc.collect()
    assert not _mapping_of(path), "the mapping should be released with its last view"


def test_output_is_deterministic(tmp_path: Path) -> None:
    tensors = sample_tensors()
    frontend = {"tokenizer.json": b'{"a": 1}', "chat_template": b"{{ x }}"}
    write(tmp_path / "a.ninfer", tensors, frontend=frontend)
    write(tmp_path / "b.ninfer", tensors, frontend=dict(reversed(list(frontend.items()))))
    assert (tmp_path / "a.ninfer").read_bytes() == (tmp_path / "b.ninfer").read_bytes()
    write(tmp_path / "c.ninfer", tensors, frontend=frontend, provenance={**PROVENANCE, "x": 1})
    assert (tmp_path / "a.ninfer").read_bytes() != (tmp_path / "c.ninfer").read_bytes()


def test_non_contiguous_input_is_stored_contiguous(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    path = tmp_path / "m.ninfer"
    write(path, {"t": base.t()})
    with Artifact.open(path) as a:
        assert torch.equal(a.tensor("t"), base.t())


# ---- writer misuse --------------------------------------------------------------------------------

SPECS = [TensorSpec("a", torch.float32, (2, 3)), TensorSpec("b", torch.bfloat16, (4,))]


def make_writer(path: Path) -> ArtifactWriter:
    return ArtifactWriter(path, identity=IDENTITY, dims=DIMS, tensors=SPECS, frontend={}, provenance={})


def test_writer_refuses_wrong_name_order_dtype_shape_and_stays_usable(tmp_path: Path) -> None:
    path = tmp_path / "w.ninfer"
    w = make_writer(path)
    a, b = torch.ones(2, 3), torch.ones(4, dtype=torch.bfloat16)
    cases = [
        ("zzz", a, "is not a declared tensor; expected 'a'"),
        ("b", b, "is out of order; expected 'a'"),
        ("a", torch.ones(3, 2), r"shape \(3, 2\) != declared \(2, 3\)"),
        ("a", torch.ones(2, 3, dtype=torch.float16), "dtype torch.float16 != declared torch.float32"),
    ]
    for name, t, msg in cases:
        with pytest.raises(ArtifactWriteError, match=msg) as e:
            w.write_tensor(name, t)
        assert e.value.tensor == name and str(path) in str(e.value)
    w.write_tensor("a", a)
    with pytest.raises(ArtifactWriteError, match="was already written; expected 'b'"):
        w.write_tensor("a", a)
    assert w.expected_next == "b"
    w.write_tensor("b", b)
    assert w.expected_next is None
    with pytest.raises(ArtifactWriteError, match="already written"):
        w.write_tensor("c", a)
    w.close()
    w.close()  # idempotent
    with pytest.raises(ArtifactWriteError, match="writer is closed"):
        w.write_tensor("a", a)
    with Artifact.open(path, verify=True) as art:
        assert torch.equal(art.tensor("a"), a) and torch.equal(art.tensor("b"), b)


def test_close_without_all_tensors_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "w.ninfer"
    w = make_writer(path)
    assert (tmp_path / "w.ninfer.partial").exists() and not path.exists()
    w.write_tensor("a", torch.ones(2, 3))
    with pytest.raises(ArtifactWriteError, match=r"1 of 2 declared tensors unwritten \('b'\)"):
        w.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(ArtifactWriteError, match="aborted"):
        w.close()


def test_exception_inside_context_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "w.ninfer"
    with pytest.raises(RuntimeError, match="boom"), make_writer(path) as w:
        w.write_tensor("a", torch.ones(2, 3))
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_writer_refuses_bad_declarations(tmp_path: Path) -> None:
    p = tmp_path / "w.ninfer"
    ok = {"identity": IDENTITY, "dims": DIMS, "tensors": SPECS, "frontend": {}, "provenance": {}}
    bad = [
        ({"tensors": SPECS + [SPECS[0]]}, "declared twice"),
        ({"identity": {"family": "qwen3_6", "package": "x"}}, "storage_profile"),
        ({"provenance": {"when": object()}}, "provenance is not JSON-serialisable"),
        ({"dims": {"x": float("nan")}}, "dims is not JSON-serialisable"),
        ({"frontend": {"tokenizer.json": 5}}, "must be bytes"),
        ({"tensors": [TensorSpec("c", torch.complex64, (1,))]}, "not storable"),
    ]
    for override, msg in bad:
        with pytest.raises(ArtifactWriteError, match=msg):
            ArtifactWriter(p, **{**ok, **override})
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="negative"):
        TensorSpec("n", torch.float32, (2, -1))
