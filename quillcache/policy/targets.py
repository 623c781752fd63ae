"""Retention targets: the prefixes the policy engine keeps warm, with what it takes to
warm them.

The index keeps no token ids, but warming a prefix on an engine means sending it as a
prompt, so each target keeps its tokens, the served model name to send them with and
the owner tenant's derived `cache_salt` (a warm request without it would fill another
namespace). The store is bounded: by the tokens it keeps in all, and per tenant by
that tenant's pin budget; a target past its TTL is gone.

Two kinds of target are kept here (a third, a hot prefix's replica, is only sent):
- a **pin** (`POST /admin/pins`): named by its last content key, owned by a tenant;
- a **session** (a request's session id with a retention TTL hint): named by the
  tenant and session id; each turn replaces the session's prefix with its own prompt
  and records the engine that served it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from quillcache.errors import QuillCacheError

KeyArray = npt.NDArray[np.uint64]

#: The store's default bound in prompt tokens, and the longest retention a session hint
#: may ask for (the gateway's `PolicyConfig`, the simulator's `RetainSettings`).
RETENTION_MAX_TOKENS = 4 << 20
SESSION_MAX_TTL_S = 3600.0


class TargetKind(enum.Enum):
    PIN = "pin"
    SESSION = "session"
    HOT = "hot"  # a hot prefix's replica (`policy.hot`): sent once, never stored here


#: A target's name: (kind, tenant, pin's last key or session id).
TargetId = tuple[TargetKind, str, str]


class TargetBudgetError(QuillCacheError):
    """A target does not fit its tenant's budget or the store's bound; `limit` names
    the setting."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass
class Target:
    """A prefix to keep warm: its chained content keys, the tokens they were made from
    (whole blocks), the model and salt to send them with, its owner and expiry."""

    kind: TargetKind
    tenant: str
    name: str  # the pin's last key (decimal) or the session id
    keys: KeyArray
    token_ids: list[int]
    model: str
    salt: str | None
    expires_s: float  # monotonic
    engine: int | None = None  # a session's engine (the last turn's)
    # per engine: when the policy last warmed the prefix there (monotonic)
    touched_s: dict[int, float] = field(default_factory=dict)

    @property
    def id(self) -> TargetId:
        return (self.kind, self.tenant, self.name)

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


class TargetStore:
    """The targets, bounded by `max_tokens` in all and, for pins, by
    `pin_budget_tokens` per tenant."""

    def __init__(self, *, max_tokens: int, pin_budget_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.pin_budget_tokens = pin_budget_tokens
        self._targets: dict[TargetId, Target] = {}
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._targets)

    def __iter__(self) -> Iterator[Target]:
        return iter(list(self._targets.values()))

    @property
    def tokens(self) -> int:
        return self._tokens

    def get(self, target_id: TargetId) -> Target | None:
        return self._targets.get(target_id)

    def tenant_tokens(self, kind: TargetKind, tenant: str) -> int:
        targets = self._targets.values()
        return sum(t.tokens for t in targets if t.kind is kind and t.tenant == tenant)

    def put(self, target: Target) -> Target | None:
        """Add `target` (replacing the one of the same id, which is returned); a
        `TargetBudgetError` naming the limit when it does not fit, the store unchanged."""
        old = self._targets.get(target.id)
        freed = old.tokens if old is not None else 0
        if target.kind is TargetKind.PIN:
            used = self.tenant_tokens(TargetKind.PIN, target.tenant) - freed
            if used + target.tokens > self.pin_budget_tokens:
                raise TargetBudgetError(
                    f"tenant {target.tenant!r} pins {used} tokens; {target.tokens} more exceed "
                    f"its pin budget of {self.pin_budget_tokens} tokens (pin_budget_tokens)",
                    "pin_budget_tokens",
                )
        if self._tokens - freed + target.tokens > self.max_tokens:
            raise TargetBudgetError(
                f"the retention store holds {self._tokens - freed} tokens; {target.tokens} more "
                f"exceed its bound of {self.max_tokens} (retention_max_tokens)",
                "retention_max_tokens",
            )
        self._targets[target.id] = target
        self._tokens += target.tokens - freed
        return old

    def remove(self, target_id: TargetId) -> Target | None:
        target = self._targets.pop(target_id, None)
        if target is not None:
            self._tokens -= target.tokens
        return target

    def expire(self, now_s: float) -> list[Target]:
        """Remove and return the targets whose TTL lapsed by `now_s`."""
        gone = [t for t in self._targets.values() if t.expires_s <= now_s]
        for t in gone:
            self.remove(t.id)
        return gone
