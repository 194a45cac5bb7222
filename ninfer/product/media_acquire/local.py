"""Local files, only inside the policy's media root: no ``..``, no symlink leading out, regular files only.

How a path is checked:
1. a path with a ``..`` component is refused outright (even one that would land inside the root);
2. a relative path is taken relative to the root; the candidate is resolved (every symlink followed)
   and must lie inside the resolved root, so a symlink inside the root that points outside is refused,
   while one that stays inside is followed;
3. the resolved path is opened with ``O_NOFOLLOW`` (the last component cannot be swapped for a symlink
   after the check) and ``O_NONBLOCK`` (a FIFO cannot hang the gateway); the open file must be a regular
   file, and on Linux its real path (``/proc/self/fd``) is checked against the root once more, which
   closes the window between the check and the open for the directories above it too;
4. the size is checked before reading, and reading stops one byte past the limit (a file that grows).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePath

from ninfer.product.media_acquire.policy import MediaAcquisitionError, MediaPolicy

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | os.O_CLOEXEC


def read_local_file(path: str, policy: MediaPolicy) -> bytes:
    """The bytes of ``path`` under ``policy.media_root``; raises MediaAcquisitionError naming the cause."""
    if policy.media_root is None:
        raise MediaAcquisitionError(
            "local_paths_disabled", "local image paths are not accepted here (no media root is configured)"
        )
    if not path or "\x00" in path:
        raise MediaAcquisitionError("bad_path", "the image path is empty or holds a NUL character")
    if ".." in PurePath(path).parts:
        raise MediaAcquisitionError("path_traversal", f"the image path {path!r} contains '..'")
    try:
        root = Path(policy.media_root).resolve(strict=True)
    except OSError as e:
        raise MediaAcquisitionError(
            "media_root_missing", f"the media root does not exist: {e.strerror}"
        ) from None
    candidate = Path(path) if os.path.isabs(path) else root / path
    try:
        resolved = candidate.resolve(strict=True)
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop on older Pythons
        raise MediaAcquisitionError("not_found", f"no image file at {path!r} under the media root") from None
    if not resolved.is_relative_to(root):
        raise MediaAcquisitionError(
            "outside_media_root", f"the image path {path!r} leads outside the media root (through a symlink?)"
        )
    try:
        fd = os.open(resolved, _OPEN_FLAGS)
    except OSError as e:
        raise MediaAcquisitionError("unreadable", f"cannot open the image {path!r}: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaAcquisitionError("not_a_file", f"the image path {path!r} is not a regular file")
        _check_fd_inside(fd, root, path)
        if info.st_size > policy.max_bytes:
            raise MediaAcquisitionError(
                "too_large",
                f"the image file {path!r} is {info.st_size:,} bytes, "
                f"over the limit of {policy.max_bytes:,} bytes",
            )
        data = _read_at_most(fd, policy.max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > policy.max_bytes:
        raise MediaAcquisitionError(
            "too_large", f"the image file {path!r} is over the limit of {policy.max_bytes:,} bytes"
        )
    if not data:
        raise MediaAcquisitionError("empty", f"the image file {path!r} is empty")
    return data


def _check_fd_inside(fd: int, root: Path, path: str) -> None:
    proc = f"/proc/self/fd/{fd}"
    if not os.path.exists(proc):  # not Linux: the resolve check above is the guard
        return
    if not Path(os.readlink(proc)).is_relative_to(root):
        raise MediaAcquisitionError(
            "outside_media_root", f"the image path {path!r} leads outside the media root"
        )


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, total = [], 0
    while total < limit:
        chunk = os.read(fd, min(1 << 20, limit - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)
