"""Pruned routing decides as routing over every row does.

Two control planes get the same fleet, events, loads and requests; one makes every view
prunable (`prune_min_rows=1`: the plane's ordered load structure and the rows above the
match's floor), the other none (`prune_min_rows=None`). Every built-in router must make
the same decisions on both, bit for bit: those that declare `prunes` because they score
only the rows that can win, the others because they ignore pruning. Fleets are small and
loads small integers (and halves) so that ties, the case pruning gets wrong first, are
common; the first batch of floor rows is one row, so the doubling is exercised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import quillcache.routing.base as routing_base
import quillcache.routing.quill as routing_quill
import quillcache.routing.ttft as routing_ttft
from quillcache.controlplane import ControlPlane
from quillcache.controlplane.pace import PaceConfig
from quillcache.costmodel import CostModelConfig
from quillcache.errors import ConfigError
from quillcache.events.encode import BlockStored, encode_batch
from quillcache.hashing.reference import content_keys, namespace_id
from quillcache.routing import BUILTIN_ORDER, Decision, Request, Router, View, create_router
from quillcache.routing.base import first_min, pruned_lowest
from quillcache.routing.registry import register_router
from quillcache.routing.types import LOAD_FIELDS
from quillcache.state.load_store import SharedLoadStore
from quillcache.state.types import EngineKey, SharedLoad

BS = 4
MODEL = "prune-model"
NS = namespace_id(model=MODEL, block_size=BS)
LOADS = st.sampled_from([0.0, 0.0, 1.0, 2.0, 2.5, 3.0, 40.0])


def tokens(family: int, blocks: int) -> list[int]:
    return [family * 1_000 + t for t in range(blocks * BS)]


def keys_of(family: int, blocks: int) -> np.ndarray:
    return np.array(content_keys(tokens(family, blocks), BS, NS), np.uint64)


class Twins:
    """Two planes driven alike: pruned and whole."""

    def __init__(self, router: str, peer_fetch: bool, **options: Any) -> None:
        cost = CostModelConfig()
        cost.transfer.allow_peer_fetch = peer_fetch
        self.planes = [
            ControlPlane(
                index="native",
                router=create_router(router, seed=3, **options),
                block_size=BS,
                cost=cost,
                track_load=True,
                prune_min_rows=prune,
                # learns paces from the first requests, so that slow rows are common
                pace=PaceConfig(window=4, min_samples=1, min_rows=2, refresh_every=1),
            )
            for prune in (1, None)
        ]

    def __getattr__(self, name: str) -> Callable[..., list[Any]]:
        def both(*args: Any, **kwargs: Any) -> list[Any]:
            return [getattr(p, name)(*args, **kwargs) for p in self.planes]

        return both

    def close(self) -> None:
        for p in self.planes:
            p.close()


class FewestQueuedTokens(Router):
    """A user's pruning router (`pruned_lowest`): the fewest queued tokens net of the
    prefix a row holds, ties to the lowest id; a floor row's score grows with its
    queue, so it may declare `prunes`."""

    name = "test-fewest-queued-tokens"
    prunes = True

    def route(self, request: Request, view: View) -> Decision:
        if not len(view):
            return self.no_workers()
        c = view.columns
        held = np.minimum(c.local_blocks, len(request.content_keys)) * view.block_size

        def score(at: np.ndarray) -> tuple[int, np.ndarray]:
            s = c.queued_prefill_tokens[at] - held[at]
            return first_min(s, c.worker[at]), s

        at = pruned_lowest(view, ("queued_prefill_tokens",), score)
        if at is None:
            at = score(np.arange(len(view)))[0]
        return self.decide(request, view, view.worker_at(at))


register_router(FewestQueuedTokens.name, FewestQueuedTokens, replace=True)


@pytest.mark.parametrize("name", [*BUILTIN_ORDER, FewestQueuedTokens.name])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_pruned_views_make_the_same_decisions(name: str, data: st.DataObject) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(routing_base, "PRUNE_FIRST_ROWS", 1)
        mp.setattr(routing_ttft, "WALK_MIN_ROWS", 1)
        mp.setattr(routing_quill, "WALK_MIN_ROWS", 1)
        same_decisions(name, data)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_pruned_views_make_the_same_decisions_with_the_eviction_term(data: st.DataObject) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(routing_quill, "WALK_MIN_ROWS", 1)
        same_decisions("quillcache", data, evict_weight=data.draw(st.sampled_from([0.25, 2.0])))


def test_a_row_with_more_queued_pairs_does_not_end_the_ttft_walk() -> None:
    """Rows the walk visits by queued tokens can hold the same tokens with more
    attention pairs (longer contexts), and so a higher estimate than a later row. The
    walk stops at a row only by a bound that holds for every later one: here engine 2
    (one queued token of long context) comes between engines 1 and 5, which tie, and 5
    wins it by having fewer requests in flight."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(routing_base, "PRUNE_FIRST_ROWS", 1)
        mp.setattr(routing_ttft, "WALK_MIN_ROWS", 1)
        twins = Twins("mooncake", peer_fetch=False)
        try:
            loads = {1: (1.0, 1.0), 2: (2.0, 40.0), 5: (0.0, 1.0)}
            for w, (in_flight, pairs) in loads.items():
                twins.add_worker(w, capacity_blocks=500, model=MODEL)
                twins.update_rank_load(
                    w,
                    0,
                    in_flight=in_flight,
                    queued_prefill_tokens=1.0,
                    queued_prefill_pairs=pairs,
                )
            pruned, whole = twins.route(Request(0, keys_of(0, 2), 2 * BS), now_s=0.0)
            assert whole.worker == 5
            assert pruned == whole
        finally:
            twins.close()


def same_decisions(name: str, data: st.DataObject, **options: Any) -> None:
    twins = Twins(name, peer_fetch=data.draw(st.booleans()), **options)
    try:
        ids = sorted(data.draw(st.lists(st.integers(0, 60), min_size=1, max_size=12, unique=True)))
        ranks = {w: data.draw(st.sampled_from([1, 1, 2])) for w in ids}
        for w in ids:
            # some engines small enough to fill: the eviction term then differs by row
            capacity = data.draw(st.sampled_from([500, 3, 8]))
            twins.add_worker(w, capacity_blocks=capacity, dp_ranks=ranks[w], model=MODEL)
        next_hash = 1
        everyone = data.draw(st.booleans())  # a system prompt every rank holds: a floor
        for w in ids:
            for rank in range(ranks[w]):
                if everyone or data.draw(st.booleans()):
                    ev = BlockStored(list(range(next_hash, next_hash + 1)), None, tokens(0, 1), BS)
                    next_hash += 1
                    twins.ingest(w, [encode_batch([ev], 1.0, rank)], rank)
        for _ in range(data.draw(st.integers(0, 6))):  # conversations on a few engines
            w = data.draw(st.sampled_from(ids))
            rank = data.draw(st.integers(0, ranks[w] - 1))
            n = data.draw(st.integers(2, 6))
            ev = BlockStored(
                list(range(next_hash, next_hash + n)),
                None,
                tokens(data.draw(st.integers(0, 2)), n),
                BS,
                medium=data.draw(st.sampled_from(["GPU", "GPU", "CPU"])),
            )
            next_hash += n
            twins.ingest(w, [encode_batch([ev], 1.0, rank)], rank)
        for w in ids:
            for rank in range(ranks[w]):
                fields = {f: data.draw(LOADS) for f in LOAD_FIELDS if f != "kv_usage"}
                twins.update_rank_load(w, rank, **fields)
            if data.draw(st.integers(0, 5)) == 0:
                twins.set_draining(w)
        for rid in range(data.draw(st.integers(1, 12))):
            family = data.draw(st.integers(0, 2))
            blocks = data.draw(st.integers(1, 7))
            request = Request(
                rid,
                keys_of(family, blocks),
                blocks * BS + data.draw(st.integers(0, BS)),
                expected_output_tokens=data.draw(st.integers(0, 64)),
                session_id=data.draw(st.sampled_from([None, None, "a", "b"])),
                arrival_s=float(rid),
            )
            only = None
            if data.draw(st.integers(0, 3)) == 0:
                only = frozenset(data.draw(st.lists(st.sampled_from(ids), min_size=1)))
            pruned, whole = twins.route(request, now_s=float(rid), only=only)
            assert pruned == whole, f"request {rid}"
            if pruned.worker is not None:
                step = data.draw(st.sampled_from(["keep", "prefilled", "finish"]))
                if step == "prefilled":
                    # its first token after a delay: the rows learn paces (> 1 for some)
                    delay = data.draw(st.sampled_from([None, 0.001, 0.05, 3.0, 40.0]))
                    twins.prefill_done(rid, None if delay is None else rid + delay)
                elif step == "finish":
                    twins.finish(rid)
    finally:
        twins.close()


def test_routers_that_declare_pruning_are_the_ones_that_use_it() -> None:
    declared = {name for name in BUILTIN_ORDER if create_router(name).prunes}
    pruning = {"least-loaded", "mooncake", "quillcache-greedy", "quillcache"}
    assert declared == pruning & set(BUILTIN_ORDER)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_planes_load_order_is_the_sort_of_the_columns(data: st.DataObject) -> None:
    """`View.least_loaded` from the plane's ordered structure equals the columns'
    sort (worker id, then rank, break ties), however the load changed since."""
    cp = ControlPlane(index="native", router="round-robin", block_size=BS, track_load=True)
    try:
        ids = sorted(
            data.draw(st.lists(st.integers(0, 2**40), min_size=1, max_size=10, unique=True))
        )
        for w in ids:
            cp.add_worker(w, dp_ranks=data.draw(st.sampled_from([1, 2])))
        fields = data.draw(
            st.sampled_from([("in_flight", "queued_prefill_tokens"), ("queued_prefill_tokens",)])
        )
        request = Request(0, keys_of(0, 2), 2 * BS)
        for step in range(data.draw(st.integers(1, 8))):
            action = data.draw(st.sampled_from(["report", "route", "finish", "remove", "drain"]))
            w = data.draw(st.sampled_from(ids))
            if action == "report":
                cp.update_load(
                    w, in_flight=data.draw(LOADS), queued_prefill_tokens=data.draw(LOADS)
                )
            elif action == "route":
                cp.route(Request(step, keys_of(1, 2), 2 * BS))
            elif action == "finish":
                cp.finish(data.draw(st.integers(0, step)))
            elif action == "remove" and len(ids) > 1:
                cp.remove_worker(w)
                cp.add_worker(w)
            elif action == "drain":
                cp.set_draining(w, data.draw(st.booleans()))
            cp.prune_min_rows = 1
            view = cp.view(request)
            if not len(view):
                continue
            k = data.draw(st.integers(1, len(view)))
            from_order = view.least_loaded(fields, k)
            cp.prune_min_rows = None
            reference = cp.view(request).least_loaded(fields, k)
            assert from_order.tolist() == reference.tolist()
    finally:
        cp.close()


def test_a_shared_stores_polls_move_the_order() -> None:
    """Load that arrives from other replicas (a shared store's poll) reorders the rows:
    the least loaded row is the one the poll left least loaded."""
    store = SharedLoadStore()
    keys: dict[EngineKey, int] = {}
    cp = ControlPlane(
        index="native", router="least-loaded", block_size=BS, load_store=store, prune_min_rows=1
    )
    try:
        for w in range(4):
            cp.add_worker(w)
            keys[EngineKey(w, 0)] = cp.worker(w).rows[0]
        store.bind(keys.get)
        request = Request(0, keys_of(0, 2), 2 * BS)
        first = cp.route(request)
        assert first.worker == 0  # all idle: the lowest id
        store.apply_snapshot(
            {key: SharedLoad(in_flight=0 if row == 2 else 5) for key, row in keys.items()}
        )
        assert cp.route(Request(1, keys_of(0, 2), 2 * BS)).worker == 2
    finally:
        cp.close()


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_load_report_that_is_not_a_count_is_refused(value: float) -> None:
    """Pruning's bound holds for loads >= 0: a report outside that is refused with a
    typed error, and the load stays what it was."""
    cp = ControlPlane(index="native", router="quillcache", block_size=BS, prune_min_rows=1)
    try:
        cp.add_worker(0, dp_ranks=2)
        cp.update_load(0, queued_prefill_tokens=8.0)
        with pytest.raises(ConfigError, match="queued_prefill_tokens"):
            cp.update_load(0, queued_prefill_tokens=value)
        with pytest.raises(ConfigError, match="running_decodes"):
            cp.update_rank_load(0, 1, running_decodes=value)
        assert cp.worker(0).queued_prefill_tokens == 8.0
        assert cp.worker(0).running_decodes == 0.0
    finally:
        cp.close()
