"""The engine simulator's LMCache controller (`quillcache.enginesim.lmcache_controller`)
and what its operations do to the LMCache tiers, against LMCache 0.5.6's behaviour
(the HTTP shapes and errors are tested end to end in
tests/online/test_lmcache_controller_e2e.py)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache import _native
from quillcache.enginesim.engine import EngineConfig, SimEngine
from quillcache.enginesim.lmcache import CPU_LOCATION, LmcacheCpuTier
from quillcache.enginesim.lmcache_controller import (
    CONTROLLER_CHUNK_SIZE,
    ClearRequest,
    ControllerError,
    Instance,
    LmcacheControllerSim,
    MoveRequest,
    PinRequest,
)
from quillcache.events.types import BlockStored

CHUNK = CONTROLLER_CHUNK_SIZE
BS = 16


def tier(chunk: int = CHUNK, capacity: int = 64) -> LmcacheCpuTier:
    return LmcacheCpuTier("vllm", chunk_size=chunk, capacity_chunks=capacity, block_size=BS)


def controller(*tiers: LmcacheCpuTier, p2p: bool = True) -> LmcacheControllerSim:
    return LmcacheControllerSim([Instance(f"i{n}", t, p2p) for n, t in enumerate(tiers)])


def move(src: str, dst: str, tokens: list[int], copy: bool = True) -> MoveRequest:
    return MoveRequest(
        old_position=(src, CPU_LOCATION),
        new_position=(dst, CPU_LOCATION),
        tokens=tokens,
        should_copy=copy,
    )


def test_lookup_names_the_first_registered_holder_of_each_chunk() -> None:
    a, b = tier(), tier()
    prompt = list(range(3 * CHUNK + 10))
    b.store(prompt)
    a.store(prompt[: 2 * CHUNK])
    ctl = controller(a, b)
    # chunks 0-1 are found on i0 first; chunk 2 and the short last one on i1 only
    assert ctl.lookup(prompt) == {
        "i0": (CPU_LOCATION, 2 * CHUNK),
        "i1": (CPU_LOCATION, len(prompt)),
    }
    assert ctl.lookup(list(range(1000, 1300))) == {}


def test_lookup_finds_nothing_where_the_workers_chunk_size_is_not_the_controllers() -> None:
    """LMCache's controller hashes /lookup tokens with its default 256-token chunks."""
    small = tier(chunk=64)
    prompt = list(range(512))
    small.store(prompt)
    assert small.lookup(prompt)[0] == 512  # the worker itself holds it
    assert controller(small).lookup(prompt) == {}


def test_a_move_copies_pins_the_source_for_good_and_announces_nothing() -> None:
    src, dst = tier(capacity=4), tier(capacity=4)
    prompt = list(range(2 * CHUNK))
    src.store(prompt)
    src.drain()
    ctl = controller(src, dst)
    assert ctl.move(move("i0", "i1", prompt)) == 2 * CHUNK
    assert dst.lookup(prompt)[0] == 2 * CHUNK
    assert dst.drain() == []  # a received chunk makes no KV event
    assert ctl.moves == 1 and ctl.moved_chunks == 2
    # moved again: the destination holds them; the source's pins add up
    assert ctl.move(move("i0", "i1", prompt)) == 2 * CHUNK and ctl.moved_chunks == 2
    held = src.lookup(prompt)[1]
    assert [src.pinned(h) for h in held] == [2, 2]
    # LocalCPUBackend.clear skips pinned chunks, eviction too: they stay for good
    assert src.clear() == 0
    src.store(list(range(10_000, 10_000 + 4 * CHUNK)))
    assert src.lookup(prompt)[0] == 2 * CHUNK
    assert dst.clear() == 2 * CHUNK and dst.lookup(prompt)[0] == 0


def test_a_move_without_copy_drops_the_source_chunks() -> None:
    src, dst = tier(), tier()
    prompt = list(range(CHUNK + 5))
    src.store(prompt)
    ctl = controller(src, dst)
    assert ctl.move(move("i0", "i1", prompt, copy=False)) == len(prompt)
    assert src.lookup(prompt)[0] == 0
    assert ctl.lookup(prompt) == {"i1": (CPU_LOCATION, len(prompt))}


def test_the_errors_of_a_move_are_lmcaches() -> None:
    src, dst = tier(), tier()
    prompt = list(range(CHUNK))
    src.store(prompt)
    agree = "The number of tokens moved should be the same across all workers."
    with pytest.raises(ControllerError, match=agree):
        controller(src, dst).move(move("i0", "nope", prompt))
    with pytest.raises(ControllerError, match="P2P is not enabled"):
        controller(src, dst, p2p=False).move(move("i0", "i1", prompt))
    ctl = controller(src, dst)
    for bad in (
        move("i0", "i0", prompt),
        MoveRequest(old_position=("i0", CPU_LOCATION), new_position=("i1", "LocalDiskBackend")),
    ):
        with pytest.raises(ControllerError, match="Operation 'move' is not supported"):
            ctl.move(bad)
    # nothing found at the source (another location, no tokens): 0, no error
    assert ctl.move(move("i1", "i0", prompt)) == 0
    elsewhere = MoveRequest(
        old_position=("i0", "LocalDiskBackend"), new_position=("i1", CPU_LOCATION), tokens=prompt
    )
    assert ctl.move(elsewhere) == 0
    assert ctl.move(move("i0", "i1", [])) == 0


def test_a_source_without_p2p_fails_after_pinning() -> None:
    """`LMCacheEngine.move` pins what its lookup found before it asks for its P2P
    backend: a source without one fails the move and keeps the pins."""
    src, dst = tier(), tier()
    prompt = list(range(CHUNK))
    src.store(prompt)
    ctl = LmcacheControllerSim([Instance("i0", src, p2p=False), Instance("i1", dst)])
    with pytest.raises(ControllerError, match="not supported"):
        ctl.move(move("i0", "i1", prompt))
    assert [src.pinned(h) for h in src.lookup(prompt)[1]] == [1]
    assert dst.lookup(prompt)[0] == 0


def test_clear_and_pin_of_unknown_instances_fail_as_lmcache_does() -> None:
    ctl = controller(tier())
    with pytest.raises(ControllerError, match="tokens cleared should be the same"):
        ctl.clear(ClearRequest(instance_id="x", location=CPU_LOCATION))
    with pytest.raises(ControllerError, match="tokens pinned should be the same"):
        ctl.pin(PinRequest(instance_id="x", location=CPU_LOCATION, tokens=[1]))
    assert ctl.clear(ClearRequest(instance_id="i0", location="LocalDiskBackend")) == 0


def test_an_engine_loads_what_its_lmcache_holds_and_then_announces_it_on_the_gpu() -> None:
    """A chunk received from a peer is announced by nobody; a request that starts with it
    loads it (vLLM counts a connector's hits in cached_tokens), and the blocks it loaded
    are stored in the GPU cache, whose events the gateway reads."""
    published: list[bytes] = []
    config = EngineConfig(
        block_size=BS, num_gpu_blocks=256, time_scale=0.0, lmcache="vllm", lmcache_chunk_size=CHUNK
    )
    prompt = list(range(5000, 5000 + 2 * CHUNK + 7))
    cached: list[int] = []

    async def run() -> None:
        engine = SimEngine(config, publish=published.append)
        assert engine.lmcache is not None
        engine.lmcache.receive(prompt[: 2 * CHUNK])
        engine.lmcache.drain()
        gen = engine.generate(
            prompt, 1, lambda i: i, on_admitted=lambda a: cached.append(a.cached_tokens)
        )
        async for _ in gen:
            pass

    asyncio.run(run())
    assert cached == [2 * CHUNK]
    stored = [
        e for p in published for e in _native.decode_batch(p).events if isinstance(e, BlockStored)
    ]
    gpu = [t for e in stored if e.medium == "GPU" for t in e.token_ids]
    assert gpu[: 2 * CHUNK] == prompt[: 2 * CHUNK]


@settings(max_examples=60, deadline=None)
@given(
    held=st.lists(st.integers(0, 3), min_size=0, max_size=4),
    extra=st.integers(0, CHUNK - 1),
    copy=st.booleans(),
)
def test_a_move_gives_the_destination_what_the_source_held(
    held: list[int], extra: int, copy: bool
) -> None:
    """Whatever prefixes of one prompt two tiers hold, a move hands the destination the
    source's longest prefix of it: its lookup there is at least what the source found,
    and the source keeps it exactly when copying."""
    src, dst = tier(), tier()
    prompt = list(range(4 * CHUNK + extra))
    for n in held:
        src.store(prompt[: n * CHUNK])
    dst.store(prompt[:CHUNK])
    before = src.lookup(prompt)[0]
    ctl = controller(src, dst)
    moved = ctl.move(move("i0", "i1", prompt, copy=copy))
    assert moved == before
    assert dst.lookup(prompt)[0] >= max(moved, CHUNK)
    assert src.lookup(prompt)[0] == (before if copy else 0)
