"""Who may publish KV events to a binding SUB: a ZAP handler with an address allowlist.

When the gateway binds (`kv_bind: true`: the engine's PUB connects to it), anyone who
can reach the port could publish, and one forged batch could claim residency or clear
a source. ZeroMQ's authentication protocol (ZAP, RFC 27) asks a handler bound at
`inproc://zeromq.zap.01` in the socket's context about every new connection to a socket
with a ZAP domain; this handler admits a connection only when its peer address is in
the allowlist of that domain (addresses or CIDR networks; pyzmq's own authenticator
matches exact addresses only). Each binding source gets its own domain, so a denial
is counted per source. Connecting SUBs need none of this: the gateway picks the
address it connects to.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Iterable

import zmq

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def networks(entries: Iterable[str]) -> tuple[IPNetwork, ...]:
    """Addresses or CIDRs as networks; a bad entry is a ValueError naming it."""
    out = []
    for entry in entries:
        try:
            out.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"{entry!r} is not an IP address or CIDR network") from None
    return tuple(out)


def _allowed(address: str, allowed: tuple[IPNetwork, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False  # ipc:// and the like carry no IP: not ours to admit
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in net for net in allowed)


class PublisherAllowlist:
    """The ZAP handler of one zmq context (one per context: `for_context`)."""

    _by_context: dict[int, PublisherAllowlist] = {}
    _lock = threading.Lock()

    @classmethod
    def for_context(cls, ctx: zmq.Context) -> PublisherAllowlist:
        with cls._lock:
            handler = cls._by_context.get(id(ctx))
            if handler is None:
                handler = cls._by_context[id(ctx)] = cls(ctx)
            return handler

    def __init__(self, ctx: zmq.Context) -> None:
        self._domains: dict[str, tuple[IPNetwork, ...]] = {}
        self.denied: dict[str, int] = {}
        self._last_log = 0.0
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)  # before any socket with a domain connects
        self._thread = threading.Thread(target=self._serve, name="kv-zap", daemon=True)
        self._thread.start()

    def allow(self, domain: str, allowed: tuple[IPNetwork, ...]) -> None:
        self._domains[domain] = allowed
        self.denied.setdefault(domain, 0)

    def forget(self, domain: str) -> None:
        self._domains.pop(domain, None)

    def _serve(self) -> None:
        sock = self._sock
        while True:
            try:
                frames = sock.recv_multipart()
            except zmq.ContextTerminated:
                sock.close(0)
                return
            # version, request id, domain, address, identity, mechanism, credentials...
            if len(frames) < 6 or frames[0] != b"1.0":
                sock.send_multipart([b"1.0", frames[1] if len(frames) > 1 else b"", b"400",
                                     b"malformed ZAP request", b"", b""])  # fmt: skip
                continue
            request_id, domain, address = frames[1], frames[2].decode(), frames[3].decode()
            allowed = self._domains.get(domain)
            ok = allowed is not None and _allowed(address, allowed)
            if not ok:
                self.denied[domain] = self.denied.get(domain, 0) + 1
                self._log_denial(domain, address)
            status, text = (b"200", b"OK") if ok else (b"400", b"not an allowed publisher")
            sock.send_multipart([b"1.0", request_id, status, text, b"", b""])

    def _log_denial(self, domain: str, address: str) -> None:
        now = time.monotonic()
        if now - self._last_log >= 5.0:  # a scanner must not flood the log
            self._last_log = now
            log.warning(
                "kv events: refused a publisher from %s on %s (not in kv_publishers); "
                "%d refused there so far",
                address,
                domain,
                self.denied.get(domain, 0),
            )
