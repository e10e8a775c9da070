"""API keys: each key belongs to a tenant, and the tenant, not the client, bounds what a request
may ask for: its priority range, how many requests it runs at once, and its tokens per minute.

The keys file (YAML, `--api-keys`):

    tenants:
      paying: {priority: [-2, 0], max_concurrent: 64, tokens_per_minute: 2000000}
      free:   {priority: [1, 2], max_concurrent: 4, tokens_per_minute: 20000}
    keys:
      - {key: "sk-paying-1", tenant: paying}
      - {sha256: "<hex digest of the key>", tenant: free}   # the key itself kept elsewhere

A client sends `authorization: Bearer <key>` metadata. A request's priority 0 (the proto's
default) means "the tenant's default" when 0 is outside the tenant's range: its
`default_priority`, else the range's first value. Tokens per minute is a bucket refilled
continuously: a request's prompt is charged when it is admitted, its completion when it ends.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.scheduler.engine_io import EngineError


class TenantsError(ValueError):
    """A keys file that cannot be used; the message names the entry."""


@dataclass(eq=False, slots=True)
class Tenant:
    name: str
    priority_min: int
    priority_max: int
    default_priority: int
    max_concurrent: int = 0  # 0: no limit
    tokens_per_minute: int = 0  # 0: no limit
    adapters: tuple[str, ...] | None = None  # the LoRA adapters it may use; None: any
    admin: bool = False  # may load and unload LoRA adapters at run time
    running: int = 0
    _bucket: float = 0.0
    _refilled_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self._bucket = float(self.tokens_per_minute)

    def may_use(self, adapter: str) -> bool:
        """Whether requests of this tenant may name this LoRA adapter ("": the base model,
        always)."""
        return not adapter or self.adapters is None or adapter in self.adapters

    def check_adapter(self, adapter: str) -> None:
        if not self.may_use(adapter):
            raise EngineError("PERMISSION_DENIED", f"tenant {self.name} may not use LoRA "
                              f"adapter {adapter!r} (its adapters: "
                              f"{', '.join(self.adapters) or 'none'})")

    def tokens_available(self, now: float) -> float:
        if not self.tokens_per_minute:
            return float("inf")
        rate = self.tokens_per_minute / 60.0
        self._bucket = min(self.tokens_per_minute, self._bucket + (now - self._refilled_at) * rate)
        self._refilled_at = now
        return self._bucket

    def charge(self, tokens: int) -> None:
        """Take tokens from the bucket (it may go below zero: later requests wait longer)."""
        if self.tokens_per_minute:
            self.tokens_available(time.monotonic())
            self._bucket -= tokens


@dataclass(slots=True)
class Admission:
    """A request a tenant runs; release() when it ends, with the tokens it generated."""

    tenant: Tenant
    priority: int
    released: bool = False

    def release(self, completion_tokens: int) -> None:
        if not self.released:
            self.released = True
            self.tenant.running -= 1
            self.tenant.charge(completion_tokens)


class Tenants:
    def __init__(self, tenants: Iterable[Tenant], keys: dict[bytes, str]) -> None:
        """keys: sha256 digest of a key -> tenant name."""
        self.by_name = {t.name: t for t in tenants}
        self._keys = keys

    @classmethod
    def from_file(cls, path: str | Path) -> Tenants:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise TenantsError(f"api keys file {path}: {e}") from e
        tenants = [_tenant(name, spec or {}) for name, spec in (data.get("tenants") or {}).items()]
        names = {t.name for t in tenants}
        keys: dict[bytes, str] = {}
        for i, entry in enumerate(data.get("keys") or []):
            where = f"api keys file {path}: keys[{i}]"
            if not isinstance(entry, dict) or entry.get("tenant") not in names:
                raise TenantsError(f"{where}: needs a tenant named under tenants")
            if "key" in entry:
                digest = hashlib.sha256(str(entry["key"]).encode()).digest()
            elif "sha256" in entry:
                digest = bytes.fromhex(str(entry["sha256"]))
            else:
                raise TenantsError(f"{where}: needs key or sha256")
            keys[digest] = entry["tenant"]
        if not keys:
            raise TenantsError(f"api keys file {path}: no keys")
        return cls(tenants, keys)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant:
        """The tenant of the request's `authorization: Bearer <key>`; UNAUTHENTICATED if none."""
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if not isinstance(value, str) or not value.startswith("Bearer "):
            raise EngineError("UNAUTHENTICATED", "an API key is required: send the metadata "
                              "'authorization: Bearer <key>'")
        digest = hashlib.sha256(value[len("Bearer "):].strip().encode()).digest()
        for known, name in self._keys.items():
            if hmac.compare_digest(known, digest):
                return self.by_name[name]
        raise EngineError("UNAUTHENTICATED", "the API key is not valid")

    def admit(self, tenant: Tenant, priority: int, prompt_tokens: int) -> Admission:
        """Check the request against the tenant's bounds and charge its prompt; raises
        PERMISSION_DENIED (priority) or RESOURCE_EXHAUSTED (with a retry hint)."""
        if priority == 0 and not tenant.priority_min <= 0 <= tenant.priority_max:
            priority = tenant.default_priority
        if not tenant.priority_min <= priority <= tenant.priority_max:
            raise EngineError("PERMISSION_DENIED", f"priority {priority} is outside what tenant "
                              f"{tenant.name} may ask for ({tenant.priority_min}.."
                              f"{tenant.priority_max})")
        if tenant.max_concurrent and tenant.running >= tenant.max_concurrent:
            raise EngineError("RESOURCE_EXHAUSTED", f"tenant {tenant.name} runs "
                              f"{tenant.running} requests, its limit", retry_after_s=1.0)
        if tenant.tokens_per_minute:
            if prompt_tokens > tenant.tokens_per_minute:
                raise EngineError("RESOURCE_EXHAUSTED", f"the prompt's {prompt_tokens} tokens "
                                  f"exceed tenant {tenant.name}'s tokens per minute")
            available = tenant.tokens_available(time.monotonic())
            if available < prompt_tokens:
                wait = (prompt_tokens - available) / (tenant.tokens_per_minute / 60.0)
                raise EngineError("RESOURCE_EXHAUSTED", f"tenant {tenant.name} used its tokens "
                                  f"per minute; retry in about {wait:.0f} s", retry_after_s=wait)
            tenant.charge(prompt_tokens)
        tenant.running += 1
        return Admission(tenant, priority)


def _tenant(name: str, spec: dict) -> Tenant:
    lo, hi = spec.get("priority", [0, 0]) if isinstance(spec.get("priority"), list) else \
        (spec.get("priority", 0),) * 2
    if not (isinstance(lo, int) and isinstance(hi, int) and lo <= hi):
        raise TenantsError(f"tenant {name}: priority must be an integer or [low, high]")
    default = spec.get("default_priority", lo)
    if not lo <= default <= hi:
        raise TenantsError(f"tenant {name}: default_priority outside its priority range")
    adapters = spec.get("adapters")
    if adapters is not None and not (isinstance(adapters, list)
                                     and all(isinstance(a, str) and a for a in adapters)):
        raise TenantsError(f"tenant {name}: adapters must be a list of LoRA adapter names")
    if not isinstance(spec.get("admin", False), bool):
        raise TenantsError(f"tenant {name}: admin must be true or false")
    return Tenant(name, lo, hi, default, int(spec.get("max_concurrent", 0)),
                  int(spec.get("tokens_per_minute", 0)),
                  None if adapters is None else tuple(adapters), spec.get("admin", False))
