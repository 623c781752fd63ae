"""Session retention in the timed simulator (`quillcache.sim.retain`): the gateway's
retention policy keeping sessions' prefixes on their engines through tool waits longer
than the engines' LRU turnover, against the same run without it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from quillcache.costmodel import CostModel
from quillcache.errors import ConfigError
from quillcache.sim.generators import multi_turn
from quillcache.sim.metrics import Record, RunResult
from quillcache.sim.retain import Retainer, RetainSettings
from quillcache.sim.runner import SimConfig, run
from quillcache.sim.workload import Workload

# 30 sessions of 4 turns whose tool results are long (512 tokens), 30 s tool waits on
# average, beside 8 one-off 2,048-token prompts a second: on 4 engines of 3,000 blocks
# the background turns each engine's cache over in about 12 s, the sessions' prefixes
# (at most ~170 blocks each) fit beside it
SESSIONS = dict(
    sessions=30,
    turns=4,
    system_prompt_len=64,
    user_len=512,
    think_time_s=30.0,
    rate=1.0,
    background_rate=8.0,
)
CAPACITY = 3000


def _summary(
    workload: Workload, retain: RetainSettings | None, router: str = "quillcache"
) -> dict[str, Any]:
    config = SimConfig(workers=4, capacity_blocks=CAPACITY, retain=retain)
    return run(workload, router, "native", config, CostModel()).summary()


@pytest.fixture(scope="module")
def workload() -> Workload:
    return multi_turn(**SESSIONS)  # type: ignore[arg-type]


@pytest.mark.parametrize("router", ["quillcache", "round-robin"])
def test_retention_keeps_the_sessions_next_turns_cached(workload: Workload, router: str) -> None:
    without = _summary(workload, None, router)
    kept = _summary(workload, RetainSettings(), router)
    assert without["followups"] == kept["followups"] == 90  # 30 sessions x 3 next turns
    assert without["followup_reuse_share"] < 0.5, without
    assert kept["followup_reuse_share"] >= 0.9, kept
    assert kept["followup_ttft_mean_s"] < without["followup_ttft_mean_s"]
    # what it cost, beside the requests' own prefill
    assert kept["retention_touches"] > 0
    assert 0 < kept["retention_prefill_pct"] < 15
    assert "retention_touches" not in without


def test_a_ttl_shorter_than_the_tool_wait_keeps_nothing(workload: Workload) -> None:
    without = _summary(workload, None)
    short = _summary(workload, RetainSettings(session_ttl_s=2.0))
    assert short["followup_reuse_share"] < 0.5
    assert short["followup_reuse_share"] <= without["followup_reuse_share"] + 0.1


def test_without_session_ids_there_is_nothing_to_retain(workload: Workload) -> None:
    s = _summary(workload.without_sessions(), RetainSettings())
    assert s["retention_touches"] == s["retention_prefetches"] == 0
    assert s["retention_prefill_tokens"] == 0


def test_the_background_leaves_the_sessions_as_they_were() -> None:
    plain = multi_turn(sessions=5, turns=3, seed=3)
    busy = multi_turn(sessions=5, turns=3, seed=3, background_rate=4.0, background_len=64)
    sessions = [r for r in busy.requests if r.session_id is not None]
    assert len(busy.requests) > len(plain.requests) == len(sessions)
    for a, b in zip(plain.requests, sessions, strict=True):
        assert a.session_id == b.session_id and a.arrival_s == b.arrival_s
        assert np.array_equal(a.keys, b.keys)
    rid = {r.rid: r for r in busy.requests}
    for r in sessions:  # parents point at the same session's previous turn
        assert all(rid[p].session_id == r.session_id for p in r.parents)
    assert all(r.parents == () for r in busy.requests if r.session_id is None)


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"session_ttl_s": 365 * 86400.0}, "session_max_ttl_s"),
        ({"session_ttl_s": -1}, "session_ttl_s must be in"),
        ({"touch_safety": 2}, "touch_safety"),
        ({"period_s": 0}, "period_s must be positive"),
        ({"touch_min_interval_s": 10, "touch_max_interval_s": 5}, "must not exceed"),
        ({"max_tokens": 1.5}, "not a number"),
        ({"engine_tokens_per_s": True}, "not a number"),
        ({"nope": 1}, "unknown"),
    ],
)
def test_bad_retention_options_name_the_limit(options: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        RetainSettings.parse(options)


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(timing="none"), "full timing only"),
        (dict(dp_ranks=2), "one rank per worker"),
    ],
)
def test_retention_refuses_what_it_does_not_model(change: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        replace(SimConfig(retain=RetainSettings()), **change).check()


def test_retention_behind_several_replicas_is_refused() -> None:
    from quillcache.sim.replicas import ReplicaConfig

    wl = multi_turn(sessions=2, turns=2)
    with pytest.raises(ConfigError, match="one gateway only"):
        run(
            wl,
            "quillcache",
            "native",
            SimConfig(retain=RetainSettings()),
            CostModel(),
            replicas=ReplicaConfig(2, "shared", "round-robin", 1.0),
        )


def test_touch_ids_are_neither_workload_nor_replica_ids() -> None:
    from quillcache.sim.replicate import REPLICA_RID_BASE, Replicator

    touch = Retainer.is_touch
    assert not touch(0) and not touch(-1) and not touch(REPLICA_RID_BASE)
    assert not touch(REPLICA_RID_BASE - 1_000_000)
    assert Replicator.is_replica(REPLICA_RID_BASE - 1_000_000)


def test_followups_count_the_blocks_shared_with_the_parent() -> None:
    def rec(parent_blocks: int, hit: int) -> Record:
        r = Record(1, 0, 0.0, 16 * 20, 20, 4, hit_blocks=hit, first_token_s=0.1, finish_s=0.2)
        r.parent_blocks = parent_blocks
        return r

    recs = [rec(10, 10), rec(10, 4), rec(-1, 20), rec(0, 5), rec(6, 20)]
    res = RunResult("r", "native", "full", 1, 100, 16, recs)
    s = res.summary()
    assert s["followups"] == 3  # a request without a parent, or sharing nothing: not one
    assert s["followup_reuse_share"] == pytest.approx((10 + 4 + 6) / (10 + 10 + 6))


def test_retention_stays_within_its_share_of_an_engine_a_router_crowds(
    workload: Workload,
) -> None:
    """`llm-d` puts most sessions on the engine holding the shared system prompt.
    Retention keeps at most half of that engine's capacity (the latest sessions): the
    rest are left to its LRU, rather than touches filling its cache and every
    eviction costing a whole prefix again (which once cost 69 % extra prefill and 8x
    the follow-ups' TTFT)."""
    without = _summary(workload, None, "llm-d")
    kept = _summary(workload, RetainSettings(), "llm-d")
    assert kept["followup_reuse_share"] > without["followup_reuse_share"]
    assert kept["followup_ttft_mean_s"] <= without["followup_ttft_mean_s"]
    assert kept["retention_prefill_pct"] < 5
    whole = _summary(workload, RetainSettings(max_engine_share=1.0), "llm-d")
    assert whole["retention_prefill_pct"] > kept["retention_prefill_pct"]


GRID = """\
routers = ["quillcache"]
seeds = 1

[workloads.sessions]
generator = "multi-turn"
sessions = 6
turns = 3
system_prompt_len = 64
user_len = 256
think_time_s = 20.0
background_rate = 4.0

[setups.small]
base = "llama-8b-a100"
cost = { "engine.kv_capacity_blocks" = 1500 }

[[cells]]
name = "plain"
workload = "sessions"
setup = "small"
engines = 2

[[cells]]
name = "retained"
workload = "sessions"
setup = "small"
engines = 2
retain = { session_ttl_s = 120.0 }
"""


def test_a_grid_cell_runs_retention() -> None:
    from quillcache.sim import matrix

    grid = matrix.parse_grid(GRID)
    plain, retained = grid.cells
    assert plain.retain is None and retained.key()["retain"] == {"session_ttl_s": 120.0}
    matrix._STATE["grid"] = grid
    kept_plain, _ = matrix.run_task((0, 0, "quillcache"))
    kept, _ = matrix.run_task((1, 0, "quillcache"))
    assert "retention_touches" not in kept_plain
    assert kept["retention_touches"] > 0
    assert kept["followup_reuse_share"] > kept_plain["followup_reuse_share"]
    row = matrix.summarize(grid, [kept_plain, kept])["cells"][1]["routers"]["quillcache"]
    assert row["retention_touches"] >= kept["retention_touches"]
    assert row["followup_reuse_share"] == pytest.approx(kept["followup_reuse_share"], abs=1e-4)
    for bad, needle in (
        ("nope = 1", r"cells\[1\].retain.*'nope' unknown"),
        ("session_ttl_s = 1e9", r"cells\[1\].retain.*session_max_ttl_s"),
    ):
        text = GRID.replace("session_ttl_s = 120.0", bad)
        with pytest.raises(ConfigError, match=needle):
            matrix.parse_grid(text)


def test_the_results_page_shows_a_policy_cells_columns(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "g.toml").write_text(GRID)
    proc = subprocess.run(
        [sys.executable, "-m", "quillcache", "simulate", "--matrix", "g.toml", "--out", "o"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    page = next((tmp_path / "o").glob("*.md")).read_text()
    plain, retained = page.split("#### plain")[1].split("#### retained")
    assert "touches" not in plain and "follow-up reuse" in plain  # closed loop: always
    assert "session retention" in retained
    header = next(line for line in retained.splitlines() if line.startswith("| router"))
    assert header.endswith("| follow-up reuse | follow-up TTFT (s) | touches | touch prefill |")
    row = next(line for line in retained.splitlines() if line.startswith("| quillcache"))
    assert row.count("|") == header.count("|")
