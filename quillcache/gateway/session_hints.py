"""Session retention hints: a client asks the gateway to keep its conversation's prefix
warm on the engine that served it, for a while (an agent waiting on a tool).

Three equivalent forms, checked here (a 400 naming the field and the limit otherwise):
- headers: the session header (`session_header`, default `x-session-id`) with
  `x-session-ttl-s: <seconds>`;
- the body extension `"quillcache": {"session": {"id": "...", "ttl_s": <seconds>}}`;
- Dynamo's shape, `"nvext": {"cache_control": {"type": "ephemeral", "ttl": "5m"}}`
  (durations `<n>s`, `<n>m`, `<n>h`), with the session named by the header or the
  extension; without a name the request's own prefix is retained.

The gateway consumes the hint: it is removed from the body the engine gets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from quillcache.gateway.httpio import ApiError, header_number

TTL_HEADER = "x-session-ttl-s"
EXTENSION = "quillcache"
MAX_SESSION_ID_CHARS = 256
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smh])$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True, slots=True)
class SessionHint:
    """Retain the request's prefix for `ttl_s` as session `session_id` (None: the
    request's own prefix, named by its last key)."""

    session_id: str | None
    ttl_s: float


def _error(message: str, param: str) -> ApiError:
    return ApiError(400, message, code="invalid_session_hint", param=param)


def _ttl(raw: object, param: str, max_s: float) -> float:
    if isinstance(raw, str) and param == TTL_HEADER:
        number = header_number(raw)
        if number is None:
            raise _error(f"{param} must be a number of seconds, got {raw!r}", param)
        raw = number
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        raise _error(f"{param} must be a number of seconds, got {raw!r}", param)
    if not 0 < raw <= max_s:
        raise _error(
            f"{param} must be more than 0 and at most {max_s:g} s (policy.session_max_ttl_s), "
            f"got {raw!r}",
            param,
        )
    return float(raw)


def _duration(raw: object, param: str, max_s: float) -> float:
    m = _DURATION.match(raw) if isinstance(raw, str) else None
    if m is None:
        raise _error(f"{param} must be a duration like '30s', '5m' or '1h', got {raw!r}", param)
    return _ttl(float(m.group(1)) * _UNIT_S[m.group(2)], param, max_s)


def _session_id(raw: object, param: str) -> str:
    if (
        not isinstance(raw, str)
        or not 0 < len(raw) <= MAX_SESSION_ID_CHARS
        or not raw.isprintable()
    ):
        raise _error(f"{param} must be 1-{MAX_SESSION_ID_CHARS} printable characters", param)
    return raw


def read_session_hint(
    headers: Mapping[str, str], body: dict[str, Any], session_header: str, max_ttl_s: float
) -> SessionHint | None:
    """The request's retention hint (removing its body forms from `body`), or None."""
    ext = body.get(EXTENSION)
    in_ext = ext.pop("session", None) if isinstance(ext, dict) else None
    if isinstance(ext, dict) and not ext:
        del body[EXTENSION]
    nvext = body.get("nvext")
    control = nvext.pop("cache_control", None) if isinstance(nvext, dict) else None
    if isinstance(nvext, dict) and not nvext:
        del body["nvext"]
    ttls: list[tuple[str, float]] = []
    session_id = headers.get(session_header)
    if session_id is not None:
        session_id = _session_id(session_id, session_header)
    if in_ext is not None:
        param = f"{EXTENSION}.session"
        if not isinstance(in_ext, dict) or not set(in_ext) <= {"id", "ttl_s"}:
            raise _error(f"'{param}' must be an object with 'id' and 'ttl_s'", param)
        if "id" in in_ext:
            own = _session_id(in_ext["id"], f"{param}.id")
            if session_id is not None and own != session_id:
                raise _error(f"the {session_header} header and {param}.id disagree", param)
            session_id = own
        if "ttl_s" in in_ext:
            ttls.append((f"{param}.ttl_s", _ttl(in_ext["ttl_s"], f"{param}.ttl_s", max_ttl_s)))
    if control is not None:
        param = "nvext.cache_control"
        if not isinstance(control, dict) or control.get("type", "ephemeral") != "ephemeral":
            raise _error(f"'{param}' must be {{'type': 'ephemeral', 'ttl': '<duration>'}}", param)
        if "ttl" in control:
            ttls.append((f"{param}.ttl", _duration(control["ttl"], f"{param}.ttl", max_ttl_s)))
    header_ttl = headers.get(TTL_HEADER)
    if header_ttl is not None:
        ttls.append((TTL_HEADER, _ttl(header_ttl, TTL_HEADER, max_ttl_s)))
    if not ttls:
        return None
    if len({t for _, t in ttls}) > 1:
        names = " and ".join(n for n, _ in ttls)
        raise _error(f"{names} give different TTLs: give one", ttls[0][0])
    return SessionHint(session_id, ttls[0][1])
