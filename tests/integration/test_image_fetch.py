"""Fetching image URLs (tokenizer_svc/images.py): only public addresses, at every redirect, within
time and size limits. A real HTTP server on loopback plays the image host; the fetcher is told
it may reach 127.0.0.1 (an operator's allowed network), and nothing else on this machine."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from tokenizer_svc.images import ImageFetcher, ImagePolicy, ImageRequestError, public_address

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        port = self.server.server_address[1]
        routes = {
            "/ok.png": lambda: self._send(IMAGE),
            "/to-metadata": lambda: self._redirect("http://169.254.169.254/latest/meta-data/"),
            "/to-other-loopback": lambda: self._redirect(f"http://127.0.0.2:{port}/ok.png"),
            "/to-ok": lambda: self._redirect("/ok.png"),
            "/loop": lambda: self._redirect("/loop"),
            "/silent": lambda: time.sleep(10),
            "/trickle": self._trickle,
            "/huge": lambda: self._send(b"x" * 5000),
            "/missing": lambda: self.send_error(404),
        }
        routes[self.path]()

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, where: str) -> None:
        self.send_response(302)
        self.send_header("Location", where)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _trickle(self) -> None:
        self.send_response(200)
        self.end_headers()
        try:
            for _ in range(20):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the fetcher gave up on it, as the test expects: nothing to report

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def host() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def fetcher(**policy: object) -> ImageFetcher:
    defaults = {"allowed_networks": ("127.0.0.1/32",), "total_seconds": 1.5, "connect_seconds": 1.0, "max_bytes": 4096}
    return ImageFetcher(ImagePolicy(**{**defaults, **policy}))


def test_an_allowed_host_is_fetched_through_a_redirect(host):
    assert fetcher().fetch(f"{host}/ok.png") == IMAGE
    assert fetcher().fetch(f"{host}/to-ok") == IMAGE


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("/to-metadata", "'169.254.169.254' is 169.254.169.254: images are fetched from public addresses only"),
        ("/to-other-loopback", "is 127.0.0.2: images are fetched from public addresses only"),
        ("/loop", "more than 5 redirects"),
        ("/silent", "timed out"),
        ("/trickle", "took longer than 1.5 s"),
        ("/huge", "larger than 4096 bytes"),
        ("/missing", "answered HTTP 404"),
    ],
)
def test_what_the_fetcher_refuses_it_names(host, path, problem):
    started = time.monotonic()
    with pytest.raises(ImageRequestError, match=problem):
        fetcher().fetch(host + path)
    assert time.monotonic() - started < 3  # a limit, not a hang


@pytest.mark.parametrize(
    "url",
    ["http://localhost/x.png", "http://169.254.169.254/", "http://[::1]/x.png", "http://0.0.0.0/x.png"],
)
def test_without_an_allowed_network_nothing_on_this_machine_or_its_network_is_reached(url):
    with pytest.raises(ImageRequestError, match="public addresses only"):
        fetcher(allowed_networks=()).fetch(url)


@pytest.mark.parametrize("url", ["ftp://example.com/x.png", "file:///etc/passwd", "gopher://example.com/"])
def test_only_http_and_https(url):
    with pytest.raises(ImageRequestError, match="not an http or https URL"):
        fetcher().fetch(url)


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2001:4860:4860::8888", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("100.64.0.1", False),  # shared address space (carrier-grade NAT)
        ("169.254.169.254", False),  # link-local: the cloud metadata service
        ("0.0.0.0", False),
        ("224.0.0.1", False),  # multicast
        ("255.255.255.255", False),
        ("::1", False),
        ("fe80::1", False),
        ("fc00::1", False),  # unique local
        ("::ffff:127.0.0.1", False),  # IPv4-mapped loopback
        ("::ffff:8.8.8.8", True),
        ("ff02::1", False),
        ("not an address", False),
    ],
)
def test_public_addresses(address: str, public: bool):
    assert public_address(address) is public
