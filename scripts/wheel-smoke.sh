#!/usr/bin/env bash
# Smoke test of one built wheel, as a user gets it: a fresh venv, `pip install` of the
# wheel with its online extra, then the three things a user does first: simulate,
# bench-index with the persistent backends (RocksDB and Holt must be in the wheel),
# and a gateway in front of a simulated engine answering a completion.
# Usage: scripts/wheel-smoke.sh dist/quillcache-*.whl   (the wheels workflow and
# `make wheel-smoke` call it). Runs outside the source tree so that the installed
# package, not the checkout, is what gets imported.
set -euo pipefail

wheel=$(realpath "${1:?usage: wheel-smoke.sh WHEEL}")
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
export QUILLCACHE_STATE_DIR="$work/state"  # the gateway secret of this test only

"$python" -m venv venv
venv/bin/python -m pip install -q --upgrade pip
# the dev lock pins the dependencies the suite was tested with
venv/bin/python -m pip install -q -c "$here/requirements-dev.lock" "${wheel}[online]"
qc=venv/bin/quillcache

echo "wheel-smoke: simulate"
"$qc" simulate --requests 120 --prefix-groups 4 --no-progress --json - > sim.json
venv/bin/python -c "
import json
r = json.load(open('sim.json'))['results']
assert len(r) >= 10 and all(0 <= x['block_hit_rate'] <= 1 for x in r), r
print('  ', len(r), 'routers simulated')"

echo "wheel-smoke: bench-index with the persistent backends"
"$qc" bench-index --backend native,native-wal,rocksdb,holt --workload synthetic \
  --requests 300 --queries 200 --workdir bench --json - > bench.json
venv/bin/python -c "
import json
results = {r['backend']: r for r in json.load(open('bench.json'))['results']}
for name in ('native', 'native-wal', 'rocksdb', 'holt'):
    assert 'skipped' not in results[name], (name, results[name].get('skipped'))
    print('  ', name, int(results[name]['blocks_per_s']), 'blocks/s')"

echo "wheel-smoke: a gateway in front of a simulated engine"
venv/bin/python - <<'PY'
import tempfile
from pathlib import Path

import httpx

from quillcache.up import stack

with tempfile.TemporaryDirectory() as d, stack(1, workdir=Path(d), time_scale=0.0) as (
    engines,
    gateway,
):
    answer = httpx.post(
        gateway.url + "/v1/completions",
        json={"model": "sim-model", "prompt": "Hello from the wheel", "max_tokens": 4},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-quillcache-worker"] == "0"
    print("   completion routed to worker", answer.headers["x-quillcache-worker"])
PY
echo "wheel-smoke: OK ($(basename "$wheel"))"
