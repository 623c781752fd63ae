"""SGLang's golden frames (`tests/vectors/sglang_kv_events.json`, made by SGLang's own
publisher code, see its generator), and what each means in QuillCache's types,
derived from the arguments SGLang was given (not from any decoder)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quillcache.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    normalize_medium,
)

_PATH = Path(__file__).resolve().parent.parent / "vectors" / "sglang_kv_events.json"
GOLDEN: dict[str, Any] = json.loads(_PATH.read_text())
RELEASES: list[str] = list(GOLDEN["releases"])
U64 = (1 << 64) - 1


@dataclass(frozen=True)
class Frame:
    release: str
    layer: str  # pub_rank0 | pub_rank1 | msgspec_no_rank
    index: int
    topic: bytes | None  # None: encoded outside the publisher
    seq: int | None
    payload: bytes
    sent: dict[str, Any]

    @property
    def id(self) -> str:
        return f"{self.release}-{self.layer}-{self.index}"


def frames() -> list[Frame]:
    out = []
    for release, r in GOLDEN["releases"].items():
        for layer, items in r["frames"].items():
            for i, item in enumerate(items):
                if "frames_hex" in item:
                    topic, seq, payload = (bytes.fromhex(f) for f in item["frames_hex"])
                    out.append(
                        Frame(
                            release,
                            layer,
                            i,
                            topic,
                            int.from_bytes(seq, "big"),
                            payload,
                            item["sent"],
                        )
                    )
                else:
                    payload = bytes.fromhex(item["payload_hex"])
                    out.append(Frame(release, layer, i, None, None, payload, item["sent"]))
    return out


def salt_of(fields: dict[str, Any]) -> str | None:
    """The salt SGLang sent: its own field (>= 0.5.20) or the metadata map (0.5.18-19)."""
    meta = fields.get("metadata") or {}
    salt: str | None = fields.get("cache_salt", meta.get("cache_salt"))
    return salt


def sent_events(sent: dict[str, Any]) -> list[Event]:
    """The events as QuillCache's types, hashes and media as SGLang was given them (the
    encoder's input)."""
    out: list[Event] = []
    for e in sent["events"]:
        if e["type"] == "BlockStored":
            out.append(
                BlockStored(
                    block_hashes=e["block_hashes"],
                    parent_block_hash=e["parent_block_hash"],
                    token_ids=e["token_ids"],
                    block_size=e["block_size"],
                    lora_id=e["lora_id"],
                    medium=e.get("medium"),
                    lora_name=e.get("lora_name"),
                    cache_salt=salt_of(e),
                    session_id=e.get("session_id"),
                )
            )
        elif e["type"] == "BlockRemoved":
            out.append(BlockRemoved(block_hashes=e["block_hashes"], medium=e.get("medium")))
        else:
            out.append(AllBlocksCleared())
    return out


def expected_batch(sent: dict[str, Any]) -> EventBatch:
    """What a decoder must return: hashes as u64 bits, media normalised, the salt and
    LoRA name kept, `session_id` not kept (docs/kv-events.md, "SGLang")."""
    out: list[Event] = []
    for e in sent["events"]:
        if e["type"] == "BlockStored":
            parent = e["parent_block_hash"]
            out.append(
                BlockStored(
                    block_hashes=tuple(h & U64 for h in e["block_hashes"]),
                    parent_block_hash=None if parent is None else parent & U64,
                    token_ids=tuple(e["token_ids"]),
                    block_size=e["block_size"],
                    lora_id=e["lora_id"],
                    medium=normalize_medium(e.get("medium")),
                    lora_name=e.get("lora_name"),
                    extra_keys=(),
                    group_idx=0,
                    cache_salt=salt_of(e),
                )
            )
        elif e["type"] == "BlockRemoved":
            out.append(
                BlockRemoved(
                    tuple(h & U64 for h in e["block_hashes"]), normalize_medium(e.get("medium")), 0
                )
            )
        else:
            out.append(AllBlocksCleared())
    return EventBatch(sent["ts"], tuple(out), sent["attn_dp_rank"])
