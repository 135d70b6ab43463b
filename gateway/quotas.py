"""Rate limits per API key: requests per minute and tokens (input + output) per minute.

Counted in fixed one-minute windows, in Redis when several gateway replicas share the limits
(one Lua script checks and counts, so two replicas never both let the last request through),
in memory when one process serves (embedded). A call is admitted with an estimate of its
tokens (its body's bytes / 4, plus the output it asks for at most) and, once answered, the
window it was admitted in is corrected to what it used. Refused: 429 with Retry-After (the
seconds until the window turns) and the headers each protocol's clients read.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import redis

log = logging.getLogger(__name__)

WINDOW = 60.0


@dataclass
class Decision:
    admitted: bool
    window: int  # the minute counted in
    requests: int  # counted in that minute, this call included when admitted
    tokens: int
    rpm: int | None
    tpm: int | None

    @property
    def reset_seconds(self) -> float:
        return max(0.0, (self.window + 1) * WINDOW - time.time())

    def headers(self, anthropic: bool) -> dict[str, str]:
        """OpenAI's x-ratelimit-* or Anthropic's anthropic-ratelimit-* headers, and Retry-After when refused."""
        reset = self.reset_seconds
        headers: dict[str, str] = {}
        for kind, limit, used in (("requests", self.rpm, self.requests), ("tokens", self.tpm, self.tokens)):
            if limit is None:
                continue
            remaining = str(max(0, limit - used))
            if anthropic:
                at = datetime.fromtimestamp(time.time() + reset, UTC).isoformat().replace("+00:00", "Z")
                headers |= {
                    f"anthropic-ratelimit-{kind}-limit": str(limit),
                    f"anthropic-ratelimit-{kind}-remaining": remaining,
                    f"anthropic-ratelimit-{kind}-reset": at,
                }
            else:
                headers |= {
                    f"x-ratelimit-limit-{kind}": str(limit),
                    f"x-ratelimit-remaining-{kind}": remaining,
                    f"x-ratelimit-reset-{kind}": f"{reset:.3f}s",
                }
        if not self.admitted:
            headers["retry-after"] = str(max(1, math.ceil(reset)))
        return headers


def estimate_tokens(body_bytes: int, body: dict) -> int:
    """What a call will count before it is answered: its input from its size, its output at most."""
    most = body.get("max_tokens") or body.get("max_completion_tokens") or body.get("max_output_tokens") or 0
    return body_bytes // 4 + (most if isinstance(most, int) else 0)


class MemoryQuotas:
    def __init__(self):
        self._counts: dict[tuple[str, int], list[int]] = {}
        self._lock = threading.Lock()

    def admit(self, key: str, rpm: int | None, tpm: int | None, tokens: int) -> Decision:
        window = int(time.time() // WINDOW)
        with self._lock:
            counts = self._counts.setdefault((key, window), [0, 0])
            admitted = _fits(counts[0], counts[1], rpm, tpm, tokens)
            if admitted:
                counts[0] += 1
                counts[1] += tokens
            for old in [k for k in self._counts if k[1] < window - 1]:
                del self._counts[old]
            return Decision(admitted, window, counts[0], counts[1], rpm, tpm)

    def settle(self, key: str, window: int, tokens: int) -> None:
        with self._lock:
            if (key, window) in self._counts:
                self._counts[(key, window)][1] += tokens


def _fits(requests: int, tokens: int, rpm: int | None, tpm: int | None, wanted: int) -> bool:
    # a call larger than the whole minute's tokens still runs, alone in its minute
    return (rpm is None or requests + 1 <= rpm) and (tpm is None or tokens == 0 or tokens + wanted <= tpm)


_ADMIT = """
local requests = tonumber(redis.call('GET', KEYS[1]) or '0')
local tokens = tonumber(redis.call('GET', KEYS[2]) or '0')
local rpm, tpm, wanted = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if (rpm >= 0 and requests + 1 > rpm) or (tpm >= 0 and tokens > 0 and tokens + wanted > tpm) then
  return {0, requests, tokens}
end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], 120)
redis.call('INCRBY', KEYS[2], wanted)
redis.call('EXPIRE', KEYS[2], 120)
return {1, requests + 1, tokens + wanted}
"""


class RedisQuotas:
    def __init__(self, url: str, prefix: str = "deepmesh."):
        self.redis = redis.Redis.from_url(url, socket_timeout=2)
        self.prefix = prefix
        self._admit = self.redis.register_script(_ADMIT)

    def _keys(self, key: str, window: int) -> list[str]:
        return [f"{self.prefix}ratelimit:{key}:{window}:requests", f"{self.prefix}ratelimit:{key}:{window}:tokens"]

    def admit(self, key: str, rpm: int | None, tpm: int | None, tokens: int) -> Decision:
        window = int(time.time() // WINDOW)
        limits = [-1 if rpm is None else rpm, -1 if tpm is None else tpm, tokens]
        admitted, requests, counted = self._admit(keys=self._keys(key, window), args=limits)
        return Decision(bool(admitted), window, int(requests), int(counted), rpm, tpm)

    def settle(self, key: str, window: int, tokens: int) -> None:
        try:
            self.redis.incrby(self._keys(key, window)[1], tokens)
        except redis.RedisError as err:  # the minute keeps its estimate; the answer is sent already
            log.warning("correcting a rate-limit count failed: %s", err)
