"""Runs the benchmark of one backend: ingest + queries in a child process, then for
a persistent backend SIGKILL it, time the reopen (recovery after a crash), close
cleanly, and time the reopen again (recovery after a clean close)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from quillcache.bench.backends import PERSISTENT


class BenchError(RuntimeError):
    pass


def _child(spec: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "quillcache.bench.child", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _lines(
    proc: subprocess.Popen[str], until: str | None = None, timeout_s: float | None = None
) -> list[dict[str, Any]]:
    """JSON lines from `proc` until one with phase `until` (or the end). A child
    still running after `timeout_s` is killed: `BenchError` says so (a backend too
    slow for a workload is reported, not waited for)."""
    assert proc.stdout is not None
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        proc.kill()

    timer = threading.Timer(timeout_s, expire) if timeout_s else None
    if timer:
        timer.daemon = True
        timer.start()
    out = []
    try:
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            obj = json.loads(line)
            out.append(obj)
            if obj.get("phase") == "failed":
                proc.wait()
                raise BenchError(
                    f"{obj['error']} (after {obj['calls_done']:,} of {obj['calls']:,} apply "
                    f"calls, {obj['blocks_stored']:,} blocks stored)"
                )
            if until is not None and obj.get("phase") == until:
                return out
        proc.wait()
    finally:
        if timer:
            timer.cancel()
    if expired.is_set():
        raise BenchError(f"did not finish within {timeout_s:g} s (--timeout)")
    if proc.returncode != 0:
        err = proc.stderr.read() if proc.stderr else ""
        raise BenchError(f"benchmark child failed ({proc.returncode}): {err.strip()[-2000:]}")
    return out


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_backend(
    name: str,
    workload_file: Path,
    options: dict[str, Any],
    workdir: Path | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    persistent = name in PERSISTENT
    base = Path(tempfile.mkdtemp(prefix=f"qc-bench-{name}-", dir=workdir))
    path = base / "index"
    spec = {
        "phase": "ingest",
        "backend": name,
        "workload": str(workload_file),
        "path": str(path) if persistent else None,
        "options": options,
        "chunk": options.get("chunk", 64),
        "wait_for_kill": persistent,
    }
    try:
        proc = _child(spec)
        try:
            lines = _lines(proc, until="ready" if persistent else None, timeout_s=timeout_s)
        except BenchError:
            proc.kill()
            raise
        result: dict[str, Any] = {"backend": name, **lines[0]}
        result.pop("phase", None)
        if not persistent:
            return result
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        after_kill = _lines(_child({**spec, "phase": "reopen"}), timeout_s=timeout_s)[0]
        after_close = _lines(_child({**spec, "phase": "reopen"}), timeout_s=timeout_s)[0]
        for label, r in (("after SIGKILL", after_kill), ("after clean close", after_close)):
            if r["index_blocks"] != result["index_blocks"]:
                raise BenchError(
                    f"{name}: {r['index_blocks']} blocks {label}, {result['index_blocks']} before"
                )
        result["recovery_kill_s"] = after_kill["open_s"]
        result["recovery_clean_s"] = after_close["open_s"]
        result["recovery_kill_detail"] = after_kill.get("recovery")
        result["close_write_bytes"] = after_kill["close_write_bytes"]
        result["disk_bytes"] = dir_bytes(path)
        stored = max(1, result["blocks_stored"])
        result["write_bytes_per_block"] = result["ingest_write_bytes"] / stored
        result["write_bytes_per_block_with_close"] = (
            result["ingest_write_bytes"] + result["close_write_bytes"]
        ) / stored
        return result
    finally:
        shutil.rmtree(base, ignore_errors=True)


def environment() -> dict[str, Any]:
    import platform

    from quillcache import __version__

    return {
        "quillcache": __version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
    }
