"""Images' encoder rows in the KV cache, by content: what the image encoder stores and prefill and
decode read back (common/images.py says how an image sits in a prompt).

The rows of an image are a function of its bytes and the vision tower's weights, so they are
kept under the image's content hash in a namespace of the checkpoint's weights and the tenant
(`image_layout`, common.images.image_key): an image seen before is not encoded again, for as
long as the request's retention class keeps it, like a prefix. The bytes are a safetensors
file of one tensor, [positions, hidden], in the encoder's dtype. As with prefixes, a cache that
fails is a miss (or rows not stored), never an error here: the caller decides what a miss costs.
Every call does I/O: workers make them on their fetch threads.
"""

from __future__ import annotations

import logging

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from common.images import image_key
from common.prefixes import namespace_of
from common.retention import Retention
from engine.prefix_store import PrefixStore

log = logging.getLogger(__name__)


def image_layout(weights: str) -> str:
    """The namespace layout of a checkpoint's image rows (`weights`: engine.checkpoint.weights_id)."""
    return f"vision-{weights}"


class ImageRows:
    def __init__(self, store: PrefixStore, weights: str, retention: Retention | None = None):
        self.store = store
        self.layout = image_layout(weights)
        self.retention = retention or Retention()

    def key(self, tenant: str, digest: str) -> str:
        return image_key(namespace_of(self.layout, tenant), digest)

    def load(self, tenant: str, retention_class: str, digest: str, num_tokens: int) -> torch.Tensor | None:
        """An image's rows [num_tokens, hidden], kept another retention period; None if they are
        not stored (or not usable: such an entry is dropped)."""
        key = self.key(tenant, digest)
        try:
            blobs, _ = self.store.load(key, self.retention.ttl(tenant, retention_class))
        except Exception:
            log.exception("loading image rows %s failed", key)
            return None
        if blobs is None:
            return None
        try:
            rows = load_tensors(blobs.head)["rows"]
        except (SafetensorError, KeyError) as err:
            log.warning("image rows %s unusable, dropped: %s", key, err)
            self.store.delete(key)
            return None
        if rows.dim() != 2 or rows.shape[0] != num_tokens:
            log.warning("image rows %s are %s, not %d positions: dropped", key, tuple(rows.shape), num_tokens)
            self.store.delete(key)
            return None
        return rows

    def renew(self, tenant: str, retention_class: str, digest: str) -> bool:
        """Whether an image's rows are stored, kept another retention period if they are."""
        try:
            return self.store.renew(self.key(tenant, digest), self.retention.ttl(tenant, retention_class)) is not None
        except Exception:
            log.exception("renewing image rows %s failed", digest)
            return False

    def save(self, tenant: str, retention_class: str, digest: str, rows: torch.Tensor) -> bool:
        """Store an image's rows; False if they were not stored."""
        data = save_tensors({"rows": rows.detach().contiguous().cpu()})
        namespace = namespace_of(self.layout, tenant)
        try:
            stored = self.store.put_image(
                namespace, digest, data, rows.shape[0], self.retention.ttl(tenant, retention_class)
            )
        except Exception:
            log.exception("storing image rows %s failed", digest)
            return False
        return stored is not None
