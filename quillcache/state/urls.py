"""Redis URLs as the gateway takes them (`--state`, `state:`): checked when the
configuration is read, and shown without their password."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis

#: The schemes redis-py connects with.
SCHEMES = ("redis", "rediss", "unix")


def redacted(url: str) -> str:
    """`url` with its password replaced by `***` (logs, /admin/index)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<a malformed URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def checked(url: str) -> str:
    """The URL with its scheme in lower case, or ValueError saying what is wrong with it
    (a bad port or host, a database that is not a number, a query argument redis-py does
    not take), before anything connects."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError(f"a redis://, rediss:// or unix:// URL is needed, got {redacted(url)!r}")
    url = scheme.lower() + "://" + rest
    shown = redacted(url)
    try:
        parts = urlsplit(url)
        pool = aioredis.ConnectionPool.from_url(url)
        pool.make_connection()  # the keyword arguments the URL's query gives; no socket
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{shown}: {exc}") from None
    db = parts.path.strip("/")
    if parts.scheme != "unix" and db and not db.isdigit():
        raise ValueError(f"{shown}: the database {db!r} in the path is not a number")
    return url
