"""The block hashes a simulated vLLM engine publishes, per `--prefix-caching-hash-algo`.

The engine model (`quillcache.sim.engine`) names blocks by its own 64-bit hash
(`xxh3_64_sim`, what the simulator publishes by default). With `sha256_cbor` or `sha256`
the simulator rewrites each batch it publishes so its BlockStored / BlockRemoved events
carry the hashes vLLM 0.32 computes for the same blocks (`hash_block_tokens` in
`vllm/v1/core/kv_cache_utils.py`): the digest of (parent digest, the block's tokens,
its extra keys), block 0's parent being NONE_HASH, the digest of the seed
(PYTHONHASHSEED, else "vllm-none-hash"); events carry each digest's last 8 bytes
big-endian. `sha256_cbor` is SHA-256 over canonical CBOR (`quillcache._native`);
`sha256` is vLLM's default, SHA-256 over `pickle.dumps(..., HIGHEST_PROTOCOL)` of the
same tuple (`vllm/utils/hashing.py`), which is cheap to reproduce in Python (checked
against vLLM 0.32's own `hash_block_tokens` for plain blocks).

Extra keys as vLLM folds them: the LoRA adapter (`("lora", name, path)`; the simulator
serves adapters by name, so the path is the name) on every block of a LoRA request, then
each image the block overlaps (`("mm", identifier, offset)`), then the cache salt on
block 0.
"""

from __future__ import annotations

import collections
import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

from quillcache.hashing import vllm_block_hashes, vllm_none_hash

#: The algorithms the simulator can publish; the first is the model's own.
HASH_ALGORITHMS = ("xxh3_64_sim", "sha256_cbor", "sha256")
#: vLLM's NONE_HASH seed when PYTHONHASHSEED is unset (sha256 variants, vLLM >= 0.32).
DEFAULT_SEED = "vllm-none-hash"

Tag = tuple[str, str, bool]  # (LoRA, cache_salt, is block 0), as SimEngine records them


def _pickle_sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _event_value(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


class VllmHasher:
    """Maps the model's block hashes to vLLM's, chaining each block from its parent's
    digest. Remembers the digests of the last `capacity` blocks (enough for every cached
    block's parent)."""

    def __init__(self, algorithm: str, seed: str | None, capacity: int) -> None:
        if algorithm not in HASH_ALGORITHMS[1:]:
            raise ValueError(f"no vLLM hashing for algorithm {algorithm!r}")
        self.algorithm = algorithm
        self.seed = DEFAULT_SEED if seed is None else seed
        self._capacity = max(capacity, 1)
        self._none = (
            vllm_none_hash(self.seed) if algorithm == "sha256_cbor" else _pickle_sha256(self.seed)
        )
        self._digests: collections.OrderedDict[int, bytes] = collections.OrderedDict()

    def _extra(
        self, tag: Tag | None, mm: Sequence[tuple[str, int]] | None
    ) -> list[tuple[str | int, ...]] | None:
        lora, salt, first = tag or ("", "", False)
        keys: list[tuple[str | int, ...]] = []
        if lora:
            keys.append(("lora", lora, lora))
        keys.extend(("mm", ident, off) for ident, off in mm or ())
        if salt and first:
            keys.append(("cache_salt", salt))
        return keys or None

    def _digest(
        self,
        parent: bytes,
        tokens: Sequence[int],
        tag: Tag | None,
        mm: Sequence[tuple[str, int]] | None = None,
    ) -> bytes:
        extra = self._extra(tag, mm)
        if self.algorithm == "sha256_cbor":
            return vllm_block_hashes(
                list(tokens),
                len(tokens),
                seed=self.seed,
                extra_keys=[extra] if extra else None,
                parent=parent,
            )[0]
        # vLLM's pickle path hashes (BlockHash bytes, tuple of ints, tuple of keys | None),
        # the keys those of the CBOR path (`generate_block_hash_extra_keys`)
        return _pickle_sha256((parent, tuple(tokens), tuple(extra) if extra else None))

    def rewrite(
        self,
        raw_events: list[dict[str, Any]],
        tags: dict[int, Tag],
        mm: dict[int, list[tuple[str, int]]] | None = None,
    ) -> None:
        """Replace, in place, the model's hashes in raw (dict) vLLM events with vLLM's
        (`mm`: the blocks' multimodal items by the model's hash)."""
        mm = mm or {}
        for ev in raw_events:
            if ev["type"] == "BlockStored":
                bs = int(ev["block_size"])
                parent_sim = ev.get("parent_block_hash")
                parent = self._none if parent_sim is None else self._digests.get(parent_sim)
                if parent is None:  # parent forgotten: chain from a stand-in, stays unique
                    parent = _pickle_sha256(("quillcache-sim-parent", parent_sim))
                if parent_sim is not None:
                    ev["parent_block_hash"] = _event_value(parent)
                out: list[int] = []
                tokens = list(ev["token_ids"])
                for i, h in enumerate(ev["block_hashes"]):
                    d = self._digest(parent, tokens[i * bs : (i + 1) * bs], tags.get(h), mm.get(h))
                    self._remember(h, d)
                    out.append(_event_value(d))
                    parent = d
                ev["block_hashes"] = out
            elif ev["type"] == "BlockRemoved":
                ev["block_hashes"] = [
                    _event_value(self._digests[h]) if h in self._digests else h
                    for h in ev["block_hashes"]
                ]

    def _remember(self, sim_hash: int, digest: bytes) -> None:
        self._digests[sim_hash] = digest
        self._digests.move_to_end(sim_hash)
        while len(self._digests) > self._capacity:
            self._digests.popitem(last=False)
