"""What a gateway may fetch: the acquisition policy and the error every refusal raises."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from ninfer.media.errors import MediaError

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_MAX_BYTES = 20 << 20  # 20 MiB: a large JPEG/PNG photo; data: URLs are bounded by it too
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_REDIRECTS = 3


class MediaAcquisitionError(MediaError):
    """A media reference was refused or could not be fetched; ``kind`` names the cause."""


@dataclass(frozen=True)
class MediaPolicy:
    """Where media may come from. The defaults accept only ``data:`` URLs.

    ``media_root``: local paths are accepted only inside this directory (relative paths are taken
    relative to it); None refuses every local path. ``allow_remote``: fetch ``http(s)`` URLs.
    ``allowed_networks``: addresses in these networks are fetched even though they are loopback,
    private, link-local, ... (which are refused otherwise), e.g. ``("10.1.2.0/24",)`` for an intranet
    image host, or ``("127.0.0.1/32",)`` in tests. ``max_bytes`` bounds every body (data, file or
    remote); ``timeout_s`` bounds each connect and read and, as a whole, each remote fetch including
    its redirects; ``max_redirects`` bounds the redirect hops (0: none followed).
    """

    media_root: Path | str | None = None
    allow_remote: bool = False
    allowed_networks: tuple[str, ...] = ()
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_redirects: int = DEFAULT_MAX_REDIRECTS
    user_agent: str = "ninfer-media/1"
    _networks: tuple[IPNetwork, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"MediaPolicy.max_bytes must be at least 1, got {self.max_bytes}")
        if not self.timeout_s > 0:
            raise ValueError(f"MediaPolicy.timeout_s must be positive, got {self.timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"MediaPolicy.max_redirects must be >= 0, got {self.max_redirects}")
        networks = []
        for net in self.allowed_networks:
            try:
                networks.append(ipaddress.ip_network(net, strict=False))
            except ValueError as e:
                raise ValueError(f"MediaPolicy.allowed_networks: {net!r} is not a network: {e}") from None
        object.__setattr__(self, "_networks", tuple(networks))
        if self.media_root is not None:
            object.__setattr__(self, "media_root", Path(self.media_root))

    def address_allowed(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return any(address in net for net in self._networks)
