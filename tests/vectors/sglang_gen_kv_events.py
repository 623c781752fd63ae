"""Regenerates tests/vectors/sglang_kv_events.json: SGLang's KV-event frames as SGLang's
own publisher code writes them, one section per release whose wire format differs.

Not needed at test time (the tests read the JSON). It needs SGLang's wheels and the
publisher's own dependencies, none of them QuillCache's, so it runs in a venv of its own:

    python -m venv /tmp/sglvenv
    /tmp/sglvenv/bin/pip install msgspec==0.23.0 pyzmq==27.3.0 pydantic==2.14.4 psutil
    mkdir -p /tmp/sglw && cd /tmp/sglw
    for v in 0.4.10 0.5.16 0.5.19 0.5.21 0.5.23; do pip download sglang==$v --no-deps; done
    /tmp/sglvenv/bin/python /work/main/tests/vectors/sglang_gen_kv_events.py /tmp/sglw

For each release, the script takes `sglang/srt/disaggregation/kv_events.py` out of the
wheel (with `sglang/srt/utils/network.py` where the module imports it; the one other
SGLang import, `runtime_context.get_parallel`, is never called here and is an empty
stand-in) and loads it as a module of its own, without the rest of SGLang (torch etc.).
Then, with that module's classes only:

* `pub_rank0` / `pub_rank1`: a real `ZmqEventPublisher(attn_dp_rank=r,
  endpoint="tcp://*:P", replay_endpoint="tcp://*:R", topic=TOPIC)` publishes the batches
  (`KVEventBatch(ts=..., events=[...])`, rank left to the publisher as the scheduler
  does); a ZMQ SUB on 127.0.0.1 records each message's frames `[topic, seq, payload]`.
  Rank 1 listens on P + 1 (SGLang offsets the port by the rank).
* `replay`: a DEALER sends `[b"", seq 0 as 8 bytes]` to the rank-0 replay socket and
  records every reply frame up to and including the end marker.
* `msgspec_no_rank`: `msgspec.msgpack.encode(KVEventBatch(ts, events))` with the rank
  unset: the layout of a batch encoded outside the publisher (two elements while
  `EventBatch` has `omit_defaults`, a nil third element after).

`sent` records the arguments given to SGLang's constructors (fields a release does not
have are left out), so the tests derive what a decoder must return from what SGLang was
asked to send, not from any decoder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "sglang_kv_events.json"
RELEASES = ("0.4.10", "0.5.16", "0.5.19", "0.5.21", "0.5.23")
TOPIC = "kv@sglang@tiny"
BASE_PORT = 47_231  # PUB rank r: BASE_PORT + r; replay: BASE_PORT + 10 + r

# Signed 64-bit page hashes (SGLang's are the first 8 bytes of a SHA-256, as int64):
# both signs and both extremes.
H = [-0x7A5C_0D3E_61B2_9F01, 0x1F2E_3D4C_5B6A_7988, -1, -(2**63), 2**63 - 1]

# (type, fields) of every event, all optional fields included; each release gets the
# ones its structs declare. `medium` names are SGLang's StorageMedium values.
EVENTS: list[list[tuple[str, dict[str, Any]]]] = [
    [  # batch 0: a plain store (no parent, no LoRA), then its child on the CPU tier
        (
            "BlockStored",
            {
                "block_hashes": [H[0]],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
            },
        ),
        (
            "BlockStored",
            {
                "block_hashes": [H[1], H[2]],
                "parent_block_hash": H[0],
                "token_ids": [5, 6, 7, 8, 9, 10, 11, 4294967295],
                "block_size": 4,
                "lora_id": 7,
                "medium": "CPU_PINNED",
            },
        ),
    ],
    [  # batch 1: the request metadata of the newer releases, and the other tiers
        (
            "BlockStored",
            {
                "block_hashes": [H[3]],
                "parent_block_hash": H[2],
                "token_ids": [12, 13, 14, 15],
                "block_size": 4,
                "lora_id": 3,
                "medium": "DISK",
                "cache_salt": "tenant-a",
                "session_id": "sess-42",
                "lora_name": "sql-lora",
            },
        ),
        (
            "BlockStored",
            {
                "block_hashes": [H[4]],
                "parent_block_hash": None,
                "token_ids": [16, 17, 18, 19],
                "block_size": 4,
                "lora_id": None,
                "medium": "EXTERNAL",
                "session_id": "sess-42",
            },
        ),
        ("BlockRemoved", {"block_hashes": [H[1], H[2]], "medium": "CPU_PINNED"}),
        ("BlockRemoved", {"block_hashes": [H[4]], "medium": "EXTERNAL"}),
    ],
    [  # batch 2: a removal without a medium, then the whole cache dropped
        ("BlockRemoved", {"block_hashes": [H[0]], "medium": None}),
        ("AllBlocksCleared", {}),
    ],
]
TS = [1_700_000_000.25, 1_700_000_001.5, 1_700_000_002.0]


def _load(wheel: Path, workdir: Path) -> types.ModuleType:
    """kv_events.py of one wheel as a module of its own (see the module docstring)."""
    with zipfile.ZipFile(wheel) as zf:
        source = zf.read("sglang/srt/disaggregation/kv_events.py").decode()
        names = set(zf.namelist())
        network = "sglang/srt/utils/network.py"
        for pkg in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation"):
            sys.modules.pop(pkg, None)
            sys.modules[pkg] = types.ModuleType(pkg)
        for mod in ("sglang.srt.utils.network", "sglang.srt.runtime_context"):
            sys.modules.pop(mod, None)
        if "from sglang.srt.utils.network" in source and network in names:
            path = workdir / "network.py"
            path.write_bytes(zf.read(network))
            spec = importlib.util.spec_from_file_location("sglang.srt.utils.network", path)
            assert spec and spec.loader
            net = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = net
            spec.loader.exec_module(net)
        ctx = types.ModuleType("sglang.srt.runtime_context")

        def get_parallel() -> Any:
            raise RuntimeError("not available outside SGLang")

        ctx.get_parallel = get_parallel  # type: ignore[attr-defined]
        sys.modules[ctx.__name__] = ctx
    path = workdir / "kv_events.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sglang.srt.disaggregation.kv_events", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _declared(cls: Any) -> list[str]:
    import msgspec

    return [f.name for f in msgspec.structs.fields(cls)]


def _build(mod: Any, kind: str, fields: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """SGLang's struct for one event, and the arguments it was given."""
    cls = getattr(mod, kind)
    declared = _declared(cls)
    args = {k: v for k, v in fields.items() if k in declared}
    salt = fields.get("cache_salt")
    meta_cls = getattr(mod, "BlockStoredWithMetadata", None)
    if kind == "BlockStored" and salt is not None and "cache_salt" not in declared and meta_cls:
        # 0.5.18-0.5.19: a salted store is the metadata subclass (as the radix cache does)
        event = meta_cls(**args, metadata=mod.BlockStoredMetadata(cache_salt=salt))
        return event, {**args, "metadata": {"cache_salt": salt}}
    return cls(**args), args


def _release(version: str, wheel: Path) -> dict[str, Any]:
    import msgspec
    import zmq

    with tempfile.TemporaryDirectory() as tmp:
        mod = _load(wheel, Path(tmp))
    batches: list[tuple[list[Any], list[dict[str, Any]]]] = []
    for events in EVENTS:
        built = [(kind, *_build(mod, kind, f)) for kind, f in events]
        batches.append(([e for _, e, _ in built], [{"type": k, **a} for k, _, a in built]))

    ctx = zmq.Context.instance()
    out: dict[str, Any] = {
        "wheel": wheel.name,
        "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "declared_fields": {
            name: _declared(getattr(mod, name))
            for name in ("EventBatch", "BlockStored", "BlockRemoved", "AllBlocksCleared")
        },
        "topic_hex": TOPIC.encode().hex(),
        "frames": {},
    }
    for rank in (0, 1):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 5000)
        sub.connect(f"tcp://127.0.0.1:{BASE_PORT + rank}")
        pub = mod.ZmqEventPublisher(
            attn_dp_rank=rank,
            endpoint=f"tcp://*:{BASE_PORT}",
            replay_endpoint=f"tcp://*:{BASE_PORT + 10}",
            topic=TOPIC,
        )
        time.sleep(0.5)  # the SUB's subscription reaches the PUB before the first batch
        live = []
        for (events, sent), ts in zip(batches, TS, strict=True):
            pub.publish(mod.KVEventBatch(ts=ts, events=events))
            frames = sub.recv_multipart()
            live.append(
                {
                    "frames_hex": [f.hex() for f in frames],
                    "sent": {"ts": ts, "attn_dp_rank": rank, "events": sent},
                }
            )
        out["frames"][f"pub_rank{rank}"] = live
        if rank == 0:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVTIMEO, 5000)
            dealer.connect(f"tcp://127.0.0.1:{BASE_PORT + 10}")
            request = [b"", (0).to_bytes(8, "big")]
            dealer.send_multipart(request)
            replies = []
            while True:
                reply = dealer.recv_multipart()
                replies.append([f.hex() for f in reply])
                if b"\xff" * 8 in reply:
                    break
            out["replay"] = {
                "request_hex": [f.hex() for f in request],
                "replies_hex": replies,
            }
            dealer.close(0)
        pub.shutdown()
        sub.close(0)
    out["frames"]["msgspec_no_rank"] = [
        {
            "payload_hex": msgspec.msgpack.encode(mod.KVEventBatch(ts=ts, events=events)).hex(),
            "sent": {"ts": ts, "attn_dp_rank": None, "events": sent},
        }
        for (events, sent), ts in zip(batches, TS, strict=True)
    ]
    return out


def main(wheel_dir: str) -> None:
    import msgspec
    import zmq

    wheels = Path(wheel_dir)
    doc: dict[str, Any] = {
        "generator": "tests/vectors/sglang_gen_kv_events.py (see its docstring)",
        "tools": {
            "python": sys.version.split()[0],
            "msgspec": msgspec.__version__,
            "pyzmq": zmq.__version__,
        },
        "note": "hashes in `sent` are SGLang's signed int64; frames are hex. "
        "pub_rank*: [topic, seq, payload] as received by a SUB; replay: DEALER frames.",
        "releases": {},
    }
    for version in RELEASES:
        found = sorted(wheels.rglob(f"sglang-{version}-*.whl"))
        if not found:
            raise SystemExit(f"no wheel for sglang {version} under {wheels}")
        doc["releases"][version] = _release(version, found[0])
        print(f"sglang {version}: {found[0].name}", file=sys.stderr)
    OUT.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/sglw")
