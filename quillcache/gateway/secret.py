"""The gateway secret: the key behind every tenant's derived cache salt.

The salt the gateway sends an engine for a tenant is a keyed hash of the tenant (and
the client's own salt) with this secret (`tenancy.derive_salt`). It must outlive the
process, or every restart would move every tenant to a new namespace and orphan all
the engines' caches; and every replica of one fleet must hold the same one, or the
replicas would split each tenant's cache in as many namespaces. So it lives in a file
(created on first use, mode 0600) that an operator can also mount from a secret store.

Rotation (`quillcache secret rotate`) writes a new current secret and keeps the old one
as `previous` until a deadline. Salts are always derived with the current secret: a
rotation moves every tenant to a fresh namespace when the gateways restart, which is
the point of rotating a leaked key (the old namespaces age out of the engines' LRU).
Until the deadline the previous secret's fingerprint is still *accepted* where a
fingerprint is compared (replicas of one fleet during a rolling restart).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quillcache.errors import ConfigError

log = logging.getLogger(__name__)

_FINGERPRINT_TAG = b"quillcache-secret-fingerprint-v1\0"
_SECRET_BYTES = 32


def default_path() -> Path:
    """`$QUILLCACHE_STATE_DIR/gateway-secret.json`, else under the XDG state directory."""
    base = os.environ.get("QUILLCACHE_STATE_DIR")
    if base:
        return Path(base) / "gateway-secret.json"
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "quillcache" / "gateway-secret.json"


def fingerprint(key: bytes) -> str:
    """A public name of a secret: equal fingerprints, equal secrets (16 hex digits)."""
    return hashlib.sha256(_FINGERPRINT_TAG + key).hexdigest()[:16]


@dataclass(frozen=True)
class GatewaySecret:
    current: bytes
    previous: bytes | None = None
    previous_until: float | None = None  # unix time; the previous one is accepted until then
    path: Path | None = None

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.current)

    def accepted_fingerprints(self, now: float | None = None) -> list[str]:
        """The current fingerprint, and the previous one while its window lasts."""
        out = [self.fingerprint]
        now = time.time() if now is None else now
        if self.previous is not None and (self.previous_until or 0.0) > now:
            out.append(fingerprint(self.previous))
        return out

    def as_dict(self) -> dict[str, Any]:
        """What the admin API shows: fingerprints only, never the key."""
        return {
            "fingerprint": self.fingerprint,
            "accepted_fingerprints": self.accepted_fingerprints(),
            "previous_until": self.previous_until,
            "path": str(self.path) if self.path else None,
        }


def _decode(path: Path, text: str) -> GatewaySecret:
    try:
        data = json.loads(text)
        current = bytes.fromhex(data["current"])
        previous = bytes.fromhex(data["previous"]) if data.get("previous") else None
        until = data.get("previous_until")
        until = float(until) if until is not None else None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"gateway secret file {path} is not valid ({exc}); expected JSON with a hex "
            "'current' key (see `quillcache secret rotate`)"
        ) from None
    if len(current) < 16:
        raise ConfigError(f"gateway secret file {path}: 'current' must hold at least 16 bytes")
    return GatewaySecret(current, previous, until, path)


def _encode(secret: GatewaySecret) -> str:
    return json.dumps(
        {
            "version": 1,
            "current": secret.current.hex(),
            "previous": secret.previous.hex() if secret.previous else None,
            "previous_until": secret.previous_until,
        },
        indent=2,
    )


def _write_new(path: Path, secret: GatewaySecret) -> bool:
    """Create `path` with mode 0600 unless it exists (another gateway won the race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(_encode(secret))
        f.flush()
        os.fsync(f.fileno())
    return True


def _replace(path: Path, secret: GatewaySecret) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(_encode(secret))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_or_create(path: Path | None = None) -> GatewaySecret:
    """The secret in `path` (the default path when None), created on first use."""
    path = path or default_path()
    try:
        if not path.exists() and _write_new(path, GatewaySecret(secrets.token_bytes(32))):
            log.warning(
                "gateway secret: created %s (fingerprint %s); keep it, and give every "
                "replica of this fleet the same file",
                path,
                fingerprint(_decode(path, path.read_text()).current),
            )
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"gateway secret file {path}: {exc}") from None
    with contextlib.suppress(OSError):
        if path.stat().st_mode & 0o077:
            log.warning("gateway secret: %s is readable by other users; chmod 600 it", path)
    return _decode(path, text)


def rotate(path: Path | None = None, window_s: float = 86_400.0) -> GatewaySecret:
    """Make a new current secret; the old one stays accepted for `window_s`."""
    old = load_or_create(path)
    assert old.path is not None
    new = GatewaySecret(
        secrets.token_bytes(_SECRET_BYTES), old.current, time.time() + window_s, old.path
    )
    try:
        _replace(old.path, new)
    except OSError as exc:
        raise ConfigError(f"gateway secret file {old.path}: {exc}") from None
    return new
