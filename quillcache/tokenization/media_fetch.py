"""The bytes of a chat request's image: a base64 data URL, or (when enabled) an http(s) URL.

A gateway that fetches URLs named by clients must not become a way into the networks
behind it: a fetch is refused unless every address its host resolves to is a public
one, or is in the configured allowlist (`MediaLimits.allow`: addresses, networks or
host names). The connection then goes to exactly the addresses that were checked
(`_PinnedResolver`), so a second DNS answer cannot swap in a private one. Redirects
are not followed (their target would escape the check). Every failure is a
`MediaError` naming its cause or limit, which the gateway answers with a 400.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
import urllib.parse
from dataclasses import dataclass, field

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from quillcache.tokenization.request import TokenizationError

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class MediaError(TokenizationError):
    """An image of the request could not be loaded: its URL, its size, or its bytes."""


@dataclass(frozen=True)
class MediaLimits:
    """What the gateway may load for a request's images.

    `allow`: addresses ("127.0.0.1"), networks ("10.0.0.0/8") or host names
    ("images.internal") a fetch may reach although they are not public."""

    fetch: bool = False
    max_bytes: int = 20 << 20
    timeout_s: float = 5.0
    allow: tuple[str, ...] = ()
    networks: tuple[IpNetwork, ...] = field(init=False, default=())
    hosts: frozenset[str] = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        nets: list[IpNetwork] = []
        hosts: set[str] = set()
        for entry in self.allow:
            try:
                nets.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                hosts.add(entry.lower().rstrip("."))
        object.__setattr__(self, "networks", tuple(nets))
        object.__setattr__(self, "hosts", frozenset(hosts))

    def allows(self, addr: IpAddress) -> bool:
        return any(addr in net for net in self.networks)


def decode_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a `data:[<mediatype>][;params];base64,<data>` URL (RFC 2397), strictly
    decoded as vLLM does (only base64 URLs; no characters outside the alphabet)."""
    spec, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError("invalid data URL: no ',' separates its header from its data")
    if spec.rpartition(";")[2] != "base64":
        raise MediaError("invalid data URL: only base64 data URLs are supported")
    # 4 base64 characters per 3 bytes: refuse before decoding what could not fit
    if len(payload) > (max_bytes + 2) // 3 * 4:
        raise MediaError(
            f"image too large: its data URL holds more than {max_bytes} bytes "
            "(multimodal.max_image_bytes)"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"invalid data URL: its data is not base64 ({exc})") from None
    if len(data) > max_bytes:
        raise MediaError(
            f"image too large: {len(data)} bytes, the limit is {max_bytes} "
            "(multimodal.max_image_bytes)"
        )
    return data


def _denial(addr: IpAddress) -> str | None:
    """Why `addr` may not be fetched from without the allowlist (None: it may)."""
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    if mapped is not None:
        addr = mapped
    if addr.is_loopback:
        return "a loopback address"
    if addr.is_link_local:
        return "a link-local address"
    if addr.is_unspecified or addr.is_multicast or addr.is_reserved:
        return "not a public address"
    if addr.is_private:
        return "a private address"
    if not addr.is_global:
        return "not a public address"
    return None


class _PinnedResolver(AbstractResolver):
    """Answers with the addresses already checked, whatever DNS says now."""

    def __init__(self, results: list[ResolveResult]) -> None:
        self._results = results

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        return [{**r, "port": port} for r in self._results]

    async def close(self) -> None:
        return None


class MediaFetcher:
    """Loads the bytes of image URLs within `limits`."""

    def __init__(self, limits: MediaLimits) -> None:
        self.limits = limits

    def load_now(self, url: str) -> bytes | None:
        """The bytes of a data URL; None for a URL to fetch (`load`); `MediaError` for
        one that may not be loaded."""
        if url[:5].lower() == "data:":
            return decode_data_url(url, self.limits.max_bytes)
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme not in ("http", "https"):
            raise MediaError(
                f"unsupported image URL scheme {scheme or '(none)'!r}: give a base64 data URL"
                + (" or an http(s) URL" if self.limits.fetch else "")
            )
        if not self.limits.fetch:
            raise MediaError(
                "image URLs are not fetched here (multimodal.fetch is off): send the image "
                "as a base64 data URL"
            )
        return None

    async def load(self, url: str) -> bytes:
        data = self.load_now(url)
        return await self._fetch(url) if data is None else data

    async def _resolve(self, host: str, port: int) -> list[ResolveResult]:
        """Every address of `host`, each checked against the allowlist."""
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise MediaError(f"cannot resolve the image URL's host {host!r}: {exc}") from None
        allowed_host = host.lower().rstrip(".") in self.limits.hosts
        out: list[ResolveResult] = []
        for family, _, proto, _, sockaddr in infos:
            addr = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            why = None if allowed_host or self.limits.allows(addr) else _denial(addr)
            if why is not None:
                raise MediaError(
                    f"image URL refused: its host {host!r} resolves to {addr}, {why} "
                    "(not in multimodal.fetch_allow)"
                )
            out.append(
                {
                    "hostname": host,
                    "host": str(addr),
                    "port": port,
                    "family": family,
                    "proto": proto,
                    "flags": socket.AI_NUMERICHOST,
                }
            )
        if not out:
            raise MediaError(f"cannot resolve the image URL's host {host!r}: no address")
        return out

    async def _fetch(self, url: str) -> bytes:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
        if not host:
            raise MediaError("invalid image URL: no host")
        try:
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        except ValueError as exc:
            raise MediaError(f"invalid image URL: {exc}") from None
        limits = self.limits
        timeout = aiohttp.ClientTimeout(total=limits.timeout_s)
        try:
            async with asyncio.timeout(limits.timeout_s):
                results = await self._resolve(host, port)
                connector = aiohttp.TCPConnector(
                    resolver=_PinnedResolver(results), use_dns_cache=False
                )
                async with (
                    aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
                    session.get(url, allow_redirects=False) as resp,
                ):
                    return await self._body(resp, limits.max_bytes)
        except TimeoutError:
            raise MediaError(
                f"image fetch timed out after {limits.timeout_s} s (multimodal.fetch_timeout_s)"
            ) from None
        except aiohttp.ClientError as exc:
            raise MediaError(f"image fetch failed: {exc}") from None

    @staticmethod
    async def _body(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes:
        if 300 <= resp.status < 400:
            raise MediaError(f"image fetch answered a redirect ({resp.status}), not followed")
        if resp.status != 200:
            raise MediaError(f"image fetch answered HTTP {resp.status}")
        if resp.content_length is not None and resp.content_length > max_bytes:
            raise MediaError(
                f"image too large: {resp.content_length} bytes, the limit is {max_bytes} "
                "(multimodal.max_image_bytes)"
            )
        data = bytearray()
        async for chunk in resp.content.iter_chunked(1 << 16):
            data += chunk
            if len(data) > max_bytes:
                raise MediaError(
                    f"image too large: over {max_bytes} bytes (multimodal.max_image_bytes)"
                )
        return bytes(data)
