"""API keys -> tenants: who is asking, at which priority tier, with which per-minute budgets.

The file (``--api-keys FILE``) is one JSON object::

    {"sk-...": {"tenant": "acme", "tier": "interactive", "rpm": 60, "tpm": 100000}}

``rpm`` (requests per minute) and ``tpm`` (prompt + max output tokens per
minute) are optional; 0 or absent means unlimited. Without a file, auth is off
and every request is tenant ``default`` at the default tier, unlimited.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from services.errors import AuthenticationError

_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class Tenant:
    name: str
    tier: str  # the highest tier its requests may use
    rpm: int = 0  # 0: unlimited
    tpm: int = 0
    key_id: str = ""  # a short digest of the key, for logs (never the key)


class ApiKeys:
    def __init__(self, tenants: dict[str, Tenant] | None, default: Tenant):
        # by the SHA-256 of the key, never the key itself: a lookup's timing depends on the digest
        # of what was sent, which says nothing about any real key (the property a constant-time
        # comparison gives), and the process holds no plain key to leak. None: auth is off.
        self._by_key = None if tenants is None else {_digest(k): t for k, t in tenants.items()}
        self.default = default

    @property
    def enabled(self) -> bool:
        return self._by_key is not None

    @classmethod
    def disabled(cls, default_tier: str) -> ApiKeys:
        return cls(None, Tenant("default", default_tier))

    @classmethod
    def load(cls, path: str | Path, tiers: tuple[str, ...], default_tier: str) -> ApiKeys:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the API keys file {path}: {exc}") from None
        return cls.from_mapping(data, tiers, default_tier)

    @classmethod
    def from_mapping(cls, data: dict, tiers: tuple[str, ...], default_tier: str) -> ApiKeys:
        if not isinstance(data, dict) or not data:
            raise ValueError("the API keys file must be a non-empty JSON object of key -> tenant settings")
        tenants = {}
        for key, entry in data.items():
            where = f"API key ...{key[-4:]}"
            if not isinstance(key, str) or len(key) < 8 or not key.isascii() or not key.isprintable():
                raise ValueError(f"{where}: keys must be printable ASCII, at least 8 characters")
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: settings must be an object")
            unknown = set(entry) - {"tenant", "tier", "rpm", "tpm"}
            if unknown:
                raise ValueError(f"{where}: unknown settings {sorted(unknown)}")
            name, tier = entry.get("tenant"), entry.get("tier", default_tier)
            if not isinstance(name, str) or not _TENANT.fullmatch(name):
                raise ValueError(f"{where}: tenant must be 1-64 characters of [A-Za-z0-9._-]; got {name!r}")
            if tier not in tiers:
                raise ValueError(f"{where}: tier must be one of {list(tiers)}; got {tier!r}")
            limits = {}
            for field in ("rpm", "tpm"):
                value = entry.get(field, 0)
                if type(value) is not int or value < 0:
                    raise ValueError(f"{where}: {field} must be an int >= 0 (0: unlimited); got {value!r}")
                limits[field] = value
            key_id = hashlib.sha256(key.encode()).hexdigest()[:8]
            tenants[key] = Tenant(name, tier, limits["rpm"], limits["tpm"], key_id)
        return cls(tenants, Tenant("default", default_tier))

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization: Bearer <key>`` header (any header when auth is off)."""
        if self._by_key is None:
            return self.default
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError("missing API key: send it as 'Authorization: Bearer <key>'")
        sent = _digest(key.strip())
        tenant = self._by_key.get(sent)
        if tenant is None:
            raise AuthenticationError("invalid API key")
        return tenant
