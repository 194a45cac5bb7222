"""`HostTier`'s copies between the device pools and host memory (`impl/runtime/host_tier.py`): an offload
then a restore of scattered device pages through host pages in several runs gives back every layer's K
and V bits and the state slot, for the target's pools and a backend's own KV, and touches no other page,
whether the move buffer holds one page, a part of the checkpoint or all of it."""

from __future__ import annotations

import pytest
import torch

from ninfer.targets.qwen3_6.impl.runtime import host_tier
from ninfer.targets.qwen3_6.impl.runtime.host_tier import HostTier, _host_runs
from ninfer.targets.qwen3_6.impl.runtime.resources import Transfer
from ninfer.targets.qwen3_6.model import StateStore


def _store(seed: int, layers: int = 3, pages: int = 12) -> StateStore:
    gen = torch.Generator().manual_seed(seed)
    return StateStore(
        conv=torch.randn(2, 4, 6, 3, generator=gen),
        rec=torch.randn(2, 4, 2, 3, 3, generator=gen),
        k_pages=torch.randn(layers, pages, 4, 2, 5, generator=gen),
        v_pages=torch.randn(layers, pages, 4, 2, 5, generator=gen),
    )


def test_host_runs() -> None:
    assert _host_runs([4, 5, 6, 9, 2, 3]) == [(0, 3, 4), (3, 4, 9), (4, 6, 2)]
    assert _host_runs([7]) == [(0, 1, 7)]


@pytest.mark.parametrize("buffer_pages", [1, 3, 100], ids=["page-by-page", "in-parts", "whole"])
def test_offload_then_restore_returns_every_page_and_the_slot(
    monkeypatch: pytest.MonkeyPatch, buffer_pages: int
) -> None:
    store, backend = _store(0), _store(1, layers=1)
    page_bytes = store.k_pages[:, 0].numel() * store.k_pages.element_size()
    monkeypatch.setattr(host_tier, "MOVE_BUFFER_BYTES", buffer_pages * page_bytes)
    tier = HostTier(store, backend, slots=3, pages=10, device=torch.device("cpu"))
    before = [t.clone() for t in (store.conv, store.rec, store.k_pages, store.v_pages, backend.k_pages)]
    device_pages = [7, 2, 9, 3]  # scattered, out of order
    host_pages = [4, 5, 0, 1]  # two runs
    tier.run([Transfer(to_host=True, state=(1, 2), pages=tuple(zip(device_pages, host_pages)))])
    for layer in range(3):
        for device_id, host_id in zip(device_pages, host_pages):
            assert torch.equal(tier.kv[0][0][host_id, layer], store.k_pages[layer, device_id])
            assert torch.equal(tier.kv[0][1][host_id, layer], store.v_pages[layer, device_id])
    assert torch.equal(tier.kv[1][0][5, 0], backend.k_pages[0, 2])
    # restore into other device pages and slot; every other device page stays as it was
    targets = [0, 11, 5, 6]
    tier.run([Transfer(to_host=False, state=(2, 3), pages=tuple(zip(host_pages, targets)))])
    for source, target in zip(device_pages, targets):
        assert torch.equal(store.k_pages[:, target], before[2][:, source])
        assert torch.equal(store.v_pages[:, target], before[3][:, source])
        assert torch.equal(backend.k_pages[:, target], before[4][:, source])
    untouched = [p for p in range(12) if p not in targets]
    assert torch.equal(store.k_pages[:, untouched], before[2][:, untouched])
    assert torch.equal(store.conv[:, 3], before[0][:, 1]) and torch.equal(store.rec[:, 3], before[1][:, 1])
