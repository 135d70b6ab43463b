"""A call counted against its API key's limits (gateway/quotas.py) when it arrives, and the
count corrected to the tokens its jobs used once it is answered."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response

from common.messages import ResultPayload
from gateway.http import protocol_error
from gateway.quotas import Decision, MemoryQuotas, RedisQuotas, estimate_tokens


async def take_quota(
    quotas: MemoryQuotas | RedisQuotas, request: Request, endpoint: str, body: dict
) -> Decision | Response | None:
    """Count the call against its API key's limits: the decision, a 429 in the protocol's
    shape with the rate-limit headers, or None (no key, or a key without limits)."""
    key = request.state.key
    if key is None or (key.rpm is None and key.tpm is None):
        return None
    tokens = estimate_tokens(int(request.headers.get("content-length") or 0), body)
    decision = await asyncio.to_thread(quotas.admit, key.id, key.rpm, key.tpm, tokens)
    request.state.quota = (decision, tokens)
    if decision.admitted:
        return decision
    message = f"this API key's rate limit is reached; retry in {decision.headers(False)['retry-after']} s"
    response = protocol_error(endpoint, 429, message, "rate_limit_error")
    response.headers.update(decision.headers(endpoint == "messages"))
    return response


def settle_quota(quotas: MemoryQuotas | RedisQuotas, request: Request, *results: ResultPayload) -> None:
    """Correct the minute a call was counted in to the tokens its jobs used (estimated until now)."""
    taken = getattr(request.state, "quota", None)
    if taken is None or any(result.usage is None for result in results):
        return
    decision, estimate = taken
    used = sum(u.cached_input_tokens + u.uncached_input_tokens + u.output_tokens for u in (r.usage for r in results))
    asyncio.get_running_loop().run_in_executor(
        None, quotas.settle, request.state.key.id, decision.window, used - estimate
    )
