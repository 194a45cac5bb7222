"""Free-list pools of physical indices: KV pages and StateImage slots.

Pure bookkeeping over integer ids; the tensors they index live in the Program's `StateStore`. A pool
never hands out an id twice and refuses to take back one it did not hand out, so accounting bugs
surface at once instead of as silently shared state.
"""

from __future__ import annotations


class PoolError(RuntimeError):
    """An id was freed twice or never allocated: the caller's accounting is broken."""


class IndexPool:
    """Fixed set of ids ``0..size-1``; allocation takes the lowest free ids (deterministic layouts)."""

    def __init__(self, size: int, name: str) -> None:
        if size < 0:
            raise ValueError(f"{name} pool size must be >= 0, got {size}")
        self.name = name
        self.size = size
        self._free: list[int] = list(range(size - 1, -1, -1))  # stack: pop() yields the lowest id
        self._used: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolError(f"{self.name} pool: {n} requested, {len(self._free)} free of {self.size}")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise PoolError(f"{self.name} pool: id {i} freed but not allocated")
            self._used.remove(i)
        # keep the stack sorted so the next allocation is again the lowest ids
        self._free.extend(ids)
        self._free.sort(reverse=True)
