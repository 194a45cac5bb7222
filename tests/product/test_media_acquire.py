"""Media acquisition refusals and successes: data: URLs, local paths under a media root, and remote
fetches against a loopback test server (refused addresses, redirects to them, limits, slow servers).

No test sends traffic beyond loopback: refused addresses are refused before connecting, and the tests
that name non-loopback addresses replace ``socket.socket.connect`` with a tripwire that fails the test.
No assertion reads the clock: slow servers are asserted on the refusal only.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image
from vision_oracle import encode, noise, png

from ninfer.media import MediaError
from ninfer.product.media_acquire import MediaAcquisitionError, MediaPolicy, acquire_image, refusal_reason

PNG = png(20, 10, seed=1)
JPEG = encode(Image.fromarray(noise(20, 10, seed=2)), "JPEG")


def refused(
    kind: str, reference: str, policy: MediaPolicy, match: str | None = None
) -> MediaAcquisitionError:
    with pytest.raises(MediaAcquisitionError, match=match) as e:
        acquire_image(reference, policy)
    assert e.value.kind == kind, (e.value.kind, str(e.value))
    assert isinstance(e.value, MediaError) and isinstance(e.value, ValueError)
    return e.value


def data_url(data: bytes, label: str = "image/png") -> str:
    return f"data:{label};base64," + base64.b64encode(data).decode()


# ---- data: URLs --------------------------------------------------------------------------------------


def test_data_url_is_accepted_by_default_and_sniffed() -> None:
    got = acquire_image(data_url(PNG), MediaPolicy())
    assert (got.data, got.format, got.media_type, got.source) == (PNG, "PNG", "image/png", "data")


def test_mislabeled_data_url_is_read_by_its_content() -> None:
    got = acquire_image(data_url(JPEG, "image/png"), MediaPolicy())
    assert got.format == "JPEG" and got.media_type == "image/jpeg"
    refused(
        "not_an_image", data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>"), MediaPolicy(), "starts with"
    )


def test_data_url_refusals() -> None:
    policy = MediaPolicy(max_bytes=1000)
    refused("too_large", data_url(bytes(5000)), policy, "over the limit of 1,000 bytes")
    refused("bad_data_url", "data:image/png;base64,@@@@", policy, "not valid base64")
    refused("bad_data_url", "data:image/png;base64", policy, "no ','")
    refused("empty", "data:image/png;base64,", policy)
    # not base64: percent-encoded bytes
    got = acquire_image("data:image/gif," + "".join(f"%{b:02x}" for b in PNG), MediaPolicy())
    assert got.data == PNG


# ---- local paths ---------------------------------------------------------------------------------------


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "a.png").write_bytes(PNG)
    (root / "sub" / "b.jpg").write_bytes(JPEG)
    (tmp_path / "secret.png").write_bytes(PNG)
    return root


def test_local_paths_inside_the_root(media_root: Path) -> None:
    policy = MediaPolicy(media_root=media_root)
    assert acquire_image("a.png", policy).data == PNG
    assert acquire_image("sub/b.jpg", policy).format == "JPEG"
    assert acquire_image(str(media_root / "sub" / "b.jpg"), policy).source == "file"
    (media_root / "inner_link.png").symlink_to(media_root / "a.png")  # a symlink that stays inside is fine
    assert acquire_image("inner_link.png", policy).data == PNG


def test_local_paths_are_refused_without_a_root(media_root: Path) -> None:
    refused("local_paths_disabled", str(media_root / "a.png"), MediaPolicy(), "no media root")


def test_traversal_is_refused(media_root: Path) -> None:
    policy = MediaPolicy(media_root=media_root)
    refused("path_traversal", "../secret.png", policy, "contains '..'")
    refused("path_traversal", "sub/../../secret.png", policy)
    refused("path_traversal", "sub/../a.png", policy)  # even when it would land inside
    refused("outside_media_root", str(media_root.parent / "secret.png"), policy)
    refused("outside_media_root", "/etc/hostname", policy)


def test_symlink_escape_is_refused(media_root: Path) -> None:
    policy = MediaPolicy(media_root=media_root)
    (media_root / "escape.png").symlink_to(media_root.parent / "secret.png")
    refused("outside_media_root", "escape.png", policy, "leads outside the media root")
    (media_root / "dir_link").symlink_to(media_root.parent)
    refused("outside_media_root", "dir_link/secret.png", policy)


def test_file_urls_and_other_schemes_are_refused(media_root: Path) -> None:
    policy = MediaPolicy(media_root=media_root, allow_remote=True)
    refused("file_url_refused", f"file://{media_root / 'a.png'}", policy, "relative to the media root")
    refused("file_url_refused", "FILE:///etc/passwd", policy)
    refused("bad_scheme", "ftp://example.com/a.png", policy)
    refused("bad_scheme", "gopher://127.0.0.1/x", policy)


def test_special_files_and_sizes(media_root: Path) -> None:
    policy = MediaPolicy(media_root=media_root, max_bytes=len(PNG))
    refused("not_a_file", "sub", policy, "not a regular file")
    os.mkfifo(media_root / "fifo.png")  # must not block the gateway
    refused("not_a_file", "fifo.png", policy)
    (media_root / "big.png").write_bytes(PNG + b"x")
    refused("too_large", "big.png", policy, f"over the limit of {len(PNG):,} bytes")
    (media_root / "empty.png").write_bytes(b"")
    refused("empty", "empty.png", policy)
    refused("not_found", "missing.png", policy)
    (media_root / "text.png").write_bytes(b"hello")
    refused("not_an_image", "text.png", policy, "not a supported image")
    refused("media_root_missing", "a.png", MediaPolicy(media_root=media_root / "nope"))


# ---- remote fetches ------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    routes: dict[str, object] = {}
    seen_hosts: list[str] = []

    def log_message(self, *args: object) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        _Handler.seen_hosts.append(self.headers.get("Host", ""))
        route = _Handler.routes.get(self.path.split("?")[0])
        try:
            if route is None:
                self.send_error(404)
            elif callable(route):
                route(self)
            else:
                self._send(200, route)  # type: ignore[arg-type]
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on purpose

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {"Content-Length": str(len(body))}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)


def _redirect(location: str):  # type: ignore[no-untyped-def]
    def route(h: _Handler) -> None:
        h._send(302, b"", {"Location": location, "Content-Length": "0"})

    return route


def _slow_headers(h: _Handler) -> None:
    time.sleep(3.0)  # longer than any test timeout; the client has gone by then
    h._send(200, PNG)


def _trickle(h: _Handler) -> None:
    h.send_response(200)
    h.end_headers()
    h.wfile.write(PNG[:8])
    for _ in range(100):  # one byte every 50 ms: each read is quick, the whole is not
        h.wfile.write(b"x")
        h.wfile.flush()
        time.sleep(0.05)


def _lying_length(h: _Handler) -> None:
    h._send(200, PNG, {"Content-Length": str(10**9)})


def _unbounded(h: _Handler) -> None:
    h.send_response(200)
    h.send_header("Connection", "close")
    h.end_headers()
    h.wfile.write(PNG)
    for _ in range(64):
        h.wfile.write(bytes(1024))


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    _Handler.routes = {
        "/a.png": PNG,
        "/a.jpg": JPEG,
        "/text": b"<html>hello</html>",
        "/redirect": _redirect("/a.png"),
        "/redirect-abs": _redirect(f"{base}/a.png"),
        "/loop": _redirect("/loop"),
        "/to-loopback-v6": _redirect(f"http://[::1]:{httpd.server_address[1]}/a.png"),
        "/to-other-loopback": _redirect(f"http://127.0.0.2:{httpd.server_address[1]}/a.png"),
        "/to-metadata": _redirect("http://169.254.169.254/latest/meta-data/"),
        "/to-file": _redirect("file:///etc/passwd"),
        "/slow": _slow_headers,
        "/trickle": _trickle,
        "/lying-length": _lying_length,
        "/unbounded": _unbounded,
    }
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield base
    httpd.shutdown()
    httpd.server_close()


LOOPBACK = ("127.0.0.1/32",)


def test_remote_is_refused_unless_allowed(server: str) -> None:
    refused("remote_disabled", f"{server}/a.png", MediaPolicy(), "remote media is turned off")


def test_loopback_is_refused_unless_allowed(server: str) -> None:
    err = refused("address_refused", f"{server}/a.png", MediaPolicy(allow_remote=True))
    assert "127.0.0.1, a loopback address" in str(err)
    got = acquire_image(f"{server}/a.png", MediaPolicy(allow_remote=True, allowed_networks=LOOPBACK))
    assert (got.data, got.source) == (PNG, "remote")


def test_content_type_is_ignored_and_content_sniffed(server: str) -> None:
    policy = MediaPolicy(allow_remote=True, allowed_networks=LOOPBACK)
    assert acquire_image(f"{server}/a.jpg", policy).format == "JPEG"
    refused("not_an_image", f"{server}/text", policy, "remote content is not a supported image")
    refused("http_status", f"{server}/missing", policy, "HTTP 404")


def test_redirects_are_followed_and_each_hop_checked(server: str) -> None:
    policy = MediaPolicy(allow_remote=True, allowed_networks=LOOPBACK)
    assert acquire_image(f"{server}/redirect", policy).data == PNG
    assert acquire_image(f"{server}/redirect-abs", policy).data == PNG
    refused("too_many_redirects", f"{server}/loop", policy, "more than 3 times")
    refused(
        "too_many_redirects",
        f"{server}/redirect",
        MediaPolicy(allow_remote=True, allowed_networks=LOOPBACK, max_redirects=0),
    )
    refused("address_refused", f"{server}/to-loopback-v6", policy, "::1, a loopback address")
    refused("address_refused", f"{server}/to-other-loopback", policy, "127.0.0.2, a loopback address")
    refused("address_refused", f"{server}/to-metadata", policy, "169.254.169.254, a link-local address")
    refused("bad_scheme", f"{server}/to-file", policy, "not 'file'")


def test_size_limits(server: str) -> None:
    policy = MediaPolicy(allow_remote=True, allowed_networks=LOOPBACK, max_bytes=4096)
    refused("too_large", f"{server}/lying-length", policy, "Content-Length")
    refused("too_large", f"{server}/unbounded", policy, "stopped reading")


def test_slow_servers_are_cut_off(server: str) -> None:
    policy = MediaPolicy(allow_remote=True, allowed_networks=LOOPBACK, timeout_s=0.3)
    refused("timeout", f"{server}/slow", policy, "time limit")
    refused(
        "timeout",
        f"{server}/trickle",
        MediaPolicy(allow_remote=True, allowed_networks=LOOPBACK, timeout_s=1.0),
    )


def test_server_stays_healthy_after_refusals(server: str) -> None:
    policy = MediaPolicy(allow_remote=True, allowed_networks=LOOPBACK)
    for path in ("/lying-length", "/loop", "/text", "/to-metadata"):
        with pytest.raises(MediaAcquisitionError):
            acquire_image(
                f"{server}{path}", MediaPolicy(allow_remote=True, allowed_networks=LOOPBACK, max_bytes=100)
            )
    assert acquire_image(f"{server}/a.png", policy).data == PNG


def test_url_shapes_are_refused(server: str) -> None:
    policy = MediaPolicy(allow_remote=True, allowed_networks=LOOPBACK)
    port = server.rsplit(":", 1)[1]
    refused("credentials_in_url", f"http://user:pw@127.0.0.1:{port}/a.png", policy)
    refused("bad_url", "http:///a.png", policy, "no host")
    refused("bad_url", f"http://127.0.0.1:{port}/a b.png", policy, "whitespace")
    refused("bad_url", "http://127.0.0.1:99999/a.png", policy, "malformed")


@pytest.fixture
def no_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tripwire: these tests name non-loopback addresses, which must be refused before any connect."""

    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"connect attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", tripwire)


@pytest.mark.parametrize(
    "host, reason",
    [
        ("10.1.2.3", "private"),
        ("192.168.0.1", "private"),
        ("172.16.5.4", "private"),
        ("169.254.169.254", "link-local"),
        ("[fe80::1]", "link-local"),
        ("[fd00::1]", "private"),
        ("224.0.0.1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("[::]", "unspecified"),
        ("100.64.0.1", "not globally routable"),  # shared address space (CGNAT)
        ("[::ffff:127.0.0.1]", "loopback"),  # IPv4-mapped
        ("240.0.0.1", "reserved"),
    ],
)
def test_refused_address_categories(host: str, reason: str, no_connect: None) -> None:
    err = refused("address_refused", f"http://{host}/a.png", MediaPolicy(allow_remote=True))
    assert f"a {reason} address" in str(err)


def test_every_resolved_address_must_pass(monkeypatch: pytest.MonkeyPatch, no_connect: None) -> None:
    answers = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 80)) for a in ("93.184.216.34", "10.0.0.7")]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: answers)
    refused(
        "address_refused", "http://mixed.test/a.png", MediaPolicy(allow_remote=True), "10.0.0.7, a private"
    )


def test_connects_to_the_checked_address_not_a_new_lookup(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DNS rebinding: the name resolves to an allowed address once, then to a refused one. The fetch
    uses the first answer for the connection and sends the name as Host."""
    port = int(server.rsplit(":", 1)[1])
    calls: list[str] = []

    def resolver(host: str, *args: object, **kwargs: object) -> list[tuple[object, ...]]:
        calls.append(host)
        address = "127.0.0.1" if len(calls) == 1 else "10.9.9.9"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    connected: list[object] = []
    real_connect = socket.socket.connect

    def connect(sock: socket.socket, address: tuple[str, int]) -> None:
        connected.append(address)
        if address[0] != "127.0.0.1":
            raise AssertionError(f"connect to {address}")  # never leave loopback, even when the code is wrong
        real_connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    monkeypatch.setattr(socket.socket, "connect", connect)
    _Handler.seen_hosts.clear()
    got = acquire_image(
        f"http://images.test:{port}/a.png", MediaPolicy(allow_remote=True, allowed_networks=LOOPBACK)
    )
    assert got.data == PNG
    assert calls == ["images.test"] and connected == [("127.0.0.1", port)]
    assert _Handler.seen_hosts == [f"images.test:{port}"]


def test_refusal_reason_accepts_public_addresses() -> None:
    for public in ("93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946", "8.8.8.8"):
        assert refusal_reason(ipaddress.ip_address(public)) is None


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="not a network"):
        MediaPolicy(allowed_networks=("localhost",))
    with pytest.raises(ValueError, match="timeout_s"):
        MediaPolicy(timeout_s=0)
    with pytest.raises(ValueError, match="max_bytes"):
        MediaPolicy(max_bytes=0)
