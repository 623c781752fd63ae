"""Gateway configuration: one pydantic model, from a YAML/TOML file and/or flags.

workers:
  - url: http://127.0.0.1:8100          # its /kv_event_sources tells where events are
  - url: http://127.0.0.1:8101
    kv_endpoint: tcp://127.0.0.1:5557   # or explicit; bind when the engine connects
    kv_bind: true
router: quillcache                      # a registered name or "pkg.module:Class"
index: native
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from quillcache.errors import ConfigError
from quillcache.gateway.lmcache_ctl import LmcacheSettings
from quillcache.policy.budget import BURST_S, ENGINE_TOKENS_PER_S, TENANT_TOKENS_PER_S
from quillcache.policy.retention import (
    MAX_ENGINE_SHARE,
    TOUCH_MAX_INTERVAL_S,
    TOUCH_MIN_INTERVAL_S,
    TOUCH_SAFETY,
)
from quillcache.policy.targets import RETENTION_MAX_TOKENS, SESSION_MAX_TTL_S
from quillcache.state import urls as redis_urls
from quillcache.tokenization.multimodal import MultimodalConfig


class WorkerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    url: str = Field(description="base URL of the engine's HTTP server")
    kv_endpoint: str | None = Field(
        default=None, description="ZMQ endpoint of its KV events; None = ask /kv_event_sources"
    )
    replay_endpoint: str | None = None
    kv_bind: bool = Field(default=False, description="bind (the engine's PUB connects to us)")
    topic: str = ""
    dp_ranks: int = Field(default=1, ge=1)
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        le=1 << 20,
        description="its sequence slots per rank (vLLM's --max-num-seqs, SGLang's "
        "--max-running-requests) when they differ from the cost model's "
        "engine.max_num_seqs: a request waits for a slot once all are taken; None = "
        "SGLang's from its server info, else the cost model's",
    )
    events: bool = Field(default=True, description="subscribe to its KV events at all")
    hash_seed: str | None = Field(
        default=None,
        max_length=256,
        description="the engine's PYTHONHASHSEED when it sets one: vLLM derives its block "
        "hashes' NONE_HASH from it, so the parity check predicts them with it; None = vLLM's "
        "default seed ('vllm-none-hash', vLLM >= 0.32 with sha256 or sha256_cbor)",
    )

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"worker url must start with http:// or https://, got {v!r}")
        parts = urlsplit(v)
        try:
            parts.port  # noqa: B018 (parses it: a port that is not a number raises)
        except ValueError:
            raise ValueError(f"worker url {v!r}: the port is not a number up to 65535") from None
        if not parts.hostname or any(c.isspace() for c in v):
            raise ValueError(f"worker url {v!r} has no valid host name or address")
        return v.rstrip("/")


class ApiKeyConfig(BaseModel):
    """One accepted API key, kept hashed: `sha256` is the hex SHA-256 of the key
    (`quillcache secret hash-key`). A plain `key` (or a bare string in `api_keys`) is
    accepted too and hashed at load, for keys given on the command line."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    sha256: str | None = Field(default=None, description="hex SHA-256 of the key")
    key: str | None = Field(default=None, description="the key itself (prefer sha256)")
    tenant: str | None = Field(default=None, description="the tenant this key authenticates")

    @model_validator(mode="before")
    @classmethod
    def _bare_key(cls, v: Any) -> Any:
        return {"key": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _one_form(self) -> ApiKeyConfig:
        if (self.sha256 is None) == (self.key is None):
            raise ValueError("an API key needs exactly one of 'sha256' or 'key'")
        if self.sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", self.sha256):
            raise ValueError("'sha256' must be 64 hex digits (the SHA-256 of the key)")
        if self.key is not None and not self.key.strip():
            raise ValueError("an API key must not be empty")
        if self.tenant is not None and not (0 < len(self.tenant) <= 128):
            raise ValueError("'tenant' must be 1-128 characters")
        return self

    @property
    def digest(self) -> str:
        if self.sha256 is not None:
            return self.sha256.lower()
        assert self.key is not None
        return hashlib.sha256(self.key.encode()).hexdigest()


class ReplicationSettings(BaseModel):
    """Hot-prefix replication in the gateway (docs/policy.md, Replication)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = Field(
        default=False,
        description="replicate hot prefixes; off by default: the copies spend engines' prefill",
    )
    min_rate: float = Field(
        default=2.0, gt=0, description="requests a second that make a prefix hot"
    )
    min_blocks: int = Field(default=4, ge=1, description="the shortest prefix worth a replica")
    half_life_s: float = Field(default=5.0, gt=0, description="of the decayed request rate")
    max_anchors: int = Field(default=4096, ge=1, description="prefixes whose heat is tracked")
    max_tokens: int = Field(
        default=1 << 20, ge=0, description="prompt tokens kept for the hot prefixes, in all"
    )
    high_wait_s: float = Field(
        default=0.1, ge=0, description="every holder waits longer: the prefix is overloaded"
    )
    low_wait_s: float = Field(
        default=0.05, ge=0, description="an engine waiting less is idle; a holder less: done"
    )
    cooldown_s: float = Field(
        default=1.0, ge=0, description="one replica of a prefix at most this often"
    )
    max_replicas: int = Field(default=3, ge=0, description="extra replicas of one prefix at a time")
    output_tokens: int = Field(
        default=64,
        ge=1,
        description="the decode length assumed when a full engine's slot wait is estimated",
    )

    @model_validator(mode="after")
    def _marks(self) -> ReplicationSettings:
        if self.low_wait_s > self.high_wait_s:
            raise ValueError(
                f"low_wait_s ({self.low_wait_s}) must not exceed high_wait_s ({self.high_wait_s})"
            )
        return self


class PolicyConfig(BaseModel):
    """The policy engine (docs/policy.md): pins, session retention, and the budget of
    the warm requests it sends engines."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    interval_s: float = Field(default=1.0, gt=0, le=60, description="how often it decides")
    pin_default_ttl_s: float = Field(
        default=86400.0, gt=0, description="a pin's TTL when the request names none"
    )
    pin_max_ttl_s: float = Field(
        default=30 * 86400.0, gt=0, description="the longest TTL a pin may ask for; above: a 400"
    )
    pin_budget_tokens: int = Field(
        default=65536, ge=0, description="tokens each tenant may keep pinned; beyond: a 409"
    )
    session_max_ttl_s: float = Field(
        default=SESSION_MAX_TTL_S,
        gt=0,
        description="the longest retention a session hint may ask for; above: a 400",
    )
    retention_max_tokens: int = Field(
        default=RETENTION_MAX_TOKENS,
        ge=0,
        description="the prompt tokens kept for pins and sessions under retention, in all",
    )
    engine_tokens_per_s: float = Field(
        default=ENGINE_TOKENS_PER_S,
        ge=0,
        description="prefill tokens a second its warm requests may cost one engine",
    )
    tenant_tokens_per_s: float = Field(
        default=TENANT_TOKENS_PER_S,
        ge=0,
        description="prefill tokens a second its warm requests may spend for one tenant",
    )
    budget_burst_s: float = Field(
        default=BURST_S, gt=0, description="the buckets hold this many seconds of their rate"
    )
    holder_max_wait_s: float = Field(
        default=1.0,
        ge=0,
        description="a pinned prefix's holder is preferred while its estimated queue wait "
        "is at most this",
    )
    touch_min_interval_s: float = Field(
        default=TOUCH_MIN_INTERVAL_S,
        gt=0,
        description="the most often one holder of a target is touched",
    )
    touch_max_interval_s: float = Field(
        default=TOUCH_MAX_INTERVAL_S,
        gt=0,
        description="a holder under no eviction pressure: this often",
    )
    touch_safety: float = Field(
        default=TOUCH_SAFETY,
        gt=0,
        le=1,
        description="touch within this share of the time the holder's LRU takes to turn over",
    )
    retention_max_engine_share: float = Field(
        default=MAX_ENGINE_SHARE,
        gt=0,
        le=1,
        description="the share of an engine's KV capacity retention keeps at most (pins "
        "first, then the latest sessions; the rest is left to the engine's LRU)",
    )
    timeout_s: float = Field(default=30.0, gt=0, description="one warm request at most")
    max_concurrent: int = Field(default=8, ge=1, description="warm requests in flight at most")
    replication: ReplicationSettings = Field(
        default_factory=ReplicationSettings, description="hot-prefix replication"
    )
    lmcache: LmcacheSettings | None = Field(
        default=None,
        description="LMCache's controller: replicas copied from an offloaded copy "
        "(/move) and the admin's /clear (docs/policy.md); None: not used",
    )


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    workers: list[WorkerConfig] = Field(default_factory=list)
    router: str = "quillcache"
    router_options: dict[str, Any] = Field(default_factory=dict)
    index: str = "native"
    index_options: dict[str, Any] = Field(default_factory=dict)
    block_size: int | None = Field(default=None, ge=1, description="None = ask the engines")
    tokenizer: str = Field(
        default="engine",
        description="'engine' (its /tokenize), 'builtin' (engine-sim's), or a tokenizer.json",
    )
    tokenizer_id: str = Field(default="", description="tokenizer identity in the namespace")
    multimodal: MultimodalConfig = Field(
        default_factory=MultimodalConfig,
        description="chat images: their keys, and which image URLs may be fetched "
        "(docs/gateway.md, Multimodal prompts)",
    )
    tenant_header: str = "x-tenant-id"
    session_header: str = "x-session-id"
    admin_token: str | None = None
    api_keys: list[ApiKeyConfig] = Field(
        default_factory=list, description="accepted API keys (none: no key needed)"
    )
    kv_publishers: list[str] | None = Field(
        default=None,
        description="addresses or CIDRs that may publish to a KV-event socket the gateway "
        "binds (kv_bind); None: each engine's own host",
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="addresses or CIDRs whose tenant_header is honoured (none: never)",
    )
    secret_file: str | None = Field(
        default=None,
        description="the gateway secret behind tenants' cache salts (None: the default "
        "path, see quillcache.gateway.secret); identical on every replica of a fleet",
    )
    speculative_ttl_s: float = Field(default=5.0, gt=0)
    health_interval_s: float = Field(default=1.0, gt=0)
    health_failures_to_down: int = Field(default=2, ge=1)
    scrape_interval_s: float = Field(default=1.0, gt=0)
    request_timeout_s: float = Field(default=600.0, gt=0)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    first_byte_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="the least time an engine gets for its answer's head (a stream: its first "
        "frame), and for a /tokenize answer, before it counts as hung: marked down, the "
        "request retried elsewhere once",
    )
    first_byte_multiplier: float = Field(
        default=4.0,
        ge=0,
        description="a request's first-byte limit is the larger of first_byte_timeout_s and "
        "this times the cost model's estimate of its prefill (uncached tokens) and decode",
    )
    stall_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="the longest silence of an engine between two chunks of an answer: the "
        "stream ends with an SSE error (a whole answer: a 502) and the engine is marked down",
    )
    max_connections: int = Field(default=1024, ge=1)
    max_body_bytes: int = Field(default=32 << 20, ge=1024, le=1 << 40)
    max_prompt_bytes: int = Field(
        default=4 << 20,
        ge=1024,
        description="a completion's prompt (or a chat's message texts) larger than this, in "
        "UTF-8 bytes, gets a 400 before it is tokenized; keep it above the longest context "
        "any served model takes (max_model_len x bytes per token)",
    )
    event_queue_size: int = Field(default=10_000, ge=1)
    event_queue_bytes: int = Field(default=256 << 20, ge=1 << 16)
    replay_timeout_s: float = Field(default=2.0, gt=0)
    stale_rebuild_s: float = Field(default=30.0, ge=0)
    event_quiet_tail_s: float = Field(
        default=1.0,
        ge=0,
        description="ask a source's replay socket once it is quiet this long after traffic "
        "(its last batches may be lost with nothing after them); 0 = never",
    )
    parity_check: bool = True
    relay: Literal["native", "python"] = Field(
        default="native",
        description="the data path: 'native' (the Rust relay serves the port, Python decides) "
        "or 'python' (everything in the Starlette app)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    state: str = Field(
        default="local",
        description="'local' (this process's own load and admin changes) or "
        "'redis://host:port/db' (several replicas share them, docs/state.md)",
    )
    state_prefix: str = Field(
        default="quillcache", description="the fleet's key prefix in Redis (one per fleet)"
    )
    state_lease_ttl_s: float = Field(
        default=3.0, gt=0, description="a dead replica's booked load lapses within this"
    )
    state_budget_s: float = Field(
        default=0.010, gt=0, description="a booking slower than this falls back to local state"
    )
    state_poll_s: float = Field(
        default=0.25, gt=0, description="how often the fleet's load and admin changes are read"
    )
    state_shortlist: int = Field(
        default=4, ge=1, description="candidates a booking offers Redis (the router's first)"
    )
    state_cache_slack: float = Field(
        default=4.0,
        ge=0,
        description="how many requests more than it saw a candidate holding the whole prefix "
        "may take before a booking moves on (quillcache/state/shortlist.py)",
    )
    bootstrap_from: list[str] = Field(
        default_factory=list,
        description="peer replicas' base URLs (tried in order) whose index snapshot this "
        "replica loads at start-up before subscribing (docs/gateway.md, 'Cold start from a "
        "peer'); needs index: native",
    )
    bootstrap_discover: bool = Field(
        default=True,
        description="with state: redis and no bootstrap_from, take the snapshot from a ready "
        "peer advertised in Redis",
    )
    bootstrap_token: str | None = Field(
        default=None, description="the peers' admin token (None: this replica's admin_token)"
    )
    bootstrap_timeout_s: float = Field(
        default=10.0, gt=0, description="the longest a peer's whole snapshot transfer may take"
    )
    bootstrap_max_bytes: int = Field(
        default=4 << 30, ge=1 << 10, description="a peer snapshot larger than this is refused"
    )
    advertise_url: str | None = Field(
        default=None,
        description="the base URL peers reach this replica's admin API at (state: redis "
        "advertises it while ready); None: http://host:port when host is one address",
    )

    slo_hints: Literal["tighten", "honour", "ignore"] = Field(
        default="tighten",
        description="what a client's SLO hint (x-slo-ttft-ms / x-slo-tbt-ms, or the body's "
        "quillcache.slo) does: 'tighten' may only lower the default SLO's bounds "
        "(router_options ttft_slo_s / tbt_slo_s; slo_trusted_tenants set theirs as given), "
        "'honour' takes it as given, 'ignore' checks then drops it (docs/gateway.md, SLOs)",
    )
    slo_trusted_tenants: list[str] = Field(
        default_factory=list,
        description="authenticated tenants whose SLO hints are taken as given under "
        "slo_hints: tighten (they may loosen the default)",
    )
    slo_max_ms: float = Field(
        default=600_000.0,
        gt=0,
        allow_inf_nan=False,
        description="the largest SLO hint accepted, in milliseconds; above it: a 400",
    )

    policy: PolicyConfig = Field(default_factory=PolicyConfig)

    slo_admission: Literal["reject", "queue"] = Field(
        default="reject",
        description="a request whose SLO the chosen engine's queue makes it miss: 'reject' "
        "(429 + Retry-After at once) or 'queue' (it waits, in `priority` order, while "
        "what is left of its SLO can still be met; then 429)",
    )
    slo_queue_max: int = Field(
        default=1024, ge=1, description="requests waiting in the SLO queue at most; beyond: 429"
    )
    slo_queue_tick_s: float = Field(
        default=0.01,
        gt=0,
        le=1.0,
        description="how often waiting requests are retried, in priority order",
    )

    @field_validator("state")
    @classmethod
    def _state(cls, v: str) -> str:
        if v == "local":
            return v
        try:
            return redis_urls.checked(v)
        except ValueError as exc:
            raise ValueError(f"state must be 'local' or a Redis URL: {exc}") from None

    @model_validator(mode="after")
    def _each_worker_once(self) -> GatewayConfig:
        seen: set[str] = set()
        for w in self.workers:
            if w.url in seen:
                raise ValueError(f"workers lists {w.url} twice: one engine is one worker")
            seen.add(w.url)
        return self

    @model_validator(mode="after")
    def _replicas_need_bound_engines(self) -> GatewayConfig:
        if self.state != "local":
            bound = [w.url for w in self.workers if w.kv_bind]
            if bound:
                raise ValueError(
                    f"kv_bind: true (workers {', '.join(bound)}) cannot work with a shared "
                    "state: an engine publisher that connects to one gateway cannot serve "
                    "several replicas; configure those engines to bind their KV-event socket "
                    "(e.g. tcp://*:5557), set kv_bind: false (or give their kv_endpoint), "
                    "or run this gateway with state: local"
                )
        return self

    @model_validator(mode="after")
    def _bootstrap_needs_native(self) -> GatewayConfig:
        if self.bootstrap_from and self.index != "native":
            raise ValueError(
                f"bootstrap_from needs index: native (the peer snapshot is the native "
                f"index's image), not {self.index!r}; a native-wal replica resumes from "
                "its own log instead"
            )
        for url in self.bootstrap_from:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"bootstrap_from: {url!r} is not an http(s):// URL")
        return self

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        return _check_networks(v)

    @field_validator("kv_publishers")
    @classmethod
    def _publishers(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else _check_networks(v)


def _check_networks(values: list[str]) -> list[str]:
    for v in values:
        try:
            ipaddress.ip_network(v, strict=False)
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address or CIDR") from None
    return values


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text: {exc}") from None
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {path}: use .yaml, .yml, .toml or .json")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid: {exc}") from exc
    except Exception as exc:
        if type(exc).__module__.startswith("yaml"):
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        raise
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def load_config(path: str | Path | None = None, **overrides: Any) -> GatewayConfig:
    """The file's settings, then every override that is not None; errors say which field."""
    data = _read_file(Path(path)) if path else {}
    for key, value in overrides.items():
        if value is not None:
            data[key] = value
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid gateway config: {problems}") from None
