"""The `.ninfer` artifact: one self-describing file per converted model (docs/artifact.md).

`ArtifactWriter` streams a file tensor by tensor; `Artifact.open` validates and memory-maps one and
hands out zero-copy tensor views. Which registered package an artifact binds to is the targets'
question (`ninfer.targets.identity.check_identity`): this layer knows no package.
"""

from ninfer.artifact.errors import (
    ArtifactError,
    ArtifactWriteError,
    ChecksumMismatchError,
    CorruptHeaderError,
    DescriptorError,
    MissingTensorError,
    NotAnArtifactError,
    TruncatedArtifactError,
    UnsupportedVersionError,
)
from ninfer.artifact.format import (
    ALIGNMENT,
    DTYPES,
    FORMAT_VERSION,
    MAGIC,
    ResourceDescriptor,
    TensorDescriptor,
    TensorSpec,
)
from ninfer.artifact.reader import Artifact
from ninfer.artifact.writer import ArtifactWriter

__all__ = [
    "ALIGNMENT",
    "DTYPES",
    "FORMAT_VERSION",
    "MAGIC",
    "Artifact",
    "ArtifactError",
    "ArtifactWriteError",
    "ArtifactWriter",
    "ChecksumMismatchError",
    "CorruptHeaderError",
    "DescriptorError",
    "MissingTensorError",
    "NotAnArtifactError",
    "ResourceDescriptor",
    "TensorDescriptor",
    "TensorSpec",
    "TruncatedArtifactError",
    "UnsupportedVersionError",
]
