"""Bind check: an artifact loads only as the registered package its identity names, with exact dims.

The artifact layer reads the identity and dims a file declares; which package they bind to is the
targets' decision (the closed registry), made here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ninfer.artifact.errors import ArtifactError
from ninfer.targets.package import STORAGE_PROFILES
from ninfer.targets.registry import PackageMismatch, check_dims, get_package

if TYPE_CHECKING:
    from ninfer.artifact.reader import Artifact
    from ninfer.targets.package import Package


class IdentityMismatchError(ArtifactError, PackageMismatch):
    """The artifact's identity or dims do not name a registered package exactly.

    Also a `PackageMismatch`, so callers that handle registry mismatches catch it too.
    """


def check_identity(artifact: Artifact, package: Package | str | None = None) -> Package:
    """Return the registered package ``artifact`` binds to, or raise IdentityMismatchError.

    Dims that are the package's less its vision tower and/or MTP layer bind ``Package.without`` those
    features (`check_dims`). Refuses an unknown package name, a family other than the package's, an
    unknown storage profile, dims that differ from the package's in any other field, and (when
    ``package`` is given) an artifact that names a different package than the one the caller wants.
    """
    path = artifact.path
    ident = artifact.identity
    try:
        pkg = get_package(ident["package"])
    except PackageMismatch as e:
        raise IdentityMismatchError(path, f"identity names {e}") from None
    if package is not None:
        wanted = package if isinstance(package, str) else package.name
        if pkg.name != wanted:
            raise IdentityMismatchError(
                path, f"artifact is package {pkg.name!r}, not the requested {wanted!r}"
            )
    if ident["family"] != pkg.family:
        raise IdentityMismatchError(
            path, f"identity family {ident['family']!r} != package {pkg.name!r} family {pkg.family!r}"
        )
    if ident["storage_profile"] not in STORAGE_PROFILES:
        raise IdentityMismatchError(
            path,
            f"unknown storage profile {ident['storage_profile']!r} (known: {', '.join(STORAGE_PROFILES)})",
        )
    try:  # an artifact without vision or MTP weights binds the package with those features off
        return check_dims(pkg, artifact.dims, source=path)
    except PackageMismatch as e:  # the registry prefixes the source; ArtifactError adds the path itself
        raise IdentityMismatchError(path, str(e).removeprefix(f"{path}: ")) from None
