"""Streaming `.ninfer` writer: one tensor in memory at a time, bytes deterministic for equal inputs.

Offsets follow from the declared specs, so the header is written first with fixed-width checksum
placeholders, tensors stream after it, and `close()` rewrites the header in place (same length) with
the real checksums. Everything goes to ``path + ".partial"``; only a complete, finalised file is
renamed onto ``path``, so an interrupted conversion never leaves a file that looks valid.
"""

from __future__ import annotations

import json
import os
from types import TracebackType
from typing import Any

import torch

from ninfer.artifact.errors import ArtifactWriteError
from ninfer.artifact.format import (
    ALIGNMENT,
    CHECKSUM_PLACEHOLDER,
    DTYPE_NAMES,
    IDENTITY_KEYS,
    PREFIX_SIZE,
    Header,
    ResourceDescriptor,
    TensorDescriptor,
    TensorSpec,
    align_up,
    crc32_chunked,
    crc32_hex,
    encode_header_json,
    layout,
    media_type_for,
    pack_prefix,
)

_ZEROS = bytes(ALIGNMENT)


class ArtifactWriter:
    """Write one `.ninfer` file: declare everything up front, then `write_tensor` in declared order.

    ``frontend`` values are the resources' bytes (a ``str`` is stored as UTF-8). ``identity`` needs
    ``family``, ``package`` and ``storage_profile``; ``dims`` and ``provenance`` are stored verbatim as
    JSON (keep absolute paths and timestamps out of ``provenance`` so output stays deterministic).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        identity: dict[str, str],
        dims: dict[str, Any],
        tensors: list[TensorSpec],
        frontend: dict[str, bytes],
        provenance: dict[str, Any],
    ) -> None:
        self.path = os.fspath(path)
        self.partial_path = self.path + ".partial"
        self._specs = list(tensors)
        self._validate(identity, dims, frontend, provenance)

        blobs = {name: (data.encode("utf-8") if isinstance(data, str) else bytes(data))
                 for name, data in frontend.items()}
        sizes = {n: len(b) for n, b in blobs.items()}
        res_offsets, tensor_offsets, payload_nbytes = layout(self._specs, sizes)
        self._resources = {
            name: ResourceDescriptor(name, res_offsets[name], len(blobs[name]), crc32_hex(blobs[name]),
                                     media_type_for(name))
            for name in sorted(blobs)
        }
        self._offsets = tensor_offsets
        self._checksums: list[str] = []
        self._header_fields: dict[str, Any] = {
            "identity": dict(identity),
            "dims": dims,
            "provenance": provenance,
            "alignment": ALIGNMENT,
            "payload_nbytes": payload_nbytes,
        }
        json_bytes = self._header_json()
        self._json_len = len(json_bytes)
        self._payload_offset = align_up(PREFIX_SIZE + self._json_len)

        self._state = "open"  # -> "closed" (file renamed onto path) or "aborted" (partial removed)
        self._file = open(self.partial_path, "wb")  # noqa: SIM115 (held open across write_tensor calls)
        self._cursor = 0  # bytes of payload written so far
        try:
            self._file.write(pack_prefix(json_bytes, self._payload_offset))
            self._file.write(json_bytes)
            self._file.write(bytes(self._payload_offset - PREFIX_SIZE - self._json_len))
            for name in sorted(blobs):
                self._pad_to(self._resources[name].offset)
                self._file.write(blobs[name])
                self._cursor += len(blobs[name])
        except BaseException:
            self.abort()
            raise

    # ---- public ---------------------------------------------------------------------------------
    @property
    def expected_next(self) -> str | None:
        """Name of the tensor `write_tensor` expects next (None once all are written)."""
        i = len(self._checksums)
        return self._specs[i].name if i < len(self._specs) else None

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next declared tensor; refuses a wrong name, order, dtype or shape."""
        self._require_open()
        i = len(self._checksums)
        if i == len(self._specs):
            raise self._error(f"all {len(self._specs)} declared tensors are already written", tensor=name)
        spec = self._specs[i]
        if name != spec.name:
            declared = [s.name for s in self._specs]
            if name not in declared:
                why = "is not a declared tensor"
            elif declared.index(name) < i:
                why = "was already written"
            else:
                why = "is out of order"
            raise self._error(f"{why}; expected {spec.name!r} next (tensor {i} of {len(self._specs)})",
                              tensor=name)
        if tensor.dtype != spec.dtype:
            raise self._error(f"dtype {tensor.dtype} != declared {spec.dtype}", tensor=name)
        if tuple(tensor.shape) != spec.shape:
            raise self._error(f"shape {tuple(tensor.shape)} != declared {spec.shape}", tensor=name)

        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        data = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
        try:
            self._pad_to(self._offsets[i])
            self._file.write(data)
            self._cursor += len(data)
        except BaseException:
            self.abort()
            raise
        self._checksums.append(crc32_chunked(data))

    def close(self) -> None:
        """Finalise: refuse if a declared tensor is missing, write real checksums, fsync, rename."""
        if self._state == "closed":
            return
        if self._state == "aborted":
            raise self._error("writer was aborted; no file was written")
        missing = [s.name for s in self._specs[len(self._checksums):]]
        if missing:
            self.abort()
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise self._error(
                f"closed with {len(missing)} of {len(self._specs)} declared tensors unwritten "
                f"({missing[0]!r}{more}); no file was written"
            )
        try:
            json_bytes = self._header_json()
            assert len(json_bytes) == self._json_len, "checksums must not change the header length"
            self._file.seek(0)
            self._file.write(pack_prefix(json_bytes, self._payload_offset))
            self._file.write(json_bytes)
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.partial_path, self.path)
            self._state = "closed"
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop the partial file; the writer cannot be used afterwards. No-op after a successful close."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._file.close()
        if os.path.exists(self.partial_path):
            os.remove(self.partial_path)

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()

    # ---- internals ------------------------------------------------------------------------------
    def _header_json(self) -> bytes:
        descriptors = tuple(
            TensorDescriptor(
                spec.name, spec.dtype, spec.shape, off, spec.nbytes,
                self._checksums[i] if i < len(self._checksums) else CHECKSUM_PLACEHOLDER,
            )
            for i, (spec, off) in enumerate(zip(self._specs, self._offsets))
        )
        f = self._header_fields
        return encode_header_json(Header(
            identity=f["identity"], dims=f["dims"], tensors=descriptors, frontend=self._resources,
            provenance=f["provenance"], alignment=f["alignment"], payload_nbytes=f["payload_nbytes"],
        ))

    def _pad_to(self, offset: int) -> None:
        gap = offset - self._cursor
        assert 0 <= gap < ALIGNMENT, (offset, self._cursor)
        self._file.write(_ZEROS[:gap])
        self._cursor = offset

    def _require_open(self) -> None:
        if self._state != "open":
            raise self._error(f"writer is {self._state}")

    def _error(self, detail: str, *, tensor: str | None = None) -> ArtifactWriteError:
        return ArtifactWriteError(self.path, detail, tensor=tensor)

    def _validate(
        self,
        identity: dict[str, str],
        dims: dict[str, Any],
        frontend: dict[str, bytes],
        provenance: dict[str, Any],
    ) -> None:
        for key in IDENTITY_KEYS:
            if not isinstance(identity.get(key), str) or not identity[key]:
                raise self._error(f"identity needs a non-empty string {key!r}; got {identity!r}")
        names: set[str] = set()
        for spec in self._specs:
            if not isinstance(spec, TensorSpec):
                raise self._error(f"tensors must be TensorSpec, got {type(spec).__name__}")
            if spec.name in names:
                raise self._error("declared twice", tensor=spec.name)
            if spec.dtype not in DTYPE_NAMES:
                known = ", ".join(DTYPE_NAMES.values())
                raise self._error(f"dtype {spec.dtype} is not storable (known: {known})", tensor=spec.name)
            names.add(spec.name)
        for name, data in frontend.items():
            if not isinstance(name, str) or not name:
                raise self._error(f"frontend resource names must be non-empty strings, got {name!r}")
            if not isinstance(data, bytes | bytearray | memoryview | str):
                raise self._error(f"frontend resource {name!r} must be bytes, got {type(data).__name__}")
        for what, value in (("dims", dims), ("provenance", provenance)):
            if not isinstance(value, dict):
                raise self._error(f"{what} must be a dict")
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise self._error(f"{what} is not JSON-serialisable: {e}") from None
