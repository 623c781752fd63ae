"""`POST /ingest/kv_events`: KV events over HTTP, for engines or bridges without ZMQ.

msgpack body = one raw batch (worker, dp_rank, seq from the query string); JSON body =
{"worker", "dp_rank", "seq"?, "batches": [batch...]} with each batch as vLLM's structure
in JSON (for humans and bridges). Every batch is decoded once here so that a bad one is
a 400 naming it; applying happens on the ingestor's thread like ZMQ events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgpack
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from quillcache._native import decode_batch as _decode
from quillcache.errors import EventDecodeError
from quillcache.gateway.httpio import ApiError, parse_object, read_body

if TYPE_CHECKING:
    from quillcache.gateway.app import Gateway


class IngestEndpoint:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def __call__(self, request: Request) -> Response:
        gw = self.gw
        raw = await read_body(request, gw.config.max_body_bytes)
        if "msgpack" in request.headers.get("content-type", ""):
            worker, dp_rank, seq, payloads = _from_msgpack(request.query_params, raw)
        else:
            worker, dp_rank, seq, payloads = _from_json(parse_object(raw))
        if worker not in gw.pool.workers:
            raise ApiError(
                404, f"unknown worker {worker}; known: {sorted(gw.pool.workers)}", "NotFoundError"
            )
        ranks = gw.cp.worker(worker).dp_ranks
        if not 0 <= dp_rank < ranks:
            raise ApiError(400, f"dp_rank {dp_rank} out of range: worker {worker} has {ranks}")
        if seq is not None and seq < 0:  # negative values are the ingestor's own markers
            raise ApiError(400, f"seq must be >= 0, got {seq}")
        for i, payload in enumerate(payloads):
            error = decode_error(payload)
            if error is not None:
                raise ApiError(400, f"batch {i} is not a valid KV event batch: {error}")
        accepted = gw.ingestor.submit(worker, payloads, dp_rank, seq)
        if accepted < len(payloads):
            raise ApiError(
                503,
                f"ingest queue full: {accepted} of {len(payloads)} accepted",
                "ServiceUnavailableError",
            )
        return JSONResponse({"accepted": accepted}, status_code=202)


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


def decode_error(payload: bytes) -> str | None:
    """Why `payload` is not a KV event batch, or None when it decodes."""
    try:
        _decode(payload)
    except EventDecodeError as exc:
        return str(exc)
    except Exception as exc:  # any other failure of a decoder is still bad input
        return f"{type(exc).__name__}: {exc}"
    return None
