"""Who a request is, and which cache namespace it may use.

The tenant is an authenticated fact, never a claim of the client's:
- an API key maps to a tenant (`api_keys: [{sha256, tenant}]`; keys are kept hashed);
- the tenant header (`tenant_header`) is honoured only on a connection from a
  configured trusted proxy (`trusted_proxies`), which authenticated the client itself;
- anything else is the shared namespace (tenant "").

The salt the engine gets (`cache_salt`) is derived here, never taken from the client:
an HMAC of the tenant and the client's own salt under the gateway secret. A client's
`cache_salt` thus narrows its own tenant's sharing (vLLM's semantics: only requests
with the same salt share blocks) but can never name another tenant's namespace: the
tenant is inside the keyed hash. Routing uses the same salt for the content keys'
namespace, so the index (which reads the salt back from the engine's events) and the
engine's cache agree.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from quillcache.gateway.httpio import ApiError, bearer
from quillcache.gateway.secret import GatewaySecret

log = logging.getLogger(__name__)

SALT_PREFIX = "qc1-"
MAX_TENANT_CHARS = 128
MAX_CLIENT_SALT_CHARS = 1024
_SALT_TAG = b"quillcache-cache-salt-v1\0"

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def hash_key(key: str) -> str:
    """How an API key is stored in the config: the hex SHA-256 of the key."""
    return hashlib.sha256(key.encode()).hexdigest()


def derive_salt(secret: bytes, tenant: str, client_salt: str) -> str | None:
    """The engine's `cache_salt` for this tenant and client salt; None (no salt, the
    engine's shared namespace) only when both are empty."""
    if not tenant and not client_salt:
        return None
    t, s = tenant.encode(), client_salt.encode()
    message = _SALT_TAG + struct.pack("<I", len(t)) + t + struct.pack("<I", len(s)) + s
    return SALT_PREFIX + hmac.new(secret, message, hashlib.sha256).hexdigest()[:32]


def valid_tenant(name: str) -> bool:
    return 0 < len(name) <= MAX_TENANT_CHARS and name.isprintable() and not name.isspace()


@dataclass(frozen=True)
class Identity:
    """The authenticated tenant ("" = shared) and the salt its engine requests carry."""

    tenant: str
    salt: str | None


class TenantPolicy:
    """Authenticates a request and derives its namespace salt."""

    def __init__(
        self,
        secret: GatewaySecret,
        *,
        key_tenants: Mapping[str, str | None],  # sha256 hex of a key -> its tenant
        trusted_proxies: Iterable[str] = (),
        tenant_header: str = "x-tenant-id",
    ) -> None:
        self.secret = secret
        self.key_tenants = {k.lower(): t for k, t in key_tenants.items()}
        self.trusted: list[IPNetwork] = [
            ipaddress.ip_network(p, strict=False) for p in trusted_proxies
        ]
        self.tenant_header = tenant_header.lower()
        self.isolating = bool(self.trusted) or any(t for t in self.key_tenants.values())

    @property
    def requires_key(self) -> bool:
        return bool(self.key_tenants)

    def startup_notice(self) -> str | None:
        """What an operator must know when no tenant is configured."""
        if self.isolating:
            return None
        return (
            "no tenants configured (api_keys with a tenant, or trusted_proxies with the "
            f"{self.tenant_header} header): all clients share one cache namespace, and "
            "usage.prompt_tokens_details.cached_tokens and response times reveal whether "
            "another client sent the same prompt prefix (prefix-cache timing attacks)"
        )

    def is_trusted(self, peer: str | None) -> bool:
        if not peer or not self.trusted:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in network for network in self.trusted)

    def authenticate(self, headers: Mapping[str, str], peer: str | None) -> str:
        """The request's tenant ("" = shared), or a 401/403 `ApiError`."""
        key_tenant: str | None = None
        if self.key_tenants:
            given = bearer(headers)
            digest = hash_key(given) if given else ""
            matched = [h for h in self.key_tenants if hmac.compare_digest(h, digest)]
            if not given or not matched:
                raise ApiError(
                    401,
                    "missing or invalid API key (Authorization: Bearer <key>)",
                    "AuthenticationError",
                )
            key_tenant = self.key_tenants[matched[0]]
        claimed = headers.get(self.tenant_header)
        if claimed is None:
            return key_tenant or ""
        if key_tenant is not None and claimed == key_tenant:
            return key_tenant  # the same tenant as the key's: nothing is claimed
        if not self.is_trusted(peer):
            raise ApiError(
                403,
                f"the {self.tenant_header} header is honoured only from a trusted proxy "
                "(trusted_proxies); the tenant comes from your API key",
                "PermissionDeniedError",
            )
        if key_tenant is not None:
            raise ApiError(
                403,
                f"the {self.tenant_header} header names another tenant than the API key's",
                "PermissionDeniedError",
            )
        if not valid_tenant(claimed):
            raise ApiError(
                400,
                f"the {self.tenant_header} header must be 1-{MAX_TENANT_CHARS} printable "
                "characters",
            )
        return claimed

    def identity(self, tenant: str, client_salt: object) -> Identity:
        """The salt for `tenant` and the body's `cache_salt` (checked here)."""
        if client_salt is None:
            client_salt = ""
        if not isinstance(client_salt, str):
            raise ApiError(400, "'cache_salt' must be a string", param="cache_salt")
        if len(client_salt) > MAX_CLIENT_SALT_CHARS:
            raise ApiError(
                400,
                f"'cache_salt' must be at most {MAX_CLIENT_SALT_CHARS} characters",
                param="cache_salt",
            )
        return Identity(tenant, derive_salt(self.secret.current, tenant, client_salt))
