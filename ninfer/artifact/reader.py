"""`.ninfer` reader: validates the framing on open, maps the file, hands out zero-copy tensor views.

Read-only semantics: the file is mapped copy-on-write (``mmap.ACCESS_COPY``, i.e. ``MAP_PRIVATE``).
`Artifact.tensor` returns views straight over those pages, so nothing is copied until a page is
touched. The views are nominally writable (torch has no read-only tensors), but a write only changes
this process's private copy of that page and never reaches the file; callers treat the views as
read-only and ``clone()`` before mutating. A view keeps the mapping alive on its own: `close()` drops
the artifact's reference and the pages are unmapped once the last view is garbage-collected, so a
view never dangles.
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

import torch

from ninfer.artifact.errors import (
    ArtifactError,
    ChecksumMismatchError,
    CorruptHeaderError,
    MissingTensorError,
    NotAnArtifactError,
    TruncatedArtifactError,
    UnsupportedVersionError,
)
from ninfer.artifact.format import (
    FORMAT_VERSION,
    MAGIC,
    MAX_JSON_BYTES,
    PREFIX,
    PREFIX_SIZE,
    Header,
    ResourceDescriptor,
    TensorDescriptor,
    TensorSpec,
    crc32_chunked,
    header_crc32,
    parse_header,
)


class Artifact:
    """An open `.ninfer` file. Use `Artifact.open`; close it (or use ``with``) when done."""

    def __init__(self, path: str, format_version: int, payload_offset: int, header: Header,
                 mapping: mmap.mmap, header_end: int | None = None) -> None:
        self.path = path
        self.format_version = format_version
        self.payload_offset = payload_offset
        # end of the JSON header: the zero padding that follows it runs to payload_offset
        self.header_end = payload_offset if header_end is None else header_end
        self._header = header
        self._mmap: mmap.mmap | None = mapping
        self._by_name: dict[str, TensorDescriptor] = {t.name: t for t in header.tensors}

    # ---- opening --------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str], *, verify: bool = False) -> Artifact:
        """Check magic, version, header checksum, schema, layout and file length; map the payload.

        With ``verify=True`` every tensor and resource checksum is checked as well (reads every byte).
        """
        path = os.fspath(path)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(PREFIX_SIZE)
            if not prefix or prefix[: len(MAGIC)] != MAGIC[: len(prefix)]:
                raise NotAnArtifactError(path, f"not a .ninfer file (does not start with magic {MAGIC!r})")
            if len(prefix) < PREFIX_SIZE:
                raise TruncatedArtifactError(
                    path, f"truncated: file is {size} bytes, shorter than the {PREFIX_SIZE}-byte fixed header"
                )
            magic, version, stored_crc, json_len, payload_offset = PREFIX.unpack(prefix)
            if version != FORMAT_VERSION:
                raise UnsupportedVersionError(
                    path, f"format version {version} is not supported "
                    f"(this reader reads version {FORMAT_VERSION})"
                )
            if json_len > MAX_JSON_BYTES:
                raise CorruptHeaderError(path, f"JSON header length {json_len} is implausible "
                                         "(corrupt fixed header)")
            json_bytes = f.read(json_len)
            if len(json_bytes) < json_len:
                raise TruncatedArtifactError(
                    path, f"truncated: the JSON header is {json_len} bytes but only {len(json_bytes)} follow "
                    "the fixed header",
                )
            unsigned = PREFIX.pack(magic, version, 0, json_len, payload_offset)
            crc = header_crc32(unsigned, json_bytes)
            if crc != stored_crc:
                raise CorruptHeaderError(
                    path, f"header checksum mismatch (stored crc32 {stored_crc:08x}, computed {crc:08x}): "
                    "the fixed or JSON header is corrupted",
                )
            header = parse_header(path, json_bytes)
            if payload_offset < PREFIX_SIZE + json_len or payload_offset % header.alignment:
                raise CorruptHeaderError(
                    path, f"payload offset {payload_offset} is before the header end or not "
                    f"{header.alignment}-aligned",
                )
            expected = payload_offset + header.payload_nbytes
            if size < expected:
                raise TruncatedArtifactError(
                    path, f"truncated: the header describes {expected} bytes but the file has {size} "
                    f"(payload {max(size - payload_offset, 0)} of {header.payload_nbytes} bytes)",
                )
            if size > expected:
                raise ArtifactError(path, f"{size - expected} unexpected bytes after the payload end "
                                    f"(byte {expected})")
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # keeps its own fd
        artifact = cls(path, version, payload_offset, header, mapping, PREFIX_SIZE + json_len)
        if verify:
            artifact.verify()
        return artifact

    # ---- metadata -------------------------------------------------------------------------------
    @property
    def identity(self) -> dict[str, str]:
        return dict(self._header.identity)

    @property
    def dims(self) -> dict[str, Any]:
        return self._header.dims

    @property
    def provenance(self) -> dict[str, Any]:
        return self._header.provenance

    @property
    def alignment(self) -> int:
        return self._header.alignment

    @property
    def total_tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self._header.tensors)

    @property
    def file_bytes(self) -> int:
        return self.payload_offset + self._header.payload_nbytes

    def tensor_names(self) -> list[str]:
        return [t.name for t in self._header.tensors]

    def tensor_specs(self) -> list[TensorSpec]:
        return [t.spec for t in self._header.tensors]

    def descriptors(self) -> list[TensorDescriptor]:
        """Full descriptors (offset relative to `payload_offset`, nbytes, checksum), in file order."""
        return list(self._header.tensors)

    def descriptor(self, name: str) -> TensorDescriptor:
        try:
            return self._by_name[name]
        except KeyError:
            raise MissingTensorError(self.path, "not in this artifact", tensor=name) from None

    def frontend_names(self) -> list[str]:
        return list(self._header.frontend)

    def frontend_descriptors(self) -> list[ResourceDescriptor]:
        return list(self._header.frontend.values())

    # ---- data -----------------------------------------------------------------------------------
    def tensor(self, name: str) -> torch.Tensor:
        """Zero-copy view of one tensor over the mapped file (see the module docstring for semantics)."""
        desc = self.descriptor(name)
        if desc.nbytes == 0:
            return torch.empty(desc.shape, dtype=desc.dtype)
        flat = torch.frombuffer(
            self._mapping(), dtype=desc.dtype, count=desc.nbytes // desc.dtype.itemsize,
            offset=self.payload_offset + desc.offset,
        )
        return flat.view(desc.shape)

    def frontend_resource(self, name: str) -> bytes | None:
        """The resource's bytes (a copy; resources are small), checksum-checked, or None if absent."""
        desc = self._header.frontend.get(name)
        if desc is None:
            return None
        start = self.payload_offset + desc.offset
        data = self._mapping()[start : start + desc.nbytes]
        got = crc32_chunked(memoryview(data))
        if got != desc.checksum:
            raise ChecksumMismatchError(
                self.path, f"checksum mismatch (stored {desc.checksum}, computed {got})", resource=name
            )
        return data

    def verify(self, progress: bool = False) -> None:
        """Check every byte of the file: every tensor and resource checksum (ChecksumMismatchError naming
        the first bad one) and that the padding after the JSON header and between blobs is zero
        (CorruptHeaderError naming the offset). The fixed and JSON headers were checked on open.

        Blobs are hashed on a few threads (zlib releases the GIL); ``progress`` draws a tqdm bar on stderr.
        """
        self._check_padding()
        from tqdm import tqdm

        mapping = self._mapping()
        blobs: list[tuple[str, str, int, int, str]] = [  # (kind, name, offset, nbytes, checksum)
            ("resource", r.name, r.offset, r.nbytes, r.checksum) for r in self._header.frontend.values()
        ] + [("tensor", t.name, t.offset, t.nbytes, t.checksum) for t in self._header.tensors]
        total = sum(b[3] for b in blobs)
        lock = threading.Lock()
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify",
                  disable=not progress, leave=False) as bar:

            def advance(n: int) -> None:
                with lock:
                    bar.update(n)

            def check(blob: tuple[str, str, int, int, str]) -> str:
                _, _, off, n, _ = blob
                start = self.payload_offset + off
                with memoryview(mapping) as whole, whole[start : start + n] as view:
                    return crc32_chunked(view, advance)

            workers = max(1, min(8, os.cpu_count() or 1, len(blobs)))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                computed = list(pool.map(check, blobs))
        bad = [(blob, got) for blob, got in zip(blobs, computed) if got != blob[4]]
        if bad:
            (kind, name, _, _, stored), got = bad[0]
            others = f"; {len(bad) - 1} more blob(s) also mismatch: " + ", ".join(
                repr(b[1]) for b, _ in bad[1:6]
            ) if len(bad) > 1 else ""
            raise ChecksumMismatchError(
                self.path, f"checksum mismatch (stored {stored}, computed {got}){others}",
                **{kind: name},
            )

    def _check_padding(self) -> None:
        """Every byte no blob covers, from the JSON header's end to the payload's, is zero."""
        mapping = self._mapping()
        spans = sorted(
            (self.payload_offset + b.offset, self.payload_offset + b.offset + b.nbytes, b.name)
            for b in [*self._header.frontend.values(), *self._header.tensors] if b.nbytes
        )
        cursor, after = self.header_end, "the JSON header"
        for start, end, name in [*spans, (self.file_bytes, self.file_bytes, "")]:
            if start > cursor:
                with memoryview(mapping) as whole, whole[cursor:start] as gap:
                    data = gap.tobytes()
                stripped = data.lstrip(b"\0")
                if stripped:
                    at = cursor + len(data) - len(stripped)
                    raise CorruptHeaderError(
                        self.path, f"padding byte at file offset {at} (after {after}) is 0x{stripped[0]:02x} "
                        "(not zero): the file was altered after it was written",
                    )
            cursor, after = max(cursor, end), repr(name)

    # ---- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Drop this artifact's reference to the mapping; views already handed out stay valid."""
        self._mmap = None

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def __enter__(self) -> Artifact:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        ident = self._header.identity
        return (f"Artifact({self.path!r}, package={ident.get('package')!r}, "
                f"storage_profile={ident.get('storage_profile')!r}, tensors={len(self._header.tensors)})")

    def _mapping(self) -> mmap.mmap:
        if self._mmap is None:
            raise ArtifactError(self.path, "artifact is closed")
        return self._mmap
