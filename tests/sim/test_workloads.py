"""Workload generators: deterministic, well-formed, sharing what they claim to share."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from quillcache.errors import ConfigError
from quillcache.hashing.reference import content_keys
from quillcache.sim.generators import GENERATORS, agent_fanout, multi_turn, shared_prefix
from quillcache.sim.workload import sim_namespace

SMALL = {
    "shared-prefix": dict(requests=60, prefix_groups=3, shared_prefix_blocks=4),
    "sglang-gsp": dict(num_groups=3, prompts_per_group=4, system_prompt_len=100),
    "multi-turn": dict(sessions=4, turns=3, system_prompt_len=50),
    "agent-fanout": dict(tasks=3, fanout=3, context_len=100),
}


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generators_are_deterministic_and_well_formed(name: str) -> None:
    a = GENERATORS[name](seed=3, **SMALL[name])
    b = GENERATORS[name](seed=3, **SMALL[name])
    c = GENERATORS[name](seed=4, **SMALL[name])
    assert [r.keys.tolist() for r in a.requests] == [r.keys.tolist() for r in b.requests]
    assert [r.keys.tolist() for r in a.requests] != [r.keys.tolist() for r in c.requests]
    arrivals = [r.arrival_s for r in a.requests]
    assert arrivals == sorted(arrivals)
    assert [r.rid for r in a.requests] == list(range(len(a.requests)))
    ns = sim_namespace(a.block_size)
    for r in a.requests[:10]:
        assert r.keys_list == content_keys(r.tokens.tolist(), a.block_size, ns)
        assert r.prompt_tokens == len(r.tokens)


def test_shared_prefix_groups_share_their_prefix_blocks() -> None:
    wl = shared_prefix(requests=40, prefix_groups=2, shared_prefix_blocks=5, unique_blocks=2)
    by_group: dict[str, set] = {}
    for r in wl.requests:
        by_group.setdefault(r.session_id, set()).add(tuple(r.keys_list[:5]))
        assert len(r.keys_list) == 7
    assert all(len(v) == 1 for v in by_group.values()) and len(by_group) == 2
    assert len({r.keys_list[5] for r in wl.requests}) == 40


def test_multi_turn_turns_extend_the_previous_prompt() -> None:
    wl = multi_turn(sessions=3, turns=4)
    for s in range(3):
        turns = [r for r in wl.requests if r.session_id == f"session-{s}"]
        assert len(turns) == 4
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.arrival_s >= prev.arrival_s
            assert np.array_equal(nxt.tokens[: prev.prompt_tokens], prev.tokens)


def test_agent_fanout_calls_share_the_planner_context() -> None:
    wl = agent_fanout(tasks=2, fanout=4, context_len=160, block_size=16)
    task0 = [r for r in wl.requests if r.session_id == "task-0"]
    assert len(task0) == 6  # planner, 4 calls, join
    planner = task0[0]
    for r in task0[1:]:
        assert r.keys_list[: len(planner.keys_list)] == planner.keys_list


def test_bad_parameters_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        shared_prefix(requests=0)
    with pytest.raises(ConfigError, match="rate"):
        shared_prefix(rate=0)


def test_pinned_prefixes_hit_from_the_first_request() -> None:
    from quillcache.costmodel import CostModel
    from quillcache.sim.runner import SimConfig, run

    kw = dict(requests=30, prefix_groups=3, shared_prefix_blocks=6, unique_blocks=1, zipf=0.0)
    plain = shared_prefix(**kw)
    pinned = shared_prefix(pinned_groups=3, **kw)
    assert len(pinned.pinned) == 3 and not plain.pinned
    cfg = SimConfig(workers=2, capacity_blocks=200, timing="none")
    first = {
        name: run(wl, "random", "native", cfg, CostModel()).records[0].hit_blocks
        for name, wl in (("plain", plain), ("pinned", pinned))
    }
    assert first == {"plain": 0, "pinned": 6}
