"""`HostTier`: the host-memory copies of offloaded checkpoints (the bytes; `ResourceBook` owns the ids).

Allocated once when the Program is built, like the device pools: ``slots`` state slots (every GDN layer's
conv window and fp32 recurrent state) and ``pages`` KV pages (every attention layer's K and V, and the
decode backend's layers when it has its own KV), in pinned memory on CUDA (so the copies are
asynchronous and ordered on the Program's stream with the units around them) and plain tensors on CPU.

The layout is slot-major and page-major (one host slot or page is one contiguous block holding every
layer). A device page is strided across its layers, so a checkpoint's pages move as one gather (offload)
or one scatter (restore) on the device per K or V tensor, through a page-major device buffer of at most
`MOVE_BUFFER_BYTES` (a long checkpoint moves in parts), and one copy between the tiers per run of
consecutive host page ids (the host pool hands out its lowest free ids in order, so a checkpoint's pages
are mostly one run), instead of a gather and a copy per page. The host memory is never read on the host:
every read and write is a copy queued on the device's current stream, so a restore that reads an
offload's host pages runs after it, and a unit that writes device ids an offload read runs after the
offload.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.targets.qwen3_6.impl.runtime.resources import Transfer
from ninfer.targets.qwen3_6.model import StateStore

# the device buffer one gather or scatter of pages goes through (a checkpoint moves in parts of this size:
# offloads happen when device memory is short)
MOVE_BUFFER_BYTES = 64 * 2**20


class HostTier:
    """Host copies of checkpoint state slots and KV pages (module docstring)."""

    def __init__(
        self, store: StateStore, backend_kv: StateStore | None, slots: int, pages: int, device: torch.device
    ) -> None:
        pin = device.type == "cuda"

        def like(t: torch.Tensor, count: int) -> torch.Tensor:
            # [layers, ids, ...] on the device -> [ids, layers, ...] on the host
            shape = (count, t.shape[0], *t.shape[2:])
            return torch.zeros(shape, dtype=t.dtype, device="cpu", pin_memory=pin)

        self.conv = like(store.conv, slots)
        self.rec = like(store.rec, slots)
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = [
            (like(kv.k_pages, pages), like(kv.v_pages, pages))
            for kv in ((store, backend_kv) if backend_kv is not None else (store,))
        ]
        self._device_kv = [store] if backend_kv is None else [store, backend_kv]
        self._store = store
        self.non_blocking = pin
        page = max(t.numel() // t.shape[0] * t.element_size() for pair in self.kv for t in pair)
        self._pages_per_move = max(1, MOVE_BUFFER_BYTES // page)  # pages a gather or scatter buffer holds

    @property
    def nbytes(self) -> int:
        tensors = [self.conv, self.rec, *(t for pair in self.kv for t in pair)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def run(self, transfers: Sequence[Transfer]) -> None:
        """Queue ``transfers`` in order (offloads before a restore, `Copies`)."""
        nb = self.non_blocking
        store = self._store
        for transfer in transfers:
            src, dst = transfer.state
            if transfer.to_host:
                self.conv[dst].copy_(store.conv[:, src], non_blocking=nb)
                self.rec[dst].copy_(store.rec[:, src], non_blocking=nb)
            else:
                store.conv[:, dst].copy_(self.conv[src], non_blocking=nb)
                store.rec[:, dst].copy_(self.rec[src], non_blocking=nb)
            pairs = transfer.pages if transfer.to_host else tuple((d, s) for s, d in transfer.pages)
            for begin in range(0, len(pairs), self._pages_per_move):  # (device id, host id) pairs
                part = pairs[begin : begin + self._pages_per_move]
                index = self._device_index([device for device, _ in part])
                host_ids = [host for _, host in part]
                for device_kv, (host_k, host_v) in zip(self._device_kv, self.kv):
                    for pages, host in ((device_kv.k_pages, host_k), (device_kv.v_pages, host_v)):
                        if transfer.to_host:
                            _offload(pages, host, index, host_ids, nb)
                        else:
                            _restore(host, pages, index, host_ids, nb)

    def _device_index(self, ids: list[int]) -> torch.Tensor:
        """The device page ids as an index on the device, staged through pinned memory on CUDA (a copy
        from pageable memory would wait for the queue)."""
        index = torch.tensor(ids, dtype=torch.long)
        device = self._store.k_pages.device
        if device.type == "cuda":
            return index.pin_memory().to(device, non_blocking=True)
        return index


def _host_runs(host_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first position, end position, first host id) of each run of consecutive host ids."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(host_ids) + 1):
        if i == len(host_ids) or host_ids[i] != host_ids[i - 1] + 1:
            runs.append((start, i, host_ids[start]))
            start = i
    return runs


def _offload(
    pages: torch.Tensor, host: torch.Tensor, index: torch.Tensor, host_ids: list[int], nb: bool
) -> None:
    """Device pages ``index`` of ``pages`` [layers, P, ...] -> host pages ``host_ids`` of ``host`` [H, layers,
    ...]: one gather on the device into the host's page-major layout, then one copy per run of host ids."""
    gathered = pages.index_select(1, index).transpose(0, 1).contiguous()  # [n, layers, ...]
    for begin, end, first in _host_runs(host_ids):
        host[first : first + end - begin].copy_(gathered[begin:end], non_blocking=nb)


def _restore(
    host: torch.Tensor, pages: torch.Tensor, index: torch.Tensor, host_ids: list[int], nb: bool
) -> None:
    """Host pages ``host_ids`` -> device pages ``index``: one copy per run of host ids into a page-major
    device buffer, then one scatter into the layer-major pool."""
    staged = torch.empty((len(host_ids), *host.shape[1:]), dtype=host.dtype, device=pages.device)
    for begin, end, first in _host_runs(host_ids):
        staged[begin:end].copy_(host[first : first + end - begin], non_blocking=nb)
    pages.index_copy_(1, index, staged.transpose(0, 1))
