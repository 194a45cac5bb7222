"""The `.ninfer` framing: fixed prefix, JSON header schema, payload layout, dtypes and checksums.

Layout of one file (all integers little-endian; docs/artifact.md is the full specification)::

    [0, 32)                     fixed prefix: magic, format version, header crc32, JSON length, payload offset
    [32, 32 + json_len)         UTF-8 JSON header (identity, dims, descriptors, frontend, provenance)
    [.., payload_offset)        zero padding; payload_offset is a multiple of ALIGNMENT
    [payload_offset, EOF)       payload: frontend resources (by name), then tensors (declared order),
                                each starting at a multiple of ALIGNMENT from payload_offset

Every blob is page-aligned so a tensor is a zero-copy view of the mapped file and a GPU upload reads
whole pages. This module is pure data and validation; `writer` and `reader` do the I/O.
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ninfer.artifact.errors import CorruptHeaderError, DescriptorError

MAGIC = b"NINFER\0\0"
FORMAT_VERSION = 1
# magic[8] | format_version u32 | header_crc32 u32 | json_len u64 | payload_offset u64
PREFIX = struct.Struct("<8sIIQQ")
PREFIX_SIZE = PREFIX.size  # 32
ALIGNMENT = 4096  # payload start and every blob offset; one x86/ARM page, a multiple of any dtype size
MAX_JSON_BYTES = 1 << 30  # a sanity cap so a corrupt length cannot ask for a huge allocation

CHECKSUM_ALGORITHM = "crc32"
CHECKSUM_WIDTH = len("crc32:") + 8  # fixed width, so the header can be rewritten in place
_CHECKSUM_RE = re.compile(r"crc32:[0-9a-f]{8}")
# Same width as a real checksum but never valid: a header still carrying it was not finalised.
CHECKSUM_PLACEHOLDER = "crc32:xxxxxxxx"
CHECKSUM_CHUNK = 64 << 20  # bytes hashed per step (progress granularity, lets threads interleave)

# stored dtype name -> torch dtype; names are torch's own (``str(dtype)`` without ``torch.``)
DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "uint16": torch.uint16,
    "int32": torch.int32,
    "uint32": torch.uint32,
    "int64": torch.int64,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

IDENTITY_KEYS = ("family", "package", "storage_profile")


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def crc32_hex(data: bytes | bytearray | memoryview, crc: int = 0) -> str:
    """``crc32:<8 hex>`` of ``data`` (zlib CRC-32, the gzip/PNG polynomial)."""
    return f"{CHECKSUM_ALGORITHM}:{zlib.crc32(data, crc):08x}"


def crc32_chunked(view: memoryview, on_bytes: Any = None) -> str:
    """CRC-32 of a (possibly huge, mmap-backed) buffer in CHECKSUM_CHUNK steps.

    ``on_bytes(n)`` is called after each step (progress bars). zlib releases the GIL on large
    buffers, so several threads can hash different blobs at once.
    """
    crc = 0
    for start in range(0, len(view), CHECKSUM_CHUNK):
        chunk = view[start : start + CHECKSUM_CHUNK]
        crc = zlib.crc32(chunk, crc)
        if on_bytes is not None:
            on_bytes(len(chunk))
    return f"{CHECKSUM_ALGORITHM}:{crc:08x}"


def media_type_for(name: str) -> str:
    """Media type recorded for a frontend resource, from its name."""
    if name.endswith(".json"):
        return "application/json"
    if name == "chat_template" or name.endswith(".jinja"):
        return "text/x-jinja2; charset=utf-8"
    if name.endswith(".txt"):
        return "text/plain; charset=utf-8"
    return "application/octet-stream"


@dataclass(frozen=True)
class TensorSpec:
    """What the writer is told to expect: one tensor's name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape)  # accept lists / torch.Size, store a plain tuple
        if any(s < 0 for s in shape):
            raise ValueError(f"tensor {self.name!r}: negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class TensorDescriptor:
    """One entry of the header's ``tensors`` list; ``offset`` is relative to the payload start."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: str

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": DTYPE_NAMES[self.dtype],
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
        }


@dataclass(frozen=True)
class ResourceDescriptor:
    """One entry of the header's ``frontend`` object (bytes stored verbatim in the payload)."""

    name: str
    offset: int
    nbytes: int
    checksum: str
    media_type: str

    def to_json(self) -> dict[str, Any]:
        return {"offset": self.offset, "nbytes": self.nbytes, "checksum": self.checksum,
                "media_type": self.media_type}


@dataclass(frozen=True)
class Header:
    """The parsed, validated JSON header plus the prefix fields it is framed by."""

    identity: dict[str, str]
    dims: dict[str, Any]
    tensors: tuple[TensorDescriptor, ...]
    frontend: dict[str, ResourceDescriptor]
    provenance: dict[str, Any]
    alignment: int
    payload_nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "identity": self.identity,
            "dims": self.dims,
            "alignment": self.alignment,
            "payload_nbytes": self.payload_nbytes,
            "tensors": [t.to_json() for t in self.tensors],
            "frontend": {name: r.to_json() for name, r in self.frontend.items()},
            "provenance": self.provenance,
        }


def encode_header_json(header: Header) -> bytes:
    """Canonical JSON bytes: sorted keys, no whitespace, ASCII only, so equal inputs give equal bytes."""
    return json.dumps(
        header.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def header_crc32(prefix_without_crc: bytes, json_bytes: bytes) -> int:
    """CRC-32 over the 32-byte prefix with its crc field zeroed, then the JSON bytes."""
    return zlib.crc32(json_bytes, zlib.crc32(prefix_without_crc))


def pack_prefix(json_bytes: bytes, payload_offset: int) -> bytes:
    unsigned = PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(json_bytes), payload_offset)
    crc = header_crc32(unsigned, json_bytes)
    return PREFIX.pack(MAGIC, FORMAT_VERSION, crc, len(json_bytes), payload_offset)


def layout(
    tensors: list[TensorSpec], resources: dict[str, int]
) -> tuple[dict[str, int], list[int], int]:
    """Payload offsets: resources in name order, then tensors in declared order, each aligned.

    Returns (resource offsets by name, tensor offsets in order, payload length). The payload ends at
    the last blob's end (no trailing padding).
    """
    cursor = 0
    res_offsets: dict[str, int] = {}
    for name in sorted(resources):
        res_offsets[name] = align_up(cursor)
        cursor = res_offsets[name] + resources[name]
    tensor_offsets: list[int] = []
    for spec in tensors:
        off = align_up(cursor)
        tensor_offsets.append(off)
        cursor = off + spec.nbytes
    return res_offsets, tensor_offsets, cursor


# ---- reading: schema and layout validation ----------------------------------------------------


def parse_header(path: str, json_bytes: bytes) -> Header:
    """Decode and validate the JSON header; raises CorruptHeaderError / DescriptorError naming ``path``."""
    try:
        raw = json.loads(json_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptHeaderError(path, f"JSON header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CorruptHeaderError(path, "JSON header is not an object")

    def need(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
        if key not in obj:
            raise CorruptHeaderError(path, f"JSON header: {where} has no {key!r}")
        value = obj[key]
        # bool is an int subclass; never accept it where a count or offset is meant
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise CorruptHeaderError(path, f"JSON header: {where}.{key} has the wrong type")
        return value

    identity = need(raw, "identity", dict, "header")
    for key in IDENTITY_KEYS:
        need(identity, key, str, "identity")
    dims = need(raw, "dims", dict, "header")
    provenance = need(raw, "provenance", dict, "header")
    alignment = need(raw, "alignment", int, "header")
    if alignment < 64 or alignment & (alignment - 1):
        raise CorruptHeaderError(path, f"JSON header: alignment {alignment} is not a power of two >= 64")
    payload_nbytes = need(raw, "payload_nbytes", int, "header")
    if payload_nbytes < 0:
        raise CorruptHeaderError(path, f"JSON header: negative payload_nbytes {payload_nbytes}")

    tensors: list[TensorDescriptor] = []
    seen: set[str] = set()
    for i, t in enumerate(need(raw, "tensors", list, "header")):
        if not isinstance(t, dict):
            raise CorruptHeaderError(path, f"JSON header: tensors[{i}] is not an object")
        name = need(t, "name", str, f"tensors[{i}]")
        where = f"tensor {name!r}"
        dtype_name = need(t, "dtype", str, where)
        if dtype_name not in DTYPES:
            raise CorruptHeaderError(path, f"unknown dtype {dtype_name!r}", tensor=name)
        shape = need(t, "shape", list, where)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise CorruptHeaderError(path, f"shape {shape} is not a list of non-negative integers",
                                     tensor=name)
        desc = TensorDescriptor(
            name=name,
            dtype=DTYPES[dtype_name],
            shape=tuple(shape),
            offset=need(t, "offset", int, where),
            nbytes=need(t, "nbytes", int, where),
            checksum=need(t, "checksum", str, where),
        )
        if name in seen:
            raise DescriptorError(path, "appears twice in the tensor list", tensor=name)
        seen.add(name)
        if not _CHECKSUM_RE.fullmatch(desc.checksum):
            raise CorruptHeaderError(path, f"checksum {desc.checksum!r} is not 'crc32:<8 hex>'", tensor=name)
        if desc.nbytes != desc.spec.nbytes:
            raise DescriptorError(
                path, f"nbytes {desc.nbytes} != {desc.spec.nbytes} implied by {dtype_name}{list(shape)}",
                tensor=name,
            )
        tensors.append(desc)

    frontend: dict[str, ResourceDescriptor] = {}
    for name, r in need(raw, "frontend", dict, "header").items():
        if not isinstance(r, dict):
            raise CorruptHeaderError(path, "descriptor is not an object", resource=name)
        where = f"frontend[{name!r}]"
        desc_r = ResourceDescriptor(
            name=name,
            offset=need(r, "offset", int, where),
            nbytes=need(r, "nbytes", int, where),
            checksum=need(r, "checksum", str, where),
            media_type=need(r, "media_type", str, where),
        )
        if not _CHECKSUM_RE.fullmatch(desc_r.checksum):
            raise CorruptHeaderError(path, f"checksum {desc_r.checksum!r} is not 'crc32:<8 hex>'",
                                     resource=name)
        frontend[name] = desc_r

    header = Header(
        identity=identity, dims=dims, tensors=tuple(tensors), frontend=frontend, provenance=provenance,
        alignment=alignment, payload_nbytes=payload_nbytes,
    )
    check_layout(path, header)
    return header


def check_layout(path: str, header: Header) -> None:
    """Every blob aligned, inside the payload, and disjoint from every other blob."""
    blobs: list[tuple[int, int, dict[str, str]]] = []  # (offset, nbytes, error kwargs)
    for r in header.frontend.values():
        blobs.append((r.offset, r.nbytes, {"resource": r.name}))
    for t in header.tensors:
        blobs.append((t.offset, t.nbytes, {"tensor": t.name}))
    for off, n, who in blobs:
        if off < 0 or n < 0:
            raise DescriptorError(path, f"negative offset {off} or nbytes {n}", **who)
        if "tensor" in who and off % header.alignment:
            raise DescriptorError(path, f"offset {off} is not a multiple of {header.alignment}", **who)
        if off + n > header.payload_nbytes:
            raise DescriptorError(
                path, f"bytes [{off}, {off + n}) lie outside the {header.payload_nbytes}-byte payload", **who
            )
    nonempty = sorted((b for b in blobs if b[1] > 0), key=lambda b: b[0])
    for (off_a, n_a, who_a), (off_b, _, who_b) in zip(nonempty, nonempty[1:]):
        if off_b < off_a + n_a:
            other = who_a.get("tensor") or who_a.get("resource")
            raise DescriptorError(path, f"bytes at offset {off_b} overlap {other!r} [{off_a}, {off_a + n_a})",
                                  **who_b)
