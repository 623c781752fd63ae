"""A client of LMCache's cache controller (`lmcache/v1/api_server/__main__.py`, LMCache
0.5.6): the calls the policy engine and the admin API make, with their request and
answer shapes, a timeout each, typed errors and counts (docs/policy.md, "LMCache's
controller").

- `lookup(tokens)` -> `{instance_id: (location, end)}`: for each chunk of the tokens
  (256-token chunks, the controller's own token database) the first registered
  instance holding it, up to the first chunk held nowhere;
- `move(src, dst, tokens, copy)` -> `(event_id, num_tokens)`: the source's chunks of
  the tokens sent to the destination's CPU tier over LMCache's P2P backend, answered once
  sent; `num_tokens` 0: the source had none of them;
- `clear(instance, location)` -> `(event_id, num_tokens)`: every unpinned chunk of the
  location, every tenant's;
- `check_finish(event_id)` -> the event's status, or None where the controller does
  not implement it (LMCache 0.5.6: always a 500 with an empty detail).

Every failure of the controller is a 500 whose `detail` is the error text; a body it
cannot parse is a 422 (FastAPI). Both become `LmcacheError` with the status and detail.
"""

from __future__ import annotations

import collections
import json
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, field_validator

#: LMCache's name for its CPU tier (`CreateStorageBackends`): where moves go.
CPU_LOCATION = "LocalCPUBackend"


def indexed_medium(location: str) -> str | None:
    """The medium under which the index keeps what LMCache holds at `location`: its CPU
    tier is reported in the engine's KV events as medium "cpu" (in-process LMCache) or
    "CPU" (its multiprocess server), one medium; no other tier is reported (None)."""
    return "CPU" if location == CPU_LOCATION else None


class LmcacheSettings(BaseModel):
    """Where LMCache's controller is and which engine is which LMCache instance."""

    model_config = ConfigDict(extra="forbid")

    controller: str = Field(description="base URL of LMCache's controller API server")
    instances: dict[str, str] = Field(
        default_factory=dict,
        description="engine base URL -> its LMCache instance id (lmcache_instance_id)",
    )
    location: str = Field(
        default=CPU_LOCATION, description="the tier replicas are copied from and cleared"
    )
    timeout_s: float = Field(default=10.0, gt=0, description="one controller call at most")
    min_move_tokens: int = Field(
        default=256, ge=1, description="a smaller offloaded copy is recomputed, not moved"
    )

    @field_validator("controller")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"controller must start with http:// or https://, got {v!r}")
        return v.rstrip("/")

    @field_validator("instances")
    @classmethod
    def _urls(cls, v: dict[str, str]) -> dict[str, str]:
        return {url.rstrip("/"): inst for url, inst in v.items()}


class LmcacheError(Exception):
    """A controller call that failed: `status` 0 for no answer (timeout, connection)."""

    def __init__(self, call: str, status: int, detail: str) -> None:
        super().__init__(f"LMCache controller {call}: {status or 'no answer'}: {detail}")
        self.call = call
        self.status = status
        self.detail = detail


class LmcacheController:
    def __init__(self, session: aiohttp.ClientSession, settings: LmcacheSettings) -> None:
        self._session = session
        self.settings = settings
        # (call, result): result "ok", "error" (an answer other than 200), "timeout",
        # "unreachable"
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def instance_of(self, engine_url: str) -> str | None:
        return self.settings.instances.get(engine_url.rstrip("/"))

    async def lookup(self, tokens: list[int]) -> dict[str, tuple[str, int]]:
        body = await self._post("lookup", {"tokens": tokens})
        layout = body.get("layout_info")
        if not isinstance(layout, dict):
            raise LmcacheError("lookup", 200, f"no layout_info in {body!r:.200}")
        out: dict[str, tuple[str, int]] = {}
        for inst, where in layout.items():
            if not (isinstance(where, list) and len(where) == 2 and isinstance(where[1], int)):
                raise LmcacheError("lookup", 200, f"bad layout_info entry {where!r:.100}")
            out[str(inst)] = (str(where[0]), where[1])
        return out

    async def move(
        self, src: tuple[str, str], dst: tuple[str, str], tokens: list[int], copy: bool
    ) -> tuple[str, int]:
        body = await self._post(
            "move",
            {
                "old_position": list(src),
                "new_position": list(dst),
                "tokens": tokens,
                "should_copy": copy,
            },
        )
        return self._event_tokens("move", body)

    async def clear(self, instance_id: str, location: str) -> tuple[str, int]:
        body = await self._post("clear", {"instance_id": instance_id, "location": location})
        return self._event_tokens("clear", body)

    async def check_finish(self, event_id: str) -> str | None:
        """The event's status; None where the controller cannot tell (LMCache 0.5.6
        implements no event tracking: a 500 with an empty detail)."""
        try:
            body = await self._post("check_finish", {"event_id": event_id})
        except LmcacheError as exc:
            if exc.status == 500 and not exc.detail:
                return None
            raise
        status = body.get("status")
        if not isinstance(status, str):
            raise LmcacheError("check_finish", 200, f"no status in {body!r:.200}")
        return status

    @staticmethod
    def _event_tokens(call: str, body: dict[str, Any]) -> tuple[str, int]:
        event, tokens = body.get("event_id"), body.get("num_tokens")
        if not isinstance(event, str) or not isinstance(tokens, int) or tokens < 0:
            raise LmcacheError(call, 200, f"expected event_id and num_tokens: {body!r:.200}")
        return event, tokens

    async def _post(self, call: str, body: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.settings.controller}/{call}"
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
        try:
            async with self._session.post(url, json=body, timeout=timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError:
            self.calls[(call, "timeout")] += 1
            raise LmcacheError(call, 0, f"no answer in {self.settings.timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            self.calls[(call, "unreachable")] += 1
            raise LmcacheError(call, 0, type(exc).__name__) from None
        try:
            answer = _json_object(raw)
        except ValueError:
            self.calls[(call, "error")] += 1
            raise LmcacheError(call, status, raw[:200].decode("utf-8", "replace")) from None
        if status != 200:
            self.calls[(call, "error")] += 1
            detail = answer.get("detail", "")
            raise LmcacheError(call, status, detail if isinstance(detail, str) else str(detail))
        self.calls[(call, "ok")] += 1
        return answer


def _json_object(raw: bytes) -> dict[str, Any]:
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value
