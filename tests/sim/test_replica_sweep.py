"""The replica sweep (`python -m benchmarks.replicas.sweep`, issue 16 §3): a tiny run on
a generated Mooncake-format trace, and its checks and tables on doctored results."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.replicas import sweep
from tests.sim.trace_fixture import write_chained_trace

ROUTERS = ("quillcache", "round-robin")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, int]:
    """2 routers x N = 1, 2 x the three states on a 60-request conversation trace."""
    tmp = tmp_path_factory.mktemp("sweep")
    trace = tmp / "trace.jsonl"
    write_chained_trace(trace, sessions=15, turns=4)
    out = tmp / "r.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        status = sweep.main(
            [
                "--trace",
                str(trace),
                "--workers",
                "4",
                "--routers",
                ",".join(ROUTERS),
                "--replicas",
                "1,2",
                "--jobs",
                "1",
                "--json",
                str(out),
            ]
        )
    return json.loads(out.read_text()), buf.getvalue(), status


def test_tiny_sweep_structure_and_one_replica_precision(
    tiny: tuple[dict[str, Any], str, int],
) -> None:
    data, text, status = tiny
    assert status == 0, text
    results = data["results"]
    got = {(r["router"], r["replicas"], r["replica_state"]) for r in results}
    assert got == {(r, n, s) for r in ROUTERS for n in (1, 2) for s in sweep.STATES}
    for r in results:
        assert r["requests"] == 60 and r["workers"] == 4
        if r["replicas"] == 1 and r["replica_state"] in ("shared", "private"):
            assert r["routing_precision"] == 1.0, r
    # what was printed: the command, one table per state, the side-by-side one, checks
    first = text.splitlines()[0]
    assert first.startswith("`quillcache simulate --trace ") and "--replicas 1,2" in first
    for state in sweep.STATES:
        assert f"**{state}** (block hit · TTFT p50 / p99 · routing precision)" in text
    assert "**N = 2**, each cell shared / private / approximate" in text
    assert "checks: all passed" in text
    # 3 state tables + 1 side by side, each with a row per router
    for router in ROUTERS:
        assert sum(line.startswith(f"| {router} |") for line in text.splitlines()) == 4


def test_from_json_reformats_the_same_tables(
    tiny: tuple[dict[str, Any], str, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, text, _ = tiny
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    assert sweep.main(["--from-json", str(path)]) == 0
    assert capsys.readouterr().out.strip() == text.split("\n", 2)[2].strip()


def _result(router: str, state: str, n: int, precision: float, hit: float = 0.1) -> dict[str, Any]:
    return {
        "router": router,
        "replica_state": state,
        "replicas": n,
        "routing_precision": precision,
        "block_hit_rate": hit,
        "ttft_p50_s": 1.0,
        "ttft_p99_s": 10.0,
    }


def _sane() -> list[dict[str, Any]]:
    out = []
    for n, prec in ((1, (1.0, 1.0, 0.99)), (8, (0.95, 0.3, 0.25))):
        for state, p in zip(sweep.STATES, prec, strict=True):
            out.append(_result("quillcache", state, n, p))
    return out


def test_checks_pass_on_sane_results() -> None:
    assert sweep.checks(_sane()) == ([], [])


def test_checks_flag_one_replica_below_full_precision() -> None:
    bad = copy.deepcopy(_sane())
    bad[1]["routing_precision"] = 0.97  # one private replica disagrees with the shadow
    errors, _ = sweep.checks(bad)
    assert errors == ["quillcache, 1 private replica: precision 0.97 != 1.0"]


def test_checks_warn_when_shared_state_decides_worse_than_private() -> None:
    bad = copy.deepcopy(_sane())
    bad[3]["routing_precision"] = 0.2  # N = 8 shared below private's 0.3
    errors, warnings = sweep.checks(bad)
    assert not errors
    assert warnings == ["quillcache, N = 8: shared precision 0.200 < private 0.300"]
    # within the tolerance: no warning
    bad[3]["routing_precision"] = 0.29
    assert sweep.checks(bad) == ([], [])


def test_a_check_error_is_exit_status_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _sane()
    bad[0]["routing_precision"] = 0.5
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"meta": {}, "results": bad}))
    assert sweep.main(["--from-json", str(path)]) == 1
    assert "- ERROR quillcache, 1 shared replica: precision 0.5 != 1.0" in capsys.readouterr().out


def test_tables_cells_and_side_by_side() -> None:
    results = _sane()
    text = sweep.tables(results)
    assert "| router | N = 1 | N = 8 |" in text
    assert "| quillcache | 10.0 % · 1.00 / 10.0 s · 1.00 | 10.0 % · 1.00 / 10.0 s · 0.95 |" in text
    side = sweep.side_by_side(results)
    assert "| quillcache | 0.95 / 0.30 / 0.25 | 10.0 / 10.0 / 10.0 | 1.00 / 1.00 / 1.00 |" in side
    assert "**N = 1**" in sweep.side_by_side(results, 1)


def test_a_missing_trace_is_exit_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sweep.main(["--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "no trace at" in capsys.readouterr().err
