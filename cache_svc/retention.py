"""How long stored prefixes live: retention classes with TTLs, per-tenant overrides.

A request names its tenant (header X-DeepMesh-Tenant, default "default") and may choose its
class (header X-DeepMesh-Retention, or the body field `"deepmesh": {"retention": ...}`);
otherwise its endpoint's default applies: Anthropic Messages, the protocol of coding agents,
is `agent`; the OpenAI protocols are `chat`.
Defaults follow DeepSeek's service: agent 3 days, chat 7 days.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

CLASSES = ("agent", "chat")
DEFAULT_CLASS = {"messages": "agent", "chat.completions": "chat", "responses": "chat"}
TENANT_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass
class Retention:
    ttl_seconds: dict[str, float] = field(default_factory=lambda: {"agent": 3 * 86400.0, "chat": 7 * 86400.0})
    overrides: dict[str, dict[str, float]] = field(default_factory=dict)  # tenant -> class -> seconds

    def __post_init__(self) -> None:
        for tenant, classes in {"": self.ttl_seconds, **self.overrides}.items():
            unknown = set(classes) - set(CLASSES)
            if unknown:
                raise ValueError(f"unknown retention classes {sorted(unknown)} (for tenant {tenant!r})")
            if any(seconds <= 0 for seconds in classes.values()):
                raise ValueError("retention TTLs must be positive")

    @classmethod
    def from_settings(cls, settings) -> Retention:
        """From DEEPMESH_RETENTION_AGENT_SECONDS, _CHAT_SECONDS and _OVERRIDES (common.settings)."""
        ttl = {"agent": settings.retention_agent_seconds, "chat": settings.retention_chat_seconds}
        return cls(ttl, settings.retention_overrides)

    def ttl(self, tenant: str, retention_class: str) -> float:
        return self.overrides.get(tenant, {}).get(retention_class, self.ttl_seconds[retention_class])


def request_error(tenant: str | None, retention_class: str | None) -> str | None:
    """Why the tenant or class a request names is not acceptable, or None."""
    if tenant is not None and not TENANT_PATTERN.fullmatch(tenant):
        return "X-DeepMesh-Tenant must be 1 to 64 letters, digits, '.', '_' or '-'"
    if retention_class is not None and retention_class not in CLASSES:
        return f"the retention class must be one of {', '.join(CLASSES)}, not {retention_class!r}"
    return None
