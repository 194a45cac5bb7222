"""``http(s)`` fetches that cannot be turned against the gateway's own network.

Per hop (the first URL and every redirect):
- only ``http``/``https``, no credentials in the URL;
- the host is resolved once and **every** address it resolves to must be public (``is_global`` and not
  multicast), unless it lies in ``MediaPolicy.allowed_networks``; loopback, private, link-local,
  shared (CGNAT), multicast, unspecified and reserved addresses are refused, naming the category;
- the connection goes to the address that was checked (the Host header and TLS SNI/certificate check
  use the name), so a DNS answer that changes between check and connect (rebinding) is never used;
- ``Accept-Encoding: identity`` (no compressed body to inflate), status 200 only, a declared
  ``Content-Length`` over the limit is refused before reading, and reading stops one byte past it;
- each socket operation times out after ``timeout_s`` and the whole fetch, redirects included, has the
  same deadline, so a server that trickles bytes is cut off too.
The response's Content-Type is ignored: the caller sniffs the content.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass

from ninfer.product.media_acquire.policy import MediaAcquisitionError, MediaPolicy

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 64 << 10


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str  # as written in the URL (name or literal), for Host / SNI
    port: int
    path: str  # path + query, never empty


def fetch_remote(url: str, policy: MediaPolicy) -> bytes:
    """The body of ``url`` under ``policy``; raises MediaAcquisitionError naming the cause."""
    if not policy.allow_remote:
        raise MediaAcquisitionError(
            "remote_disabled", "remote image URLs are not accepted here (remote media is turned off)"
        )
    deadline = time.monotonic() + policy.timeout_s
    current = url
    for hop in range(policy.max_redirects + 1):
        target = _parse(current)
        address = _checked_address(target, policy)
        status, location, body = _get(target, address, policy, deadline)
        if status in _REDIRECTS:
            if not location:
                raise MediaAcquisitionError(
                    "bad_redirect", f"the server answered {status} without a Location"
                )
            if hop == policy.max_redirects:
                raise MediaAcquisitionError(
                    "too_many_redirects", f"the image URL redirected more than {policy.max_redirects} times"
                )
            current = urllib.parse.urljoin(current, location)
            continue
        if status != 200:
            raise MediaAcquisitionError("http_status", f"the image server answered HTTP {status}")
        if not body:
            raise MediaAcquisitionError("empty", "the image server sent an empty body")
        return body
    raise AssertionError("unreachable")  # the loop returns or raises


def _parse(url: str) -> _Target:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise MediaAcquisitionError("bad_url", f"the image URL is malformed: {e}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise MediaAcquisitionError("bad_scheme", f"redirects and fetches go to http(s) only, not {scheme!r}")
    if parts.username is not None or parts.password is not None:
        raise MediaAcquisitionError("credentials_in_url", "image URLs with user:password@ are not accepted")
    host = parts.hostname
    if not host:
        raise MediaAcquisitionError("bad_url", "the image URL has no host")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    if any(c in path for c in "\r\n ") or any(c in host for c in "\r\n "):
        raise MediaAcquisitionError("bad_url", "the image URL contains whitespace or line breaks")
    return _Target(scheme, host, port or (443 if scheme == "https" else 80), path)


def refusal_reason(address: IPAddress) -> str | None:
    """Why ``address`` is not a public unicast address (None when it is one)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return refusal_reason(address.ipv4_mapped)
    checks = (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
        ("not globally routable", not address.is_global),
    )
    return next((name for name, hit in checks if hit), None)


def _checked_address(target: _Target, policy: MediaPolicy) -> IPAddress:
    try:
        literal: IPAddress | None = ipaddress.ip_address(target.host)
    except ValueError:
        literal = None
    if literal is not None:
        addresses = [literal]
    else:
        try:
            infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise MediaAcquisitionError(
                "dns", f"cannot resolve the image host {target.host!r}: {e}"
            ) from None
        addresses = []
        for info in infos:
            ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
            if ip not in addresses:
                addresses.append(ip)
        if not addresses:
            raise MediaAcquisitionError("dns", f"the image host {target.host!r} has no address")
    for ip in addresses:  # every answer must pass, or a later connect could reach a refused one
        reason = refusal_reason(ip)
        if reason is not None and not policy.address_allowed(ip):
            raise MediaAcquisitionError(
                "address_refused",
                f"the image host {target.host!r} resolves to {ip}, a {reason} address, which is refused",
            )
    return addresses[0]


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise MediaAcquisitionError("timeout", "fetching the image took longer than the time limit")
    return left


def _connect(address: IPAddress, port: int, timeout: float | None) -> socket.socket:
    """A TCP connection to exactly this address (``socket.create_connection`` would resolve again)."""
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect((str(address), port))
    except BaseException:
        sock.close()
        raise
    return sock


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to the checked address; the Host header still names ``host``. ``pinned_sock`` stays
    reachable after http.client hands the socket to the response (to shorten its timeout per read)."""

    pinned_sock: socket.socket | None = None

    def __init__(self, host: str, port: int, address: IPAddress, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = self.pinned_sock = _connect(self._address, self.port, self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """TLS to the checked address, with SNI and certificate verification for ``host``."""

    pinned_sock: socket.socket | None = None

    def __init__(self, host: str, port: int, address: IPAddress, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        sock = _connect(self._address, self.port, self.timeout)
        self.sock = self.pinned_sock = self._context.wrap_socket(  # type: ignore[attr-defined]
            sock, server_hostname=self.host
        )


def _get(
    target: _Target, address: IPAddress, policy: MediaPolicy, deadline: float
) -> tuple[int, str | None, bytes]:
    timeout = min(policy.timeout_s, _remaining(deadline))
    cls = _PinnedHTTPSConnection if target.scheme == "https" else _PinnedHTTPConnection
    conn = cls(target.host, target.port, address, timeout)
    try:
        conn.request(
            "GET",
            target.path,
            headers={
                "User-Agent": policy.user_agent,
                "Accept": "image/*",
                "Accept-Encoding": "identity",
                "Connection": "close",
            },
        )
        response = conn.getresponse()
        status = response.status
        if status in _REDIRECTS:
            return status, response.getheader("Location"), b""
        if status != 200:
            return status, None, b""
        length = response.getheader("Content-Length")
        if length is not None and length.strip().isdigit() and int(length) > policy.max_bytes:
            raise MediaAcquisitionError(
                "too_large",
                f"the image is {int(length):,} bytes (Content-Length), "
                f"over the limit of {policy.max_bytes:,} bytes",
            )
        return status, None, _read_body(response, conn, policy, deadline)
    except MediaAcquisitionError:
        raise
    except TimeoutError:
        raise MediaAcquisitionError(
            "timeout", "the image server did not answer within the time limit"
        ) from None
    except ssl.SSLError as e:
        raise MediaAcquisitionError("tls", f"TLS with the image host failed: {e.reason or e}") from None
    except (OSError, http.client.HTTPException) as e:
        raise MediaAcquisitionError("fetch_failed", f"fetching the image failed: {e}") from None
    finally:
        conn.close()


def _read_body(
    response: http.client.HTTPResponse,
    conn: _PinnedHTTPConnection | _PinnedHTTPSConnection,
    policy: MediaPolicy,
    deadline: float,
) -> bytes:
    chunks, total = [], 0
    while True:
        if conn.pinned_sock is not None:  # each read may wait no longer than what is left of the deadline
            conn.pinned_sock.settimeout(min(policy.timeout_s, _remaining(deadline)))
        chunk = response.read1(_CHUNK)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > policy.max_bytes:
            raise MediaAcquisitionError(
                "too_large", f"the image is over the limit of {policy.max_bytes:,} bytes (stopped reading)"
            )
        chunks.append(chunk)
        _remaining(deadline)
