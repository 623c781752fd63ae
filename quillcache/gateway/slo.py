"""Per-request SLO hints: read, checked against their limits, and held to the gateway's trust.

A client states its TTFT / TBT target in milliseconds, as a header or as a body
extension (both: they must agree, else 400):

    x-slo-ttft-ms: 800                      x-slo-tbt-ms: 60
    {"quillcache": {"slo": {"ttft_ms": 800, "tbt_ms": 60}}, ...}

The extension is the gateway's own and is taken out of the body before it is forwarded
(an engine would not know it). Dynamo's frontend takes the same targets as
`nvext.router.ttft_target` / `itl_target` (milliseconds); `nvext` carries Dynamo's
other routing fields too (instance ids, ranks) that mean nothing here, so it is not
read: a Dynamo client moves its two numbers.

A hint must be a finite number > 0 and at most `slo_max_ms`; anything else is a 400
naming the field and the limit. What a valid hint does follows `slo_hints`:
- "tighten" (default): a hint may only lower a bound the gateway's default SLO sets
  (`router_options.ttft_slo_s` / `tbt_slo_s`), so no client can loosen its way past
  admission; a bound without a default is the client's to set. Tenants listed in
  `slo_trusted_tenants` (authenticated, `tenancy`) set their bounds as given.
- "honour": every hint is taken as given (a gateway behind a trusted front end).
- "ignore": hints are checked, then dropped: the default SLO alone applies.

The request so marked goes through the control plane's admission stage
(`quillcache.controlplane.admission`), after whichever router; a rejection is a 429
with `Retry-After` (`SloRejected`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

from quillcache.controlplane.admission import SloMiss
from quillcache.gateway.httpio import ApiError, header_number
from quillcache.routing import SLO

TTFT_HEADER = "x-slo-ttft-ms"
TBT_HEADER = "x-slo-tbt-ms"
EXTENSION = "quillcache"
# body field -> header, per bound
_FIELDS = (("ttft_ms", TTFT_HEADER), ("tbt_ms", TBT_HEADER))


class SloRejected(ApiError):
    """429: the admission stage's estimate on the chosen engine misses the request's
    SLO. `Retry-After` is `SloMiss.retry_after_s`; the body names the estimate and the
    SLO (OpenAI's error shape, `code` "slo_unattainable")."""

    def __init__(self, miss: SloMiss, reason: str) -> None:
        # `reason` (the admission stage's) names the engine, the estimate and the SLO
        if not miss.waiting_helps:
            then = "even with its queue empty the engine would miss it: no wait helps"
        elif miss.bound == "tbt":
            then = "retry once running requests end (their decode batch sets the TBT)"
        else:
            then = f"retry after {miss.retry_after_s} s"
        super().__init__(
            429,
            f"request not admitted: {reason}; {then}",
            "RateLimitError",
            code="slo_unattainable",
            param=f"{miss.bound}_ms",
        )
        self.miss = miss
        self.reason = reason

    def response(self) -> JSONResponse:
        response = super().response()
        if self.miss.waiting_helps:
            response.headers["retry-after"] = str(self.miss.retry_after_s)
        else:
            # the same request misses its SLO on an idle engine: no retry can help.
            # OpenAI's SDKs obey `x-should-retry` (they retry a 429 by default).
            response.headers["x-should-retry"] = "false"
        return response


def _value(raw: Any, name: str, limit_ms: float) -> float:
    """One hint in milliseconds (a header's text, a body's JSON number) -> seconds, or a
    400 naming `name` and the limit."""
    number: float | None = None
    if name.startswith("x-") and isinstance(raw, str):
        number = header_number(raw)
    elif isinstance(raw, int | float) and not isinstance(raw, bool):
        number = float(raw)
    if number is None or not math.isfinite(number) or not 0 < number <= limit_ms:
        raise ApiError(
            400,
            f"{name} must be a number of milliseconds > 0 and <= {limit_ms:g} (slo_max_ms), "
            f"got {raw!r}",
            code="invalid_slo",
            param=name,
        )
    return number / 1000.0


def _body_hints(body: dict[str, Any]) -> Mapping[str, Any]:
    ext = body.get(EXTENSION)
    if ext is None:
        return {}
    # the session hint (`session_hints`) has taken its own field by now
    extra = sorted(set(ext) - {"slo"}) if isinstance(ext, dict) else None
    if extra is None or extra:
        got = f"got {extra}" if extra else f"got {type(ext).__name__}"
        raise ApiError(
            400,
            f"'{EXTENSION}' must be an object of 'slo' and 'session' ({got}): "
            '{"slo": {"ttft_ms": <ms>, "tbt_ms": <ms>}, "session": {"id": <id>, "ttl_s": <s>}}',
            code="invalid_extension",
            param=EXTENSION,
        )
    slo = ext.get("slo")
    if not isinstance(slo, dict):
        raise ApiError(
            400,
            f"'{EXTENSION}.slo' must be an object: "
            '{"slo": {"ttft_ms": <ms>, "tbt_ms": <ms>}}',
            code="invalid_slo",
            param=f"{EXTENSION}.slo",
        )
    unknown = set(slo) - {f for f, _ in _FIELDS}
    if unknown:
        raise ApiError(
            400,
            f"'{EXTENSION}.slo' takes only ttft_ms and tbt_ms, got {sorted(unknown)}",
            code="invalid_slo",
            param=f"{EXTENSION}.slo",
        )
    return slo


def read_hints(headers: Mapping[str, str], body: dict[str, Any], limit_ms: float) -> SLO | None:
    """The client's SLO from the headers and the body extension (which this removes from
    `body`), each checked; None when it gave none. A 400 for a bad value or when a
    header and the body give different values for the same bound."""
    from_body = _body_hints(body)
    body.pop(EXTENSION, None)
    bounds: dict[str, float | None] = {}
    for field, header in _FIELDS:
        in_header = headers.get(header)
        in_body = from_body.get(field)
        h = _value(in_header, header, limit_ms) if in_header is not None else None
        b = _value(in_body, f"{EXTENSION}.slo.{field}", limit_ms) if in_body is not None else None
        if h is not None and b is not None and h != b:
            raise ApiError(
                400,
                f"the {header} header ({in_header}) and {EXTENSION}.slo.{field} ({in_body}) "
                "disagree: give one",
                code="invalid_slo",
                param=f"{EXTENSION}.slo.{field}",
            )
        bounds[field] = h if h is not None else b
    if bounds["ttft_ms"] is None and bounds["tbt_ms"] is None:
        return None
    return SLO(ttft_s=bounds["ttft_ms"], tbt_s=bounds["tbt_ms"])


#: vLLM's `priority` is a Python int; the gateway takes the 32-bit range.
PRIORITY_LIMIT = 2**31


def read_priority(body: dict[str, Any]) -> int:
    """The body's `priority` (vLLM's field: lower is sooner; absent: 0), or a 400."""
    value = body.get("priority", 0)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or abs(value) >= PRIORITY_LIMIT:
        raise ApiError(
            400,
            f"priority must be an integer with |priority| < 2**31, got {value!r}",
            param="priority",
        )
    return value


class SloPolicy:
    """What a valid hint becomes (`slo_hints`, `slo_trusted_tenants`), against the
    default SLO the admission stage applies to bounds a request leaves unset."""

    def __init__(
        self, mode: str, trusted_tenants: frozenset[str], default: SLO | None, max_ms: float
    ) -> None:
        self.mode = mode
        self.trusted_tenants = trusted_tenants
        self.default = default
        self.max_ms = max_ms

    def apply(self, hint: SLO | None, tenant: str) -> SLO | None:
        """The request's own SLO (`Request.slo`) from its checked hint; None leaves every
        bound to the default."""
        if hint is None or self.mode == "ignore":
            return None
        if self.mode == "honour" or tenant in self.trusted_tenants:
            return hint
        default = self.default or SLO()
        return SLO(
            ttft_s=_tighter(hint.ttft_s, default.ttft_s), tbt_s=_tighter(hint.tbt_s, default.tbt_s)
        )

    def priority(self, priority: int, tenant: str) -> int:
        """A request's place in the SLO queue: as given where hints are honoured (or
        its tenant trusted); else never ahead of the default 0 (a client may only put
        itself behind others: `tighten`), and 0 when hints are ignored."""
        if self.mode == "ignore":
            return 0
        if self.mode == "honour" or tenant in self.trusted_tenants:
            return priority
        return max(priority, 0)


def _tighter(hint: float | None, default: float | None) -> float | None:
    if hint is None or default is None:
        return hint if default is None else default
    return min(hint, default)
