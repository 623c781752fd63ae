"""Parent hints: a client says which of its earlier requests this one follows (an
agent's call after its planner, a conversation's next turn), so the router can keep
it with its parent (`Request.parent_id`; docs/routing.md, "Sessions").

Two headers: `x-request-id` names the request (the header many clients already send;
the engine gets it too), `x-parent-request-id` names the request it follows. The
gateway keeps the latest `REMEMBERED` client ids of each namespace (a tenant's ids
cannot name another tenant's requests) mapped to its own request ids. A parent it has
not seen (sent through another replica, or forgotten) gives no hint, not an error: a
hint only steers routing. An id over `MAX_ID_CHARS` is a 400 naming the header.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from quillcache.gateway.httpio import ApiError

CLIENT_ID_HEADER = "x-request-id"
PARENT_HEADER = "x-parent-request-id"
MAX_ID_CHARS = 256
REMEMBERED = 16_384


def check_parent_headers(headers: Mapping[str, str]) -> None:
    """A 400 naming the header when a request id is longer than `MAX_ID_CHARS`."""
    for name in (CLIENT_ID_HEADER, PARENT_HEADER):
        value = headers.get(name)
        if value is not None and len(value) > MAX_ID_CHARS:
            raise ApiError(
                400,
                f"{name} must be at most {MAX_ID_CHARS} characters, got {len(value)}",
                code="invalid_parent_hint",
                param=name,
            )


class ParentIds:
    """A gateway's map from its clients' request ids, per namespace, to its own request
    ids: the latest `limit` of them."""

    def __init__(self, limit: int = REMEMBERED) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._ids: OrderedDict[tuple[int, str], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def resolve(self, namespace: int, headers: Mapping[str, str], request_id: int) -> int | None:
        """The gateway's id of the request this one follows (None: no parent header, or
        a parent not seen in `namespace` or forgotten); this request is remembered under
        its own client id."""
        parent = headers.get(PARENT_HEADER)
        found = self._ids.get((namespace, parent)) if parent else None
        own = headers.get(CLIENT_ID_HEADER)
        if own:
            key = (namespace, own)
            self._ids[key] = request_id
            self._ids.move_to_end(key)
            if len(self._ids) > self.limit:
                self._ids.popitem(last=False)
        return found
