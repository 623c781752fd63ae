"""The plane's columnar view against a view built the plain way, worker by worker,
from the index's `match` list and the plane's own records: random fleets (ids that
are not 0..n-1, several dp ranks, other media, draining, workers removed and re-added,
candidate subsets, speculative placements and reported loads)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.controlplane import ControlPlane
from quillcache.events.encode import BlockStored, encode_batch
from quillcache.hashing.reference import content_keys, namespace_id
from quillcache.routing import Request, WorkerView
from quillcache.routing.types import tier_of

BS = 4
MODEL = "view-model"
NS = namespace_id(model=MODEL, block_size=BS)
MEDIA = ["GPU", "CPU", "DISK", "nvme-tier"]


def tokens(family: int, blocks: int) -> list[int]:
    return [family * 1_000 + t for t in range(blocks * BS)]


def expected_view(
    cp: ControlPlane,
    keys: np.ndarray,
    candidates: list[int],
    pending_keys: dict[tuple[int, int], set[int]],
) -> list[WorkerView]:
    """One row per (candidate, dp rank), each from the index's hits on that rank."""
    media: dict[tuple[int, int], dict[str, int]] = {}
    for m in cp.match(keys):
        own = media.setdefault((m.worker, m.dp_rank), {})
        own[m.medium] = max(own.get(m.medium, 0), m.blocks)
    out = []
    for w in candidates:
        s = cp.worker(w)
        for rank in range(s.dp_ranks):
            tiers = {"gpu": 0, "cpu": 0, "disk": 0}
            for medium, blocks in media.get((w, rank), {}).items():
                tier = tier_of(medium)
                tiers[tier] = max(tiers[tier], blocks)
            pending = 0
            for k in keys.tolist():
                if k not in pending_keys.get((w, rank), set()):
                    break
                pending += 1
            r = s.rank_state(rank)
            out.append(
                WorkerView(
                    w,
                    r["in_flight"],
                    r["queued_prefill_tokens"],
                    r["running_decodes"],
                    r["kv_usage"],
                    r["capacity_blocks"],
                    r["resident_blocks"],
                    r["mean_context_tokens"],
                    tiers["gpu"],
                    tiers["cpu"],
                    tiers["disk"],
                    pending,
                    media.get((w, rank), {}),
                    rank not in s.stale_ranks,
                    rank,
                    queued_prefill_pairs=r["queued_prefill_pairs"],
                )
            )
    return out


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_columnar_view_is_the_plain_view(data: st.DataObject) -> None:
    cp = ControlPlane(index="native", router="round-robin", block_size=BS, track_load=True)
    try:
        # ids past the plane's position table (2**20) are placed by search, not a table
        top = data.draw(st.sampled_from([5_000, 2**40, 2**64 - 1]))
        drawn = data.draw(st.lists(st.integers(0, top), min_size=1, max_size=8, unique=True))
        ids = sorted(drawn)
        # one rank each: the index places the hits itself, from a compact match
        ranks = data.draw(st.sampled_from([1, 2]))
        for w in ids:
            capacity = data.draw(st.integers(1, 999))
            cp.add_worker(w, capacity_blocks=capacity, dp_ranks=ranks, model=MODEL)
        next_hash = 1
        if data.draw(st.booleans()):  # a prompt every source holds: the match's floors
            shared = data.draw(st.integers(1, 3))
            for w in ids:
                for rank in range(ranks):
                    ev = BlockStored(
                        block_hashes=list(range(next_hash, next_hash + shared)),
                        parent_block_hash=None,
                        token_ids=tokens(0, shared),
                        block_size=BS,
                        medium=data.draw(st.sampled_from(MEDIA[:2])),
                    )
                    next_hash += shared
                    cp.ingest(w, [encode_batch([ev], 1.0, rank)], rank)
        for _ in range(data.draw(st.integers(0, 12))):
            w = data.draw(st.sampled_from(ids))
            rank = data.draw(st.integers(0, ranks - 1))
            family = data.draw(st.integers(0, 2))
            n = data.draw(st.integers(1, 6))
            ev = BlockStored(
                block_hashes=list(range(next_hash, next_hash + n)),
                parent_block_hash=None,
                token_ids=tokens(family, n),
                block_size=BS,
                medium=data.draw(st.sampled_from(MEDIA)),
            )
            next_hash += n
            cp.ingest(w, [encode_batch([ev], 1.0, rank)], rank)
        if data.draw(st.booleans()):  # a worker leaves and comes back: a fresh slot
            w = data.draw(st.sampled_from(ids))
            cp.remove_worker(w)
            cp.add_worker(w, capacity_blocks=7, model=MODEL)
        for w in ids:
            if data.draw(st.booleans()):
                cp.update_load(w, kv_usage=data.draw(st.floats(0, 1)), in_flight=3)
            if data.draw(st.integers(0, 4)) == 0:
                cp.set_draining(w)
            if data.draw(st.integers(0, 4)) == 0:
                cp.set_source_stale(w, ranks - 1, True)
        pending_keys: dict[tuple[int, int], set[int]] = {}
        for rid in range(data.draw(st.integers(0, 4))):  # speculative placements
            family = data.draw(st.integers(0, 2))
            keys = np.array(content_keys(tokens(family, 5), BS, NS), np.uint64)
            decision = cp.route(Request(rid, keys, 5 * BS + 1))
            if decision.worker is not None and data.draw(st.booleans()):
                assert decision.dp_rank is not None
                on = (decision.worker, decision.dp_rank)
                pending_keys.setdefault(on, set()).update(keys.tolist())
            elif decision.worker is not None:
                cp.prefill_done(rid)
        query = np.array(content_keys(tokens(data.draw(st.integers(0, 2)), 6), BS, NS), np.uint64)
        routable = [w for w in ids if not cp.worker(w).draining]
        only: set[int] | frozenset[int] | None = None
        if data.draw(st.booleans()):
            only = set(data.draw(st.lists(st.sampled_from(ids), unique=True)))
            if data.draw(st.booleans()):  # a gateway's: kept by the plane per routable set
                only = frozenset(only)
        for _ in range(2):
            candidates = [w for w in routable if only is None or w in only]
            view = cp.view(Request(99, query, 6 * BS), only=only)
            assert view.workers == expected_view(cp, query, candidates, pending_keys)
            assert [view.worker_at(i) for i in range(len(view))] == view.workers
            # then the fleet changes under the same `only`
            w = data.draw(st.sampled_from(ids))
            draining = data.draw(st.booleans())
            cp.set_draining(w, draining)
            routable = [x for x in ids if not cp.worker(x).draining]
    finally:
        cp.close()
