"""How long stored prefixes live: retention classes with TTLs, per-tenant overrides.

A request names its tenant (header X-DeepMesh-Tenant, default "default") and may choose its
class (header X-DeepMesh-Retention, or the body field `"deepmesh": {"retention": ...}`);
otherwise its endpoint's default applies (common/api.py).
Defaults follow DeepSeek's service: agent 3 days, chat 7 days.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# here, not in common/api.py with the other API rules: the engine side reads retention without
# importing the message schemas that module needs
RETENTION_CLASSES = ("agent", "chat")


@dataclass
class Retention:
    ttl_seconds: dict[str, float] = field(default_factory=lambda: {"agent": 3 * 86400.0, "chat": 7 * 86400.0})
    overrides: dict[str, dict[str, float]] = field(default_factory=dict)  # tenant -> class -> seconds

    def __post_init__(self) -> None:
        for tenant, classes in {"": self.ttl_seconds, **self.overrides}.items():
            unknown = set(classes) - set(RETENTION_CLASSES)
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
