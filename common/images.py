"""How an image sits in a prompt's token ids: the one place that says so.

deepseek-recipe encodes each image of a V4.1 conversation as one placeholder token; the image
really occupies a span of `h * (w + 1) + 2` positions (engine/model/vision.py says why). The
tokenizer widens each placeholder into its span and fills it with ids that name the image's
content: `IMAGE_ID_BASE` and up, 31 bits of the image's SHA-256 at each position, the digest's
eight 32-bit words in turn. Such ids are never looked up in a vocabulary (the engine reads the
encoder's rows there instead), and every key of a prefix (common/prefixes.py: the cache's hash
chain, the resident keys, the routers') is taken over them like any other id. So two prompts
that differ only in an image differ in their keys from the image on and never share state past
it, and a repeated image with the same prompt hits, with no second notion of a prefix's key.
SGLang's radix cache does the same with its "pad values".
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

IMAGE_ID_BASE = 1 << 31  # above any vocabulary; ids stay uint32, as prefix keys encode them


def content_hash(data: bytes) -> str:
    """The name of an image's content: hex SHA-256 of its bytes as the encoder reads them."""
    return hashlib.sha256(data).hexdigest()


def image_token_ids(digest: str, length: int) -> list[int]:
    """The ids of an image's span of `length` positions."""
    raw = bytes.fromhex(digest)
    words = [int.from_bytes(raw[i : i + 4], "little") & (IMAGE_ID_BASE - 1) for i in range(0, len(raw), 4)]
    return [IMAGE_ID_BASE | words[i % len(words)] for i in range(length)]


def image_key(namespace: str, digest: str) -> str:
    """The cache key of an image's encoder rows: its content, in a namespace (common.prefixes.
    namespace_of: the encoder's weights and the tenant, so that one tenant's images never answer
    another's, and rows of one encoder never another's)."""
    return "image-" + hashlib.sha256(f"{namespace}\0{digest}".encode()).hexdigest()


@dataclass(frozen=True)
class ImageGrid:
    """Where an image of `width` x `height` pixels sits: its grid of ViT patches and, after the
    downsampling, its grid of prompt rows (each row of IMAGE positions ends with a NEWLINE)."""

    patches_w: int
    patches_h: int
    rows_w: int
    rows_h: int

    @classmethod
    def of(cls, width: int, height: int, patch_size: int, downsample_ratio: int) -> ImageGrid:
        patches_w, patches_h = math.ceil(width / patch_size), math.ceil(height / patch_size)
        return cls(
            patches_w, patches_h, math.ceil(patches_w / downsample_ratio), math.ceil(patches_h / downsample_ratio)
        )

    @property
    def num_tokens(self) -> int:
        """The image's positions in the prompt: START, each row of IMAGE positions and a NEWLINE, END."""
        return self.rows_h * (self.rows_w + 1) + 2
