"""A request's images, for DeepSeek-V4.1: fetched safely, resolved by deepseek-recipe, placed in the prompt.

deepseek-recipe's `ImageResolver` decodes an image (data URL or bytes), checks its format
(WebP, PNG, JPEG, GIF) and its dimensions, and resizes it to the size the model reads (at most
`max_image_tokens` prompt positions), as WebP bytes. Its own URL fetcher has no timeouts
(a server that accepts and never answers holds it forever), so http(s) URLs are fetched here
(`ImageFetcher`) and handed to the resolver as bytes; the recipe's fetcher, which the resolver
still needs, refuses every address.

The fetcher is the server's exposure to SSRF: a client names a URL and this host connects to
it. It connects only to public addresses (never loopback, link-local such as the cloud metadata
service at 169.254.169.254, private, shared, multicast or reserved ranges), checked on the
address it actually connects to (the host is resolved once and the connection pinned to the
checked address, so DNS rebinding cannot swap it) and again at every redirect; http and https
only; connect and total timeouts; a byte limit read as the body streams. An operator may allow
networks of their own (`image_fetch_allowed_networks`, such as an internal image store).

Every failure is the request's own 400, with a message that names the problem.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

import deepseek_recipe as recipe
import httpx

from common.images import ImageGrid, content_hash, image_token_ids
from common.settings import Settings

MAX_REDIRECTS = 5

# deepseek-recipe's ImageError kinds, as a client should read them
_PROBLEMS = {
    "Decode": "is corrupt or not an image",
    "EmptyImage": "is truncated or empty",
    "UnsupportedMediaType": "is of an unsupported type (WebP, PNG, JPEG and GIF are read)",
    "ImageDimensionsTooLarge": "has too many pixels",
    "InvalidDataUrl": "is not a valid data URL (data:image/...;base64,...)",
    "InvalidUrl": "has a URL that is not http or https",
    "DestinationRejected": "has a URL whose address is not allowed",
}
# kinds whose recipe message says nothing more than _PROBLEMS does
_GENERIC = {"Decode", "EmptyImage", "UnsupportedMediaType", "ImageDimensionsTooLarge", "InvalidDataUrl"}


class ImageRequestError(ValueError):
    """An image the request cannot have: the message is the client's 400."""


@dataclass(frozen=True)
class ImagePolicy:
    """What a request may bring: how many images, and how URLs are fetched."""

    max_images: int = 16
    max_bytes: int = 20 << 20
    connect_seconds: float = 5.0
    total_seconds: float = 20.0
    allowed_networks: tuple[str, ...] = ()

    @classmethod
    def from_settings(cls, settings: Settings) -> ImagePolicy:
        return cls(
            settings.image_max_per_request,
            settings.image_max_bytes,
            settings.image_fetch_connect_seconds,
            settings.image_fetch_seconds,
            tuple(settings.image_fetch_allowed_networks),
        )


@dataclass(frozen=True)
class ResolvedImage:
    """An image as the model reads it: the recipe's WebP bytes, their size, and its span."""

    digest: str  # common.images.content_hash of `data`
    data: bytes
    width: int
    height: int
    num_tokens: int


def public_address(address: str, allowed: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = ()) -> bool:
    """Whether the fetcher may connect to `address`: a global unicast address, or one in `allowed`."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    if any(ip in network for network in allowed):
        return True
    return ip.is_global and not ip.is_multicast


class ImageFetcher:
    """GET of an http(s) image URL, connected only to the addresses `public_address` allows."""

    def __init__(self, policy: ImagePolicy):
        self.policy = policy
        self.allowed = [ipaddress.ip_network(network, strict=False) for network in policy.allowed_networks]
        timeout = httpx.Timeout(policy.total_seconds, connect=policy.connect_seconds)
        # no proxy from the environment: the connection must go to the checked address itself
        self.client = httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False)

    def fetch(self, url: str) -> bytes:
        deadline = time.monotonic() + self.policy.total_seconds
        for _ in range(MAX_REDIRECTS + 1):
            target = httpx.URL(url)
            if target.scheme not in ("http", "https") or not target.host:
                raise ImageRequestError(f"{url!r} is not an http or https URL")
            address = self._checked_address(target.host, target.port or (443 if target.scheme == "https" else 80))
            pinned = target.copy_with(host=address)
            headers = {"Host": target.netloc.decode("ascii"), "Accept": "image/*"}
            try:
                with self.client.stream(
                    "GET", pinned, headers=headers, extensions={"sni_hostname": target.host}
                ) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = str(target.join(response.headers["location"]))
                        continue
                    if response.status_code != 200:
                        raise ImageRequestError(f"fetching {url} answered HTTP {response.status_code}")
                    return self._body(response, url, deadline)
            except httpx.TimeoutException as err:
                raise ImageRequestError(f"fetching {url} timed out ({type(err).__name__})") from err
            except httpx.HTTPError as err:
                raise ImageRequestError(f"fetching {url} failed: {err}") from err
        raise ImageRequestError(f"fetching an image followed more than {MAX_REDIRECTS} redirects")

    def _checked_address(self, host: str, port: int) -> str:
        """The first address of `host` the fetcher may connect to; a refusal names what it found."""
        try:
            found = [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
        except OSError as err:
            raise ImageRequestError(f"the image URL's host {host!r} does not resolve: {err}") from err
        for address in found:
            if public_address(address, self.allowed):
                return address
        raise ImageRequestError(
            f"the image URL's host {host!r} is {found[0]}: images are fetched from public addresses only "
            "(not loopback, link-local, private, multicast or reserved)"
        )

    def _body(self, response: httpx.Response, url: str, deadline: float) -> bytes:
        limit = self.policy.max_bytes
        if int(response.headers.get("content-length") or 0) > limit:
            raise ImageRequestError(f"the image at {url} is larger than {limit} bytes")
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > limit:
                raise ImageRequestError(f"the image at {url} is larger than {limit} bytes")
            if time.monotonic() > deadline:  # a server that trickles bytes
                raise ImageRequestError(f"fetching {url} took longer than {self.policy.total_seconds:g} s")
        return bytes(body)

    def close(self) -> None:
        self.client.close()


class ImageResolver:
    """A request's image sources -> the images the model reads, in placeholder order."""

    def __init__(self, policy: ImagePolicy, patch_size: int, downsample_ratio: int):
        self.policy = policy
        self.patch_size, self.downsample_ratio = patch_size, downsample_ratio
        self.fetcher = ImageFetcher(policy)
        refuse_all = recipe.ReqwestImageFetcher.with_max_bytes(policy.max_bytes).with_destination_filter(
            lambda host, address: False
        )
        self.resolver = recipe.ImageResolver(refuse_all, recipe.OpenCvImagePreprocessor())

    def resolve(self, sources: Sequence[recipe.ImageSource]) -> list[ResolvedImage]:
        if len(sources) > self.policy.max_images:
            raise ImageRequestError(f"{len(sources)} images: at most {self.policy.max_images} a request")
        ready = [
            recipe.BytesImageSource(self.fetcher.fetch(source.url), source.detail, path=source.path)
            if source.kind == "url"
            else source
            for source in sources
        ]
        try:
            resolved = self.resolver.resolve(ready, recipe.ImageQuota())
        except recipe.ImageError as err:
            raise ImageRequestError(_described(err)) from err
        except recipe.CalcResizeError as err:
            raise ImageRequestError(f"an image's size cannot be fitted to the model: {err}") from err
        images = []
        for info in resolved.images:
            grid = ImageGrid.of(info.width, info.height, self.patch_size, self.downsample_ratio)
            images.append(ResolvedImage(content_hash(info.data), info.data, info.width, info.height, grid.num_tokens))
        return images

    def close(self) -> None:
        self.fetcher.close()


def _described(err: recipe.ImageError) -> str:
    """The recipe's error with what it found said plainly: its message for most kinds is a generic
    "unsupported image", after the image's place in the request (`.messages[0].image[0]: ...`)."""
    where, _, detail = str(err).partition(": ")
    problem = _PROBLEMS.get(err.kind)
    if problem is None or not where.startswith((".", "image[")):
        return f"an image cannot be used ({err.kind}): {err}"
    return f"{where.lstrip('.')} {problem}" + (f" ({detail})" if err.kind not in _GENERIC else "")


IMAGE_PARTS = {"image_url", "input_image", "image"}  # Chat Completions, Responses, Messages


def image_parts(body: dict) -> int:
    """How many image parts a request's messages carry (their content lists, a tool result's too),
    counted on the body itself: deepseek-recipe's V4 conversion turns each into the text
    "[Unsupported Image]", which a model without a vision tower must refuse instead."""
    messages = body.get("messages", body.get("input"))
    found, stack = 0, [messages] if isinstance(messages, list) else []
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            found += item.get("type") in IMAGE_PARTS
            stack.extend(item[key] for key in ("content", "output") if isinstance(item.get(key), list))
    return found


@dataclass(frozen=True)
class PlacedImage:
    """An image and the first position of its span in the prompt."""

    start: int
    image: ResolvedImage


def placed(
    token_ids: Sequence[int], placeholder: int, images: Sequence[ResolvedImage]
) -> tuple[list[int], list[PlacedImage]]:
    """The prompt with each placeholder widened into its image's span (common/images.py), and
    where each span starts."""
    positions = [i for i, token in enumerate(token_ids) if token == placeholder]
    if len(positions) != len(images):
        raise ImageRequestError(
            f"the prompt has {len(positions)} image placeholders for {len(images)} images "
            "(a message's text holds one placeholder per image)"
        )
    out, spans, last = [], [], 0
    for position, image in zip(positions, images, strict=True):
        out += token_ids[last:position]
        spans.append(PlacedImage(len(out), image))
        out += image_token_ids(image.digest, image.num_tokens)
        last = position + 1
    return out + list(token_ids[last:]), spans
