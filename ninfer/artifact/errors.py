"""Errors raised while writing, reading or binding a `.ninfer` file.

Every message starts with the file path and, where one is involved, the tensor or frontend resource,
so a bad artifact is reported at load time in one line instead of as a crash deep in the model.
"""

from __future__ import annotations

import os


class ArtifactError(Exception):
    """Base class: ``str(e)`` is ``"<path>: [tensor 'name': ]<detail>"``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        detail: str,
        *,
        tensor: str | None = None,
        resource: str | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.detail = detail
        self.tensor = tensor
        self.resource = resource
        where = f"{self.path}: "
        if tensor is not None:
            where += f"tensor {tensor!r}: "
        elif resource is not None:
            where += f"frontend resource {resource!r}: "
        super().__init__(where + detail)


class NotAnArtifactError(ArtifactError):
    """The file does not start with the `.ninfer` magic."""


class UnsupportedVersionError(ArtifactError):
    """The file is a `.ninfer` of a format version this reader does not implement."""


class TruncatedArtifactError(ArtifactError):
    """The file ends before the fixed header, the JSON header or the payload the header describes."""


class CorruptHeaderError(ArtifactError):
    """The JSON header fails its checksum, is not valid JSON, or does not follow the schema."""


class DescriptorError(ArtifactError):
    """A tensor or resource descriptor is inconsistent: misaligned, out of bounds, overlapping,
    or its byte length disagrees with its dtype and shape."""


class ChecksumMismatchError(ArtifactError):
    """The bytes of a tensor or resource do not match the checksum stored in the header."""


class MissingTensorError(ArtifactError, KeyError):
    """A tensor (or resource) that the caller asked for is not in the file."""

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return Exception.__str__(self)


class ArtifactWriteError(ArtifactError):
    """The writer was used against its declaration (order, name, dtype, shape, missing tensors)."""
