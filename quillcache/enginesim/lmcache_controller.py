"""LMCache's cache controller over the simulated engines' LMCache tiers
(`engine-sim --lmcache vllm --lmcache-controller`): its HTTP API, request for request and
error for error as LMCache 0.5.6 answers (`lmcache/v1/api_server/__main__.py`, the
executor `lmcache/v1/cache_controller/executor.py`, the worker
`lmcache/v1/cache_controller/worker.py`, the engine `lmcache/v1/cache_engine.py`).

The API is FastAPI's: a request body that does not validate is a 422 with pydantic's
error list under `detail`; every failure of an operation is a 500 whose `detail` is the
error's text, which is often not the cause:

- an instance the controller does not know has no workers; the executor then asserts
  that all (none) of its workers agree and fails with "The number of tokens <op> should
  be the same across all workers.";
- a worker's own failure reaches the executor as an `ErrorMsg` without `num_tokens`;
  the `AttributeError` that follows is reported as "Operation '<op>' is not supported.";
- `/check_finish` is not implemented (`NotImplementedError()`): always a 500 whose
  `detail` is empty. `/move` answers only once the worker's P2P transfer returned.

What each operation does to the instances' tiers (`LmcacheCpuTier`):

- `/lookup {tokens}`: the controller hashes the tokens itself with a default token
  database (256-token chunks, hard-coded in `KVController.__init__`) and, chunk by chunk
  until one is held nowhere, names the first registered instance holding it:
  `{event_id, layout_info: {instance_id: [location, end]}}`, `end` the token count up to
  that instance's last chunk. An instance with another chunk size matches nothing, and a
  prefix two instances hold is reported on the first only.
- `/move {old_position, new_position, tokens, should_copy}`: the source worker looks the
  tokens up in `old_position`'s location with `pin=True` (the chunks found get a pin
  that nothing releases: `LMCacheEngine.move` never calls `lookup_unpin`), sends them to
  the destination's P2P backend, which stores the chunks it does not hold in its CPU tier
  (no KV event: LMCache makes those in `store` only), and, without `should_copy`, drops
  them at the source. Answers `{event_id, num_tokens}`, the tokens found at the source
  (0: nothing moved). Only into `LocalCPUBackend`; a move within one instance is not
  implemented; a destination without P2P is refused.
- `/clear {instance_id, location}`: every chunk of the location that can be evicted
  (pinned ones stay), `{event_id, num_tokens}` the tokens dropped; no event either.
- `/pin {instance_id, location, tokens}`: a lookup with `pin=True`, `{event_id,
  num_tokens}`; no unpin exists.
- `/health {instance_id}`: `{event_id, error_codes: {worker_id: 0}}`.

The controller here reads the tiers directly; LMCache's learns of its workers' chunks
from their batched admit/evict messages, a moment later.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from quillcache.enginesim.lmcache import CPU_LOCATION, LmcacheCpuTier, chunk_hashes

#: The chunk size LMCache's controller hashes `/lookup` tokens with (its default token
#: database, whatever its workers' chunk size).
CONTROLLER_CHUNK_SIZE = 256
WORKER_ID = 0  # one worker (TP rank) per instance here


class ControllerError(Exception):
    """An operation failed: a 500 with this text as `detail`."""


@dataclass
class Instance:
    """One LMCache instance (one engine) registered with the controller."""

    instance_id: str
    tier: LmcacheCpuTier
    p2p: bool = True  # LMCache's P2P backend on (a move's destination needs it)


class LookupRequest(BaseModel):
    tokens: list[int]


class ClearRequest(BaseModel):
    instance_id: str
    location: str


class PinRequest(BaseModel):
    instance_id: str
    location: str
    tokens: list[int]


class MoveRequest(BaseModel):
    old_position: tuple[str, str]
    new_position: tuple[str, str]
    tokens: list[int] | None = []
    should_copy: bool | None = False


class HealthRequest(BaseModel):
    instance_id: str


class CheckFinishRequest(BaseModel):
    event_id: str


def _agree(op: str) -> ControllerError:
    """An instance without workers: the executor's consistency assertion fails."""
    return ControllerError(f"The number of tokens {op} should be the same across all workers.")


class LmcacheControllerSim:
    """LMCache's controller over these instances, in their registration order."""

    def __init__(self, instances: list[Instance]) -> None:
        self.instances = {i.instance_id: i for i in instances}
        if len(self.instances) != len(instances):
            raise ValueError("LMCache instance ids must be unique")
        self.moves = 0  # moves that sent chunks
        self.moved_chunks = 0  # chunks the destinations stored

    def _instance(self, instance_id: str, op: str) -> Instance:
        inst = self.instances.get(instance_id)
        if inst is None:
            raise _agree(op)
        return inst

    # -- the operations --------------------------------------------------------------

    def lookup(self, tokens: list[int]) -> dict[str, tuple[str, int]]:
        layout: dict[str, tuple[str, int]] = {}
        end = 0
        for i, h in enumerate(chunk_hashes(tokens, CONTROLLER_CHUNK_SIZE)):
            holder = next((x for x in self.instances.values() if h in x.tier), None)
            if holder is None:
                break
            end = min((i + 1) * CONTROLLER_CHUNK_SIZE, len(tokens))
            layout[holder.instance_id] = (CPU_LOCATION, end)
        return layout

    def move(self, req: MoveRequest) -> int:
        src_id, src_location = req.old_position
        dst_id, dst_location = req.new_position
        src = self.instances.get(src_id)
        dst = self.instances.get(dst_id)
        if src is None or dst is None:
            raise _agree("moved")
        if not dst.p2p:
            raise ControllerError(
                f"Src worker {WORKER_ID} not registered for instance {src_id} or "
                f"dst worker {WORKER_ID} not registered for instance {dst_id} or "
                "P2P is not enabled."
            )
        tokens = req.tokens or []
        # the worker's own checks: an intra-node move is not implemented, only the CPU
        # tier receives; their failure comes back as an ErrorMsg without num_tokens
        if src is dst or dst_location != CPU_LOCATION:
            raise ControllerError("Operation 'move' is not supported.")
        if src_location != CPU_LOCATION or not tokens:
            return 0  # nothing found there: "Move is not performed"
        found, chunks = src.tier.lookup(tokens, pin=True)
        if not found:
            return 0
        if not src.p2p:  # the source's engine has no "P2PBackend" to send with
            raise ControllerError("Operation 'move' is not supported.")
        self.moves += 1
        self.moved_chunks += dst.tier.receive(tokens[:found])
        if not req.should_copy:
            src.tier.remove(chunks)
        return found

    def clear(self, req: ClearRequest) -> int:
        inst = self._instance(req.instance_id, "cleared")
        return inst.tier.clear() if req.location == CPU_LOCATION else 0

    def pin(self, req: PinRequest) -> int:
        inst = self._instance(req.instance_id, "pinned")
        if req.location != CPU_LOCATION:
            return 0
        return inst.tier.lookup(req.tokens, pin=True)[0]

    # -- HTTP ------------------------------------------------------------------------

    def starlette(self) -> Starlette:
        def route(
            path: str,
            model: type[BaseModel],
            op: Callable[[Any], dict[str, Any]],
        ) -> Route:
            async def handler(request: Request) -> Response:
                raw = await request.body()
                try:
                    body = model.model_validate(json.loads(raw))
                except json.JSONDecodeError as exc:
                    return _unprocessable(
                        [
                            {
                                "type": "json_invalid",
                                "loc": ["body", exc.pos],
                                "msg": "JSON decode error",
                                "input": {},
                                "ctx": {"error": exc.msg},
                            }
                        ]
                    )
                except ValidationError as exc:
                    return _unprocessable(
                        [
                            {
                                **{k: v for k, v in e.items() if k != "ctx"},
                                "loc": ["body", *e["loc"]],
                            }
                            for e in exc.errors(include_url=False)
                        ]
                    )
                try:
                    return JSONResponse(op(body))
                except ControllerError as exc:
                    return JSONResponse({"detail": str(exc)}, status_code=500)

            return Route(path, handler, methods=["POST"])

        def lookup(r: LookupRequest) -> dict[str, Any]:
            return {"event_id": _event("Lookup"), "layout_info": self.lookup(r.tokens)}

        def move(r: MoveRequest) -> dict[str, Any]:
            return {"event_id": _event("Move"), "num_tokens": self.move(r)}

        def clear(r: ClearRequest) -> dict[str, Any]:
            return {"event_id": _event("Clear"), "num_tokens": self.clear(r)}

        def pin(r: PinRequest) -> dict[str, Any]:
            return {"event_id": _event("Pin"), "num_tokens": self.pin(r)}

        def health(r: HealthRequest) -> dict[str, Any]:
            codes = {str(WORKER_ID): 0} if r.instance_id in self.instances else {}
            return {"event_id": _event("health"), "error_codes": codes}

        def check_finish(r: CheckFinishRequest) -> dict[str, Any]:
            raise ControllerError("")  # NotImplementedError() in the executor

        return Starlette(
            routes=[
                route("/lookup", LookupRequest, lookup),
                route("/move", MoveRequest, move),
                route("/clear", ClearRequest, clear),
                route("/pin", PinRequest, pin),
                route("/health", HealthRequest, health),
                route("/check_finish", CheckFinishRequest, check_finish),
            ]
        )


def _event(kind: str) -> str:
    return kind + str(uuid.uuid4())


def _unprocessable(errors: list[Any]) -> JSONResponse:
    return JSONResponse({"detail": errors}, status_code=422)
