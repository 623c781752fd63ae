"""Dynamo's agentic trace fields (`wait_for`, `branches`, `delay`, `tool_wait_ms`,
`prefix_reset`) in Mooncake-format JSONL traces."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from quillcache.costmodel import CostModel
from quillcache.errors import ConfigError
from quillcache.sim.agentic import TraceFieldError
from quillcache.sim.runner import SimConfig, run
from quillcache.sim.trace import load_trace

BS = 16


def _row(rid: str, ts: float | None, ids: list[int], **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "request_id": rid,
        "input_length": len(ids) * BS,
        "output_length": 4,
        "hash_ids": ids,
        **extra,
    }
    if ts is not None:
        row["timestamp"] = ts
    return row


def _write(path: Path, rows: Sequence[dict[str, Any] | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# The shape Dynamo's converter writes: a root trajectory r1 -> r2 (sequence, with a tool
# wait), a sub-agent c1 spawned by r1 (branches / wait_for), and r3 joining both.
AGENT = [
    _row("r1", 0, [1], session_id="root", prefix_reset=True, branches=["c1"]),
    _row("c1", 150, [1, 3], session_id="child", prefix_reset=True, delay=50.0),
    _row("r2", 300, [1, 2], session_id="root", wait_for=["r1"], delay=100.0, tool_wait_ms=100.0),
    _row("r3", 900, [1, 2, 4], session_id="root", wait_for=["r2", "c1"], delay_ms=20),
]


def test_agentic_rows_become_dependencies(tmp_path: Path) -> None:
    wl = load_trace(_write(tmp_path / "a.jsonl", list(AGENT)), block_size=BS)
    by = {r.rid: r for r in wl.requests}
    assert [by[i].parents for i in range(4)] == [(), (0,), (0,), (2, 1)]
    assert [by[i].wait_s for i in range(4)] == pytest.approx([0, 0.05, 0.2, 0.02])
    assert [by[i].session_id for i in range(4)] == ["root", "child", "root", "root"]
    assert wl.closed_loop
    assert wl.params["prefix_resets"] == 2
    # order-only: each request finishes as it arrives, so the release times are exact
    res = run(wl, "round-robin", "native", SimConfig(2, 1 << 20, timing="none"), CostModel())
    arrival = {rec.rid: rec.arrival_s for rec in res.records}
    assert arrival == pytest.approx({0: 0.0, 1: 0.05, 2: 0.2, 3: 0.22})
    # open loop they keep their timestamps
    res = run(wl.open_loop(), "round-robin", "native", SimConfig(2, 1 << 20), CostModel())
    assert {rec.rid: rec.arrival_s for rec in res.records} == {0: 0, 1: 0.15, 2: 0.3, 3: 0.9}


def test_timed_replay_waits_for_the_real_finish(tmp_path: Path) -> None:
    wl = load_trace(_write(tmp_path / "a.jsonl", list(AGENT)), block_size=BS)
    res = run(wl, "quillcache", "native", SimConfig(2, 1 << 20), CostModel())
    rec = {r.rid: r for r in res.records}
    assert rec[2].arrival_s == pytest.approx(rec[0].finish_s + 0.2)
    assert rec[3].arrival_s == pytest.approx(max(rec[2].finish_s, rec[1].finish_s) + 0.02)


def test_a_dependent_row_needs_no_timestamp(tmp_path: Path) -> None:
    rows = [_row("a", 1000, [1]), _row("b", None, [1, 2], wait_for=["a"], tool_wait_ms=500)]
    wl = load_trace(_write(tmp_path / "t.jsonl", rows), block_size=BS)
    assert [r.arrival_s for r in wl.requests] == [1.0, 1.5]  # open loop: parent + wait


def test_plain_mooncake_rows_are_unchanged(tmp_path: Path) -> None:
    rows = [{"timestamp": 5, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]}]
    wl = load_trace(_write(tmp_path / "m.jsonl", rows), block_size=BS)
    assert not wl.closed_loop and "closed_loop" not in wl.params
    assert wl.requests[0].session_id is None and wl.requests[0].wait_s == 0


def test_a_limit_drops_branches_to_rows_not_read(tmp_path: Path) -> None:
    wl = load_trace(_write(tmp_path / "a.jsonl", list(AGENT)), block_size=BS, limit=1)
    assert len(wl.requests) == 1 and wl.requests[0].parents == ()


BAD = [
    (_row("x", 0, [1], wait_for="r0"), "wait_for", "list of request ids"),
    (_row("x", 0, [1], wait_for=[1]), "wait_for", "list of request ids"),
    (_row("x", 0, [1], wait_for=["nope"]), "wait_for", "earlier line"),
    (_row("x", 0, [1], branches=["nope"]), "branches", "later line"),
    (_row("x", 0, [1], branches=[7]), "branches", "list of request ids"),
    (_row("x", 0, [1], prefix_reset="yes"), "prefix_reset", "true or false"),
    (_row("x", 0, [1], prefix_reset=1), "prefix_reset", "true or false"),
    (_row("x", 0, [1], wait_for=["r0"], tool_wait_ms=-1), "tool_wait_ms", ">= 0"),
    (_row("x", 0, [1], wait_for=["r0"], tool_wait_ms="5"), "tool_wait_ms", "number of ms"),
    (_row("x", 0, [1], wait_for=["r0"], tool_wait_ms=True), "tool_wait_ms", "number of ms"),
    (_row("x", 0, [1], wait_for=["r0"], delay=float("inf")), "delay", "finite"),
    (_row("x", 0, [1], wait_for=["r0"], delay=1, delay_ms=1), "delay", "not both"),
    (_row("x", 0, [1], delay=10), "delay", "no wait_for"),
    (_row("x", 0, [1], tool_wait_ms=10), "tool_wait_ms", "no wait_for"),
    (_row("r0", 0, [1]), "request_id", "already names line 2"),
    (_row(7, 0, [1]), "request_id", "must be a string"),  # type: ignore[arg-type]
    ({**_row("x", 0, [1], wait_for=["r0"]), "request_id": None}, "request_id", "needs a"),
    (_row("x", 0, [1], session_id=3), "session_id", "must be a string"),
    (_row("x", None, [1]), "timestamp", "missing"),
]


@pytest.mark.parametrize("row, field, needle", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_malformed_fields_name_the_line_and_field(
    tmp_path: Path, row: dict[str, Any], field: str, needle: str
) -> None:
    path = _write(tmp_path / "bad.jsonl", ["", _row("r0", 0, [1]), row])  # a blank line 1
    with pytest.raises(TraceFieldError, match=needle) as err:
        load_trace(path, block_size=BS)
    assert (err.value.line, err.value.field) == (3, field)
    assert f"bad.jsonl:3: field {field!r}" in str(err.value)
    assert isinstance(err.value, ConfigError)  # the CLI's exit-2 error path


def test_a_branch_to_an_earlier_row_is_refused(tmp_path: Path) -> None:
    rows = [_row("a", 0, [1]), _row("b", 1, [1, 2], branches=["a"])]
    with pytest.raises(TraceFieldError, match="'a' is not the request_id of a later line"):
        load_trace(_write(tmp_path / "t.jsonl", rows), block_size=BS)


def test_a_non_object_line_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r":1: not a Mooncake trace record"):
        load_trace(_write(tmp_path / "t.jsonl", ["[1, 2]"]), block_size=BS)
