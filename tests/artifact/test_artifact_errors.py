"""Every way a `.ninfer` file can be wrong is a typed ArtifactError naming the file (and the tensor)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from ninfer.artifact import (
    Artifact,
    ArtifactError,
    ArtifactWriter,
    ChecksumMismatchError,
    CorruptHeaderError,
    DescriptorError,
    NotAnArtifactError,
    TensorSpec,
    TruncatedArtifactError,
    UnsupportedVersionError,
)
from ninfer.artifact.format import PREFIX, PREFIX_SIZE, header_crc32

torch.set_num_threads(1)

IDENTITY = {"family": "qwen3_6", "package": "qwen3_6_tiny", "storage_profile": "bf16"}
TENSORS = {
    "layers.0.mlp.up_proj.weight": torch.arange(24, dtype=torch.float32).reshape(4, 6),
    "layers.0.input_layernorm.weight": torch.linspace(-1, 1, 5000).to(torch.bfloat16),
    "norm.weight": torch.ones(8, dtype=torch.bfloat16),
}


@pytest.fixture
def artifact_path(tmp_path: Path) -> Path:
    path = tmp_path / "m.ninfer"
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in TENSORS.items()]
    with ArtifactWriter(path, identity=IDENTITY, dims={"hidden_size": 8}, tensors=specs,
                        frontend={"chat_template": b"{{ messages }}"}, provenance={"converter": "t"}) as w:
        for name, t in TENSORS.items():
            w.write_tensor(name, t)
    return path


def flip_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def rewrite_header(path: Path, edit: Any, raw_json: bytes | None = None) -> None:
    """Replace the JSON header (edited dict, or raw bytes) and re-seal it with a valid checksum,
    so the reader's schema/layout checks (not the checksum) are what is tested."""
    raw = path.read_bytes()
    _, version, _, json_len, payload_offset = PREFIX.unpack(raw[:PREFIX_SIZE])
    if raw_json is None:
        header = json.loads(raw[PREFIX_SIZE : PREFIX_SIZE + json_len])
        edit(header)
        raw_json = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    assert PREFIX_SIZE + len(raw_json) <= payload_offset
    unsigned = PREFIX.pack(b"NINFER\0\0", version, 0, len(raw_json), payload_offset)
    crc = header_crc32(unsigned, raw_json)
    prefix = PREFIX.pack(b"NINFER\0\0", version, crc, len(raw_json), payload_offset)
    pad = bytes(payload_offset - PREFIX_SIZE - len(raw_json))
    path.write_bytes(prefix + raw_json + pad + raw[payload_offset:])


def test_bad_magic(tmp_path: Path, artifact_path: Path) -> None:
    for name, data in [("empty", b""), ("text", b"hello, this is not a model file" * 10),
                       ("safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")]:
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(NotAnArtifactError, match=rf"^{p}: not a .ninfer file"):
            Artifact.open(p)
    flip_byte(artifact_path, 3)
    with pytest.raises(NotAnArtifactError):
        Artifact.open(artifact_path)


def test_unsupported_version(artifact_path: Path) -> None:
    raw = bytearray(artifact_path.read_bytes())
    raw[8:12] = struct.pack("<I", 2)
    artifact_path.write_bytes(bytes(raw))
    message = rf"^{artifact_path}: format version 2 is not supported"
    with pytest.raises(UnsupportedVersionError, match=message):
        Artifact.open(artifact_path)


def test_truncated_at_several_points(artifact_path: Path) -> None:
    full = artifact_path.read_bytes()
    _, _, _, json_len, payload_offset = PREFIX.unpack(full[:PREFIX_SIZE])
    with Artifact.open(artifact_path) as a:
        mid_tensor = a.payload_offset + a.descriptor("layers.0.input_layernorm.weight").offset + 100
    cuts = {
        "inside magic": 5,
        "inside fixed header": 20,
        "inside JSON header": PREFIX_SIZE + json_len // 2,
        "in header padding": payload_offset - 1,
        "at payload start": payload_offset,
        "inside a tensor": mid_tensor,
        "one byte short": len(full) - 1,
    }
    for where, n in cuts.items():
        artifact_path.write_bytes(full[:n])
        with pytest.raises(TruncatedArtifactError, match=rf"^{artifact_path}: truncated") as e:
            Artifact.open(artifact_path)
        assert e.type is TruncatedArtifactError, where
    artifact_path.write_bytes(full + b"\0")
    with pytest.raises(ArtifactError, match="1 unexpected bytes after the payload end"):
        Artifact.open(artifact_path)


def test_flipped_tensor_byte_names_the_tensor(artifact_path: Path) -> None:
    name = "layers.0.input_layernorm.weight"
    with Artifact.open(artifact_path) as a:
        where = a.payload_offset + a.descriptor(name).offset + 4097  # on its second page
        a.verify()  # clean before the flip
    flip_byte(artifact_path, where)
    with Artifact.open(artifact_path) as a:  # a plain open reads only the header
        message = rf"^{artifact_path}: tensor '{name}': checksum mismatch"
        with pytest.raises(ChecksumMismatchError, match=message) as e:
            a.verify()
        assert e.value.tensor == name
    with pytest.raises(ChecksumMismatchError, match=name):
        Artifact.open(artifact_path, verify=True)


def test_flipped_resource_byte_names_the_resource(artifact_path: Path) -> None:
    with Artifact.open(artifact_path) as a:
        where = a.payload_offset + a.frontend_descriptors()[0].offset + 3
    flip_byte(artifact_path, where)
    with Artifact.open(artifact_path) as a:
        with pytest.raises(ChecksumMismatchError, match="frontend resource 'chat_template'") as e:
            a.frontend_resource("chat_template")
        assert e.value.resource == "chat_template"
        with pytest.raises(ChecksumMismatchError, match="chat_template"):
            a.verify()


def test_two_bad_tensors_report_first_and_count(artifact_path: Path) -> None:
    with Artifact.open(artifact_path) as a:
        spots = [a.payload_offset + d.offset for d in a.descriptors()]
    for s in spots[1:]:
        flip_byte(artifact_path, s)
    with Artifact.open(artifact_path) as a, pytest.raises(ChecksumMismatchError) as e:
        a.verify()
    assert e.value.tensor == "layers.0.input_layernorm.weight"
    assert "1 more blob(s) also mismatch: 'norm.weight'" in str(e.value)


def test_flipped_json_header_byte(artifact_path: Path) -> None:
    _, _, _, json_len, _ = PREFIX.unpack(artifact_path.read_bytes()[:PREFIX_SIZE])
    original = artifact_path.read_bytes()
    # JSON start/middle/end, then the prefix's crc, JSON length and payload offset fields
    for offset in (PREFIX_SIZE, PREFIX_SIZE + json_len // 2, PREFIX_SIZE + json_len - 1, 12, 16, 24):
        flip_byte(artifact_path, offset)
        with pytest.raises(CorruptHeaderError, match=rf"^{artifact_path}: header checksum mismatch"):
            Artifact.open(artifact_path)
        artifact_path.write_bytes(original)


def test_sealed_but_invalid_json(artifact_path: Path) -> None:
    rewrite_header(artifact_path, None, raw_json=b'{"identity": {"family": ')
    with pytest.raises(CorruptHeaderError, match="not valid UTF-8 JSON"):
        Artifact.open(artifact_path)
    rewrite_header(artifact_path, None, raw_json=b"[1, 2]")
    with pytest.raises(CorruptHeaderError, match="not an object"):
        Artifact.open(artifact_path)


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (lambda h: h.pop("identity"), CorruptHeaderError, "header has no 'identity'"),
        (lambda h: h["identity"].pop("storage_profile"), CorruptHeaderError,
         "identity has no 'storage_profile'"),
        (lambda h: h["tensors"][1].update(dtype="float7"), CorruptHeaderError,
         "tensor 'layers.0.input_layernorm.weight': unknown dtype 'float7'"),
        (lambda h: h["tensors"][0].update(shape=[4, -6]), CorruptHeaderError, "non-negative"),
        (lambda h: h["tensors"][0].update(offset="0"), CorruptHeaderError, "offset has the wrong type"),
        (lambda h: h["tensors"][0].update(checksum="md5:abc"), CorruptHeaderError, "is not 'crc32:<8 hex>'"),
        (lambda h: h["tensors"][2].update(nbytes=18), DescriptorError,
         r"tensor 'norm.weight': nbytes 18 != 16 implied by bfloat16\[8\]"),
        (lambda h: h["tensors"][2].update(offset=(h["payload_nbytes"] // 4096 + 1) * 4096), DescriptorError,
         "tensor 'norm.weight': bytes .* lie outside the"),
        (lambda h: h["tensors"][2].update(offset=h["tensors"][1]["offset"]), DescriptorError,
         "tensor 'norm.weight': bytes at offset .* overlap 'layers.0.input_layernorm.weight'"),
        (lambda h: h["tensors"][2].update(offset=h["tensors"][2]["offset"] - 2), DescriptorError,
         "not a multiple of 4096"),
        (lambda h: h["tensors"][2].update(name="layers.0.mlp.up_proj.weight"), DescriptorError,
         "appears twice"),
        (lambda h: h["frontend"]["chat_template"].update(nbytes=10**9), DescriptorError,
         "frontend resource 'chat_template': bytes .* lie outside"),
        (lambda h: h.update(alignment=100), CorruptHeaderError, "not a power of two"),
        (lambda h: h.update(payload_nbytes=h["payload_nbytes"] + 1), TruncatedArtifactError, "truncated"),
    ],
)
def test_inconsistent_descriptors(artifact_path: Path, edit: Any, error: type, message: str) -> None:
    rewrite_header(artifact_path, edit)
    with pytest.raises(error, match=message) as e:
        Artifact.open(artifact_path)
    assert str(e.value).startswith(f"{artifact_path}: ")


def test_unsealed_header_is_refused(artifact_path: Path) -> None:
    """A header whose checksums are still the writer's placeholders cannot pass as valid."""
    rewrite_header(artifact_path, lambda h: h["tensors"][0].update(checksum="crc32:xxxxxxxx"))
    with pytest.raises(CorruptHeaderError, match="crc32:xxxxxxxx"):
        Artifact.open(artifact_path)


def test_verify_covers_every_padding_byte(artifact_path: Path) -> None:
    """A flipped byte anywhere no blob covers (after the JSON header, between blobs) fails verify, naming
    its offset; the file as written verifies, and open() alone does not read the padding."""
    with Artifact.open(artifact_path) as a:
        a.verify()
        gaps = [(a.header_end, a.payload_offset)]
        blobs = sorted(
            (a.payload_offset + d.offset, d.nbytes) for d in [*a.frontend_descriptors(), *a.descriptors()]
        )
        gaps += [(start + n, nxt) for (start, n), (nxt, _) in zip(blobs, blobs[1:]) if start + n < nxt]
    assert len(gaps) >= 3
    original = artifact_path.read_bytes()
    for start, end in gaps:
        for offset in (start, (start + end) // 2, end - 1):
            flip_byte(artifact_path, offset)
            with Artifact.open(artifact_path) as a, pytest.raises(CorruptHeaderError) as err:
                a.verify()
            assert f"padding byte at file offset {offset} " in str(err.value)
            artifact_path.write_bytes(original)
    with Artifact.open(artifact_path, verify=True):
        pass
