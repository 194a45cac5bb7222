"""`HostTier`: the host-memory copies of offloaded checkpoints (the bytes; `ResourceBook` owns the ids).

Allocated once when the Program is built, like the device pools: ``slots`` state slots (every GDN layer's
conv window and fp32 recurrent state) and ``pages`` KV pages (every attention layer's K and V, and the
decode backend's layers when it has its own KV), in pinned memory on CUDA (so the copies are
asynchronous and ordered on the Program's stream with the units around them) and plain tensors on CPU.

The layout is slot-major and page-major (one host slot or page is one contiguous block holding every
layer), so each copy between the tiers is one contiguous host block per slot or page and tensor: a
device page is strided across its layers, which PyTorch gathers on the device before the transfer. The
host memory is never read on the host: every read and write is a copy queued on the device's current
stream, so a restore that reads an offload's host pages runs after it, and a unit that writes device ids
an offload read runs after the offload.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.targets.qwen3_6.impl.runtime.resources import Transfer
from ninfer.targets.qwen3_6.model import StateStore


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
            for device_kv, (host_k, host_v) in zip(self._device_kv, self.kv):
                for src, dst in transfer.pages:
                    if transfer.to_host:
                        host_k[dst].copy_(device_kv.k_pages[:, src], non_blocking=nb)
                        host_v[dst].copy_(device_kv.v_pages[:, src], non_blocking=nb)
                    else:
                        device_kv.k_pages[:, dst].copy_(host_k[src], non_blocking=nb)
                        device_kv.v_pages[:, dst].copy_(host_v[src], non_blocking=nb)
