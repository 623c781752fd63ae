"""`POST /ingest/kv_events`: KV events over HTTP, for engines or bridges without ZMQ.

msgpack body = one raw batch (worker, dp_rank, seq from the query string); JSON body =
{"worker", "dp_rank", "seq"?, "batches": [batch...]} with each batch as vLLM's structure
in JSON (for humans and bridges). The answer comes once the batches are through the
ingestor's thread, which decodes each one once, as it applies it, like ZMQ events: a
batch that does not decode is a 400 naming it (the others of the call are applied).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgpack
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from quillcache.connectors import EventIngestor, IngestReceipt
from quillcache.gateway.httpio import ApiError, parse_object, read_body

#: How long a call waits for its batches to be applied (the ingest queue may be long).
APPLY_WAIT_S = 30.0


class IngestEndpoint:
    def __init__(
        self,
        *,
        ingestor: EventIngestor,
        dp_ranks_of: Callable[[int], int | None],
        known_workers: Callable[[], list[int]],
        max_body_bytes: int,
    ) -> None:
        self._ingestor = ingestor
        self._dp_ranks_of = dp_ranks_of  # None: no such worker
        self._known_workers = known_workers
        self._max_body_bytes = max_body_bytes

    async def __call__(self, request: Request) -> Response:
        raw = await read_body(request, self._max_body_bytes)
        if "msgpack" in request.headers.get("content-type", ""):
            worker, dp_rank, seq, payloads = _from_msgpack(request.query_params, raw)
        else:
            worker, dp_rank, seq, payloads = _from_json(parse_object(raw))
        ranks = self._dp_ranks_of(worker)
        if ranks is None:
            known = sorted(self._known_workers())
            raise ApiError(404, f"unknown worker {worker}; known: {known}", "NotFoundError")
        if not 0 <= dp_rank < ranks:
            raise ApiError(400, f"dp_rank {dp_rank} out of range: worker {worker} has {ranks}")
        if seq is not None and seq < 0:  # negative values are the ingestor's own markers
            raise ApiError(400, f"seq must be >= 0, got {seq}")
        receipt = IngestReceipt(len(payloads))
        if not payloads:
            return _answer(receipt)
        if not self._ingestor.submit(worker, payloads, dp_rank, seq, receipt):
            raise ApiError(
                503,
                f"ingest queue full: none of {len(payloads)} batches accepted; retry later",
                "ServiceUnavailableError",
            )
        try:
            await asyncio.wait_for(asyncio.wrap_future(receipt.done), APPLY_WAIT_S)
        except TimeoutError:
            raise ApiError(
                503,
                f"the {len(payloads)} batches are queued but not applied within "
                f"{APPLY_WAIT_S:.0f} s (ingest backlog); they will be applied, do not resend",
                "ServiceUnavailableError",
            ) from None
        return _answer(receipt)


Parsed = tuple[int, int, int | None, list[bytes]]


def _from_msgpack(query: Any, raw: bytes) -> Parsed:
    try:
        seq = int(query["seq"]) if "seq" in query else None
        return int(query["worker"]), int(query.get("dp_rank", 0)), seq, [raw]
    except (KeyError, ValueError) as exc:
        raise _bad_request(exc) from None


def _from_json(body: dict[str, Any]) -> Parsed:
    try:
        worker = int(body["worker"])
        dp_rank = int(body.get("dp_rank", 0))
        seq = int(body["seq"]) if body.get("seq") is not None else None
        batches = body["batches"]
        if not isinstance(batches, list):
            raise TypeError("'batches' must be a list")
        return worker, dp_rank, seq, [msgpack.packb(b, use_bin_type=True) for b in batches]
    except (KeyError, ValueError, TypeError, OverflowError) as exc:
        raise _bad_request(exc) from None


def _bad_request(exc: Exception) -> ApiError:
    return ApiError(
        400,
        f"invalid ingest request: {exc!s} (need worker, and batches for JSON or ?worker= "
        "for msgpack)",
    )


def _answer(receipt: IngestReceipt) -> Response:
    if receipt.invalid:
        index, message = receipt.invalid[0]
        others = f"{len(receipt.invalid) - 1} more invalid; " if len(receipt.invalid) > 1 else ""
        raise ApiError(
            400,
            f"batch {index} is not a valid KV event batch: {message} ({others}"
            f"{receipt.applied} of {receipt.batches} batches applied)",
        )
    skipped = receipt.batches - receipt.applied
    return JSONResponse(
        {"accepted": receipt.batches, "applied": receipt.applied, "skipped": skipped},
        status_code=202,
    )
