"""The tenant rule and the derived cache salt (`quillcache.gateway.tenancy`), and the
gateway secret behind it (`quillcache.gateway.secret`)."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.errors import ConfigError
from quillcache.gateway.config import load_config
from quillcache.gateway.httpio import ApiError
from quillcache.gateway.secret import GatewaySecret, load_or_create, rotate
from quillcache.gateway.tenancy import TenantPolicy, derive_salt, hash_key

SECRET = GatewaySecret(b"k" * 32)
names = st.text(min_size=0, max_size=12)


@given(t1=names, s1=names, t2=names, s2=names)
def test_distinct_tenant_and_salt_pairs_never_share_a_derived_salt(
    t1: str, s1: str, t2: str, s2: str
) -> None:
    """The reported leak: a client's `cache_salt` must never land in another tenant's
    namespace, whatever it sends (e.g. tenant "mallory" with salt "acme")."""
    a, b = derive_salt(SECRET.current, t1, s1), derive_salt(SECRET.current, t2, s2)
    if (t1, s1) == (t2, s2):
        assert a == b
    else:
        assert a != b
    assert (a is None) == (t1 == "" and s1 == "")


def test_the_salt_depends_on_the_secret_and_never_shows_the_tenant() -> None:
    one = derive_salt(b"a" * 32, "acme", "")
    assert one is not None and "acme" not in one
    assert one != derive_salt(b"b" * 32, "acme", "")
    # the length prefixes keep ("ab", "c") and ("a", "bc") apart
    assert derive_salt(b"a" * 32, "ab", "c") != derive_salt(b"a" * 32, "a", "bc")


def policy(**kw: object) -> TenantPolicy:
    args: dict[str, object] = {
        "key_tenants": {hash_key("k-acme"): "acme", hash_key("k-shared"): None},
        "trusted_proxies": ["10.0.0.0/8", "127.0.0.2"],
    }
    args.update(kw)
    return TenantPolicy(SECRET, **args)  # type: ignore[arg-type]


def auth(p: TenantPolicy, key: str | None, tenant: str | None, peer: str) -> str:
    headers = {}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    if tenant is not None:
        headers["x-tenant-id"] = tenant
    return p.authenticate(headers, peer)


def status_of(p: TenantPolicy, key: str | None, tenant: str | None, peer: str) -> int | str:
    try:
        return auth(p, key, tenant, peer)
    except ApiError as exc:
        return exc.status


def test_the_tenant_comes_from_the_key_or_a_trusted_proxy_only() -> None:
    p = policy()
    assert auth(p, "k-acme", None, "192.0.2.1") == "acme"
    assert auth(p, "k-shared", None, "192.0.2.1") == ""
    assert status_of(p, "wrong", None, "192.0.2.1") == 401
    assert status_of(p, None, None, "192.0.2.1") == 401
    # the header from an untrusted peer: refused, not silently ignored
    assert status_of(p, "k-shared", "acme", "192.0.2.1") == 403
    assert status_of(p, "k-shared", "acme", "127.0.0.1") == 403
    # from a trusted proxy (an address or a network; IPv4-mapped IPv6 too)
    assert auth(p, "k-shared", "acme", "10.1.2.3") == "acme"
    assert auth(p, "k-shared", "acme", "::ffff:127.0.0.2") == "acme"
    # a key bound to a tenant cannot be re-pointed, even by a trusted proxy
    assert status_of(p, "k-acme", "mallory", "10.1.2.3") == 403
    assert auth(p, "k-acme", "acme", "192.0.2.1") == "acme"
    assert status_of(p, "k-shared", "x" * 500, "10.1.2.3") == 400


def test_without_keys_no_key_is_needed_and_the_notice_says_the_cache_is_shared() -> None:
    p = policy(key_tenants={}, trusted_proxies=[])
    assert auth(p, None, None, "192.0.2.1") == ""
    assert status_of(p, None, "acme", "192.0.2.1") == 403
    notice = p.startup_notice()
    assert notice is not None and "share one cache namespace" in notice
    assert policy().startup_notice() is None


def test_client_salts_are_checked() -> None:
    p = policy()
    assert p.identity("", None).salt is None
    assert p.identity("", "").salt is None
    assert p.identity("acme", None).salt == derive_salt(SECRET.current, "acme", "")
    for bad in (3, ["a"], "s" * 2000):
        with pytest.raises(ApiError) as caught:
            p.identity("acme", bad)
        assert caught.value.status == 400


def test_api_keys_config_forms() -> None:
    cfg = load_config(
        None,
        api_keys=["plain", {"sha256": hash_key("hashed").upper(), "tenant": "acme"}],
        trusted_proxies=["127.0.0.1", "10.0.0.0/8"],
    )
    assert [k.digest for k in cfg.api_keys] == [hash_key("plain"), hash_key("hashed")]
    for bad in ({"sha256": "abc"}, {"tenant": "acme"}, {"key": "a", "sha256": "0" * 64}):
        with pytest.raises(ConfigError, match="api_keys"):
            load_config(None, api_keys=[bad])
    with pytest.raises(ConfigError, match="trusted_proxies"):
        load_config(None, trusted_proxies=["not-an-address"])


def test_the_secret_is_created_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "state" / "secret.json"
    first = load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = load_or_create(path)
    assert again.current == first.current and len(first.current) == 32
    assert load_or_create(tmp_path / "other.json").current != first.current


def test_rotation_keeps_the_previous_secret_accepted_for_its_window(tmp_path: Path) -> None:
    path = tmp_path / "secret.json"
    old = load_or_create(path)
    new = rotate(path, window_s=60)
    assert new.current != old.current and new.previous == old.current
    assert load_or_create(path).current == new.current  # written, not only returned
    assert new.accepted_fingerprints() == [new.fingerprint, old.fingerprint]
    assert new.accepted_fingerprints(now=time.time() + 61) == [new.fingerprint]
    shown = json.dumps(new.as_dict())
    assert new.current.hex() not in shown and old.current.hex() not in shown


def test_a_damaged_secret_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "secret.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid"):
        load_or_create(path)
    path.write_text(json.dumps({"current": "00"}))
    with pytest.raises(ConfigError, match="16 bytes"):
        load_or_create(path)
