"""The golden frames of `specs/kv-events.md` (vLLM 0.34.0), loaded from tests/vectors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_PATH = Path(__file__).resolve().parent.parent / "vectors" / "kv_events_golden.json"
GOLDEN: dict[str, Any] = json.loads(_PATH.read_text())
TOPIC = bytes.fromhex(GOLDEN["topic_hex"])
FRAMES: list[tuple[int, bytes, dict[str, Any]]] = [
    (f["seq"], bytes.fromhex(f["payload_hex"]), f["expected"]) for f in GOLDEN["frames"]
]
