"""Free-list pools of physical indices: KV pages and StateImage slots.

Pure bookkeeping over integer ids; the tensors they index live in the Program's `StateStore`. A pool
never hands out an id twice and refuses to take back one it did not hand out, so accounting bugs
surface at once instead of as silently shared state.

`RefPool` adds reference counts: a KV page of a published checkpoint is shared by the checkpoint and by
every sequence materialized from it, and returns to the free list when its last holder lets go.
"""

from __future__ import annotations

from collections.abc import Iterable


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

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        for i in ids:
            if i not in self._used:
                raise PoolError(f"{self.name} pool: id {i} freed but not allocated")
            self._used.remove(i)
        # keep the stack sorted so the next allocation is again the lowest ids
        self._free.extend(ids)
        self._free.sort(reverse=True)


class RefPool(IndexPool):
    """An `IndexPool` whose ids carry reference counts: `allocate` hands ids out with one reference,
    `retain` adds one to ids already held, `release` drops one and frees an id at zero."""

    def __init__(self, size: int, name: str) -> None:
        super().__init__(size, name)
        self._refs: dict[int, int] = {}

    def allocate(self, n: int) -> list[int]:
        ids = super().allocate(n)
        for i in ids:
            self._refs[i] = 1
        return ids

    def retain(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        for i in ids:
            if i not in self._refs:
                raise PoolError(f"{self.name} pool: id {i} retained but not held")
        for i in ids:
            self._refs[i] += 1

    def release(self, ids: Iterable[int]) -> list[int]:
        """Drop one reference from each id; returns the ids that became free."""
        ids = list(ids)
        counts: dict[int, int] = {}
        for i in ids:
            counts[i] = counts.get(i, 0) + 1
            if counts[i] > self._refs.get(i, 0):
                raise PoolError(f"{self.name} pool: id {i} released more often than held")
        freed = []
        for i, n in counts.items():
            self._refs[i] -= n
            if self._refs[i] == 0:
                del self._refs[i]
                freed.append(i)
        if freed:
            super().free(freed)
        return freed

    def free(self, ids: Iterable[int]) -> None:
        """`release` of ids each held once (the plain pool's call); raises if one is shared."""
        ids = list(ids)
        shared = [i for i in ids if self._refs.get(i, 0) > 1]
        if shared:
            raise PoolError(f"{self.name} pool: ids {shared} freed while shared")
        self.release(ids)

    def refcount(self, i: int) -> int:
        return self._refs.get(i, 0)
