"""How an entry's bytes travel over the cache service's HTTP API: one body of several parts.

    8 bytes   little-endian length of the JSON header that follows
    header    {"sizes": [bytes of each part, in order], ...metadata}
    parts     concatenated: the head blob, then one blob per full block

One request or response carries a whole entry, so a load is one round trip however many
blocks it has; the parts are opaque bytes (the engine's, see engine/state_transfer.py).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 64 << 20  # a million-token prompt's ids as JSON, with room to spare


def checksum_of(data: bytes) -> str:
    """A body's checksum as `X-Checksum` carries it, and as the catalog records an entry's."""
    return hashlib.sha256(data).hexdigest()


def pack(parts: list[bytes], **meta: Any) -> bytes:
    header = json.dumps({"sizes": [len(p) for p in parts], **meta}, separators=(",", ":")).encode()
    return b"".join([len(header).to_bytes(HEADER_LENGTH_BYTES, "little"), header, *parts])


def unpack(data: bytes) -> tuple[list[bytes], dict[str, Any]]:
    """(parts, metadata), or ValueError saying what is wrong with the body."""
    header_length = int.from_bytes(data[:HEADER_LENGTH_BYTES], "little")
    start = HEADER_LENGTH_BYTES + header_length
    if len(data) < HEADER_LENGTH_BYTES or header_length > min(MAX_HEADER_BYTES, len(data) - HEADER_LENGTH_BYTES):
        raise ValueError("not an entry body: no complete header")
    try:
        meta = json.loads(data[HEADER_LENGTH_BYTES:start])
    except ValueError as err:
        raise ValueError(f"not an entry body: unreadable header ({err})") from None
    sizes = meta.pop("sizes", None) if isinstance(meta, dict) else None
    if not isinstance(sizes, list) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise ValueError("not an entry body: the header lists no part sizes")
    if start + sum(sizes) != len(data):
        raise ValueError(f"the parts take {sum(sizes)} bytes, the body has {len(data) - start}")
    view = memoryview(data)
    parts = []
    for size in sizes:
        parts.append(bytes(view[start : start + size]))
        start += size
    return parts, meta
