"""What the shared fleet state takes and returns: engine keys, shortlist candidates,
per-engine load, and the typed results of every operation (shared, or a local
fallback that says why)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from quillcache.errors import ConfigError, QuillCacheError


class StateError(QuillCacheError):
    """The shared fleet state cannot be used as configured."""


class SecretMismatchError(StateError, ConfigError):
    """This replica's tenant-salt secret is not the one the fleet in Redis uses."""


class EngineKey(NamedTuple):
    """One routable row of the fleet: an engine and one of its data-parallel ranks."""

    engine: int
    rank: int = 0

    def encode(self) -> str:
        return f"{self.engine}:{self.rank}"

    @classmethod
    def decode(cls, text: str) -> EngineKey:
        engine, _, rank = text.partition(":")
        try:
            return cls(int(engine), int(rank or 0))
        except ValueError:
            raise StateError(f"malformed engine key {text!r} in the shared state") from None


@dataclass(frozen=True, slots=True)
class Candidate:
    """A shortlist entry: the engine, and the load (in `LoadWeights` units) at or above
    which it stops being preferred. `math.inf`: never too loaded. `credit`: the load it
    is worth more when the booking finds the request's prefix being computed there
    (all of it; in proportion to the part), so a prefix one replica started is reused
    by the others' requests as far as the router would."""

    engine: EngineKey
    ceiling: float = math.inf
    credit: float = 0.0
    # the request's leading blocks it holds, when known: the booking then books its
    # prefill there as the prompt beyond them (or beyond what it is computing of it)
    cached_blocks: int | None = None


#: Hex characters per block fingerprint in an anchor's tail (`Anchor.tail`); the
#: scripts compare tails in steps of this many characters.
TAIL_FP_CHARS = 4
#: The most blocks an anchor's tail covers: a longer stretch up to the next anchor is
#: cut (the shared depth found is then at most this far past the anchor).
TAIL_MAX_BLOCKS = 128


class Anchor(NamedTuple):
    """One of a request's speculative-placement anchors (docs/state.md, "Anchors"):
    the content key naming its prefix of `blocks` blocks, and `tail`, fingerprints of
    the blocks after it up to the request's next anchor (`TAIL_FP_CHARS` hex
    characters each, at most `TAIL_MAX_BLOCKS`), by which another request sharing the
    anchor finds how far past it the two prompts stay equal."""

    key: int
    blocks: int
    tail: str = ""


class Computing(NamedTuple):
    """Where an engine stands among those computing a request's prefix now: the longest
    of the request's anchors being computed there, and the engine's place among the
    live engines computing that anchor in the order they were first placed on it (0:
    the first). Engines computing the same depth are taken in that order by every
    replica alike, so a prefix that overflowed once to a second engine keeps following
    its first."""

    blocks: int
    rank: int = 0


@dataclass(frozen=True, slots=True)
class OutsideTerms:
    """What an engine outside the shortlist is worth when the booking finds it bound to
    the request's session or computing the request's prefix (docs/state.md, "Outside
    the shortlist"), in `LoadWeights` units: `ceiling` is that of a candidate holding
    none of the request's prefix, `credit` what holding or computing all of it adds. A
    session-bound engine is taken as a holder of the whole prefix (ceiling + credit);
    one computing a part of the prefix gets `ceiling` raised by `credit` times that part,
    as a listed candidate's `Candidate.credit`."""

    ceiling: float
    credit: float = 0.0

    def __post_init__(self) -> None:
        if math.isnan(self.ceiling) or math.isnan(self.credit) or self.credit < 0:
            raise ConfigError(
                f"outside terms need a ceiling and a credit >= 0, got {self.ceiling!r}, "
                f"{self.credit!r}"
            )


@dataclass(frozen=True, slots=True)
class LoadWeights:
    """How the booking step turns an engine's shared load into the one number compared
    with a candidate's ceiling: `in_flight * in_flight + queued_prefill_tokens *
    queued_tokens + running_decodes * decodes`. The default counts requests in flight."""

    in_flight: float = 1.0
    queued_tokens: float = 0.0
    decodes: float = 0.0

    def __post_init__(self) -> None:
        for name in ("in_flight", "queued_tokens", "decodes"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ConfigError(f"LoadWeights.{name} must be finite and >= 0, got {v}")

    def score(self, load: SharedLoad) -> float:
        return (
            self.in_flight * load.in_flight
            + self.queued_tokens * load.queued_prefill_tokens
            + self.decodes * load.running_decodes
        )


@dataclass(frozen=True, slots=True)
class SharedLoad:
    """The booked load of one engine key, summed over the fleet's live replicas."""

    in_flight: int = 0
    queued_prefill_tokens: int = 0
    running_decodes: int = 0
    context_tokens: int = 0  # sum over the running decodes
    queued_prefill_pairs: int = 0  # the queued prefill's attention pairs (`prefill_pairs`)

    @property
    def mean_context_tokens(self) -> float:
        return self.context_tokens / self.running_decodes if self.running_decodes else 0.0


ZERO_LOAD = SharedLoad()


@dataclass(frozen=True, slots=True)
class Booked:
    """The booking step ran in Redis: `engine` is booked under this replica's lease."""

    engine: EngineKey
    index: int  # position of `engine` in the shortlist; -1: an engine outside it
    reason: str  # "session", "pending", "under" (first under its ceiling), "over", "retry"
    loads: tuple[SharedLoad, ...]  # the shortlist's shared load before this booking
    prefill_tokens: int = 0  # the prefill booked there (queued prefill tokens it adds)
    shared: bool = True


@dataclass(frozen=True, slots=True)
class Shared:
    """An operation applied to the shared state."""

    detail: str = "ok"
    shared: bool = True


@dataclass(frozen=True, slots=True)
class LocalFallback:
    """Redis was not used (unreachable, slower than the budget, or an error): the
    operation was applied to this replica's own book only; `engine` is the local choice
    of a booking (None for other operations). It is resynchronised when Redis is back."""

    reason: str
    engine: EngineKey | None = None
    prefill_tokens: int = 0  # a booking's: the prefill booked locally
    shared: bool = False


@dataclass(frozen=True, slots=True)
class PinRecord:
    """What warming a pinned prefix takes: its tokens (whole blocks), the model and the
    owner's derived salt it is sent with."""

    model: str
    salt: str | None
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """What the admin API changed at run time, as the fleet sees it."""

    version: int
    engines: Mapping[int, Mapping[str, object]]
    draining: frozenset[EngineKey]
    pins: Mapping[int, str]  # prefix key -> owner tenant


@dataclass
class StateStats:
    """Counters for the gateway's /metrics (plain numbers: the caller exports them)."""

    fallbacks: dict[str, int] = field(default_factory=dict)  # by operation
    timeouts: int = 0
    disconnects: int = 0
    reconnects: int = 0
    resyncs: int = 0
    lost_leases: int = 0  # Redis did not hold this replica's lease (restart, or a pause)
    booked: int = 0
    fell_back_bookings: int = 0
    # request ends (releases, prefills done), batched: sent, applied by Redis, unknown
    # to Redis (booked while it was not in use, or resynchronised meanwhile), and the
    # round trips of their own (the others rode on a booking)
    ends_sent: int = 0
    ends_applied: int = 0
    ends_unknown: int = 0
    end_batches: int = 0
    # router shortlists that broke the contract, booked with the derived one instead
    bad_shortlists: int = 0

    def fallback(self, op: str) -> None:
        self.fallbacks[op] = self.fallbacks.get(op, 0) + 1
