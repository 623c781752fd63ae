"""The engine-hash half of the parity check: can the gateway predict an engine's block hashes?

The content-key half (`parity.py`) asks whether the engine's events hold the blocks the
gateway predicts; this half asks whether the hashes those events carry are the ones
vLLM's own `sha256_cbor` chain gives (`quillcache.hashing.vllm_event_hashes`: the seed
of NONE_HASH, the block size, the extra keys), and when they are not, names the likely
cause. Everything here is a pure function of what the engine said: its /metrics page
(which algorithm) and the BlockStored events it published for the probe.

Facts from vLLM 0.32 (`vllm/v1/core/kv_cache_utils.py`, `vllm/utils/hashing.py`,
`vllm/config/cache.py`):

* `--prefix-caching-hash-algo` is one of `sha256` (the default: SHA-256 over a Python
  pickle), `sha256_cbor` (SHA-256 over canonical CBOR, the one other languages can
  reproduce), `xxhash` (pickle) and `xxhash_cbor` (xxh3-128 over CBOR). The engine states
  it in /metrics: `vllm:cache_config_info` carries every CacheConfig field as a label,
  `prefix_caching_hash_algo` among them.
* NONE_HASH, the parent of block 0, is the hash of a seed string: PYTHONHASHSEED when set;
  else "vllm-none-hash" for the sha256 variants and a random per-process value for the
  xxhash ones (releases before 0.32 seeded every algorithm randomly). The engine does not
  reveal PYTHONHASHSEED: the worker's `hash_seed` setting tells the gateway.
* Events carry each digest's last 8 bytes big-endian (the decoder normalises the bytes
  mode to the same value).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from quillcache.events.types import BlockStored, MmKey
from quillcache.hashing import vllm_event_hashes

#: vLLM's NONE_HASH seed when PYTHONHASHSEED is unset (sha256 and sha256_cbor, vLLM >= 0.32).
VLLM_DEFAULT_SEED = "vllm-none-hash"
#: The algorithm the gateway reproduces.
PREDICTED_ALGORITHM = "sha256_cbor"

HashState = Literal["ok", "mismatch", "not predictable", "skipped", "unchecked"]
HASH_STATES: tuple[HashState, ...] = ("ok", "mismatch", "not predictable", "skipped", "unchecked")

_FIX = "start it with --prefix-caching-hash-algo sha256_cbor"
# vLLM's algorithms the gateway does not reproduce, and why.
_NOT_PREDICTABLE = {
    "sha256": "the engine uses vLLM's default 'sha256' (SHA-256 of a Python pickle), which "
    f"the gateway does not reproduce; {_FIX}",
    "xxhash": "the engine uses 'xxhash' (xxh3-128 of a Python pickle, seeded randomly unless "
    f"PYTHONHASHSEED is set), which the gateway does not reproduce; {_FIX}",
    "xxhash_cbor": "the engine uses 'xxhash_cbor' (xxh3-128, seeded randomly unless "
    f"PYTHONHASHSEED is set), which the gateway does not reproduce; {_FIX}",
}
_CONFIG_INFO = re.compile(r"^vllm:cache_config_info\{([^\n]*)\}", re.M)
_ALGO_LABEL = re.compile(r'(?:^|,)\s*prefix_caching_hash_algo="([^"]*)"')


def hash_algorithm_of(metrics_page: str) -> str | None:
    """The engine's prefix-caching hash algorithm as its /metrics page states it
    (`vllm:cache_config_info{prefix_caching_hash_algo="..."}`); None when it does not."""
    for info in _CONFIG_INFO.finditer(metrics_page):
        algo = _ALGO_LABEL.search(info.group(1))
        if algo is not None:
            return algo.group(1)
    return None


def speaks_sglang(metrics_page: str) -> bool:
    """SGLang's /metrics (its families are `sglang:...`), without vLLM's config info."""
    return "\nsglang:" in "\n" + metrics_page and "vllm:cache_config_info" not in metrics_page


@dataclass(frozen=True)
class PublishedChain:
    """What the engine published for one prompt: its block hashes (as events carry them),
    the tokens of those blocks, the tokens per block its events declare, and each block's
    extra keys (None: none)."""

    hashes: list[int]
    token_ids: list[int]
    block_size: int
    extra_keys: list[Sequence[object] | None] = field(default_factory=list)
    lora_name: str | None = None


def find_chain(events: Iterable[object], tokens: Sequence[int]) -> PublishedChain | None:
    """The chain of BlockStored events of a prompt starting at `tokens` (block 0's parent
    None, its tokens a prefix of the prompt), followed parent to child through the events
    in order; None when the engine published no such block 0. Blocks past the prompt's
    last full block (filled by generated tokens) are left out."""
    stored = [e for e in events if isinstance(e, BlockStored) and e.block_hashes]
    prompt = list(tokens)
    for at, first in enumerate(stored):
        bs = first.block_size
        if first.parent_block_hash is not None or bs <= 0 or len(prompt) < bs:
            continue
        if list(first.token_ids[:bs]) != prompt[:bs]:
            continue
        hashes: list[int] = []
        token_ids: list[int] = []
        extra: list[Sequence[object] | None] = []
        for ev in stored[at:]:
            if ev is not first and (not hashes or ev.parent_block_hash != hashes[-1]):
                continue
            if ev.block_size != bs or len(ev.token_ids) != bs * len(ev.block_hashes):
                break  # not a chain of whole blocks: read no further
            keys = list(ev.extra_keys or ())
            for i, h in enumerate(ev.block_hashes):
                hashes.append(int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h)
                token_ids.extend(ev.token_ids[i * bs : (i + 1) * bs])
                extra.append(keys[i] if i < len(keys) and keys[i] else None)
        full = min(len(hashes), len(prompt) // bs)
        while full and token_ids[: full * bs] != prompt[: full * bs]:
            full -= 1  # the engine's tokens leave the prompt's: keep what they share
        return PublishedChain(
            hashes[:full], token_ids[: full * bs], bs, extra[:full], first.lora_name
        )
    return None


@dataclass(frozen=True)
class HashVerdict:
    """The engine-hash check of one engine: its state, the cause or reason, and the
    evidence (the first few hashes each side has, as hex)."""

    state: HashState
    detail: str = ""
    algorithm: str | None = None  # as the engine states it (None: it does not)
    seed: str | None = None  # the seed the gateway predicted with
    block_size: int | None = None  # the engine's tokens per hashed block, from its events
    published: list[int] = field(default_factory=list)
    predicted: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.state}: {self.detail}" if self.detail else self.state

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "detail": self.detail,
            "algorithm": self.algorithm,
            "seed": self.seed,
            "block_size": self.block_size,
            "published": [f"{h:016x}" for h in self.published[:4]],
            "predicted": [f"{h:016x}" for h in self.predicted[:4]],
        }


VllmKey = tuple[str, str] | tuple[str, str, int]


def _extra_keys(chain: PublishedChain) -> tuple[list[list[VllmKey] | None] | None, str]:
    """The blocks' extra keys as vLLM hashes them, rebuilt from the untagged ones its events
    carry (vLLM's `to_event_extra_keys`: a bare cache salt on block 0, `[mm_hash, offset]`
    per multimodal item, in the order hashed): (keys, ""), or (None, why they cannot be
    rebuilt): a LoRA block hashes the adapter's path, which the event drops, and a
    prompt-embeds digest is not interpreted by the decoder."""
    out: list[list[VllmKey] | None] = []
    for i, keys in enumerate(chain.extra_keys):
        block: list[VllmKey] = []
        for k in keys or ():
            if isinstance(k, MmKey):
                block.append(("mm", k.hash, k.offset))
            elif isinstance(k, str) and chain.lora_name and k == chain.lora_name:
                return None, "a LoRA adapter's blocks hash its path, which vLLM's events drop"
            elif isinstance(k, str) and i == 0:
                block.append(("cache_salt", k))
            else:
                return None, f"block {i} carries an extra key the gateway cannot rebuild ({k!r})"
        out.append(block or None)
    return (out if any(out) else None), ""


def judge(
    tokens: Sequence[int],
    block_size: int,
    *,
    algorithm: str | None,
    seed: str | None,
    chain: PublishedChain | None,
    sglang: bool = False,
) -> HashVerdict:
    """Compare the hashes the gateway predicts for `tokens` (sha256_cbor, `block_size`
    tokens a block, NONE_HASH from `seed`, None: vLLM's default) with the engine's
    published `chain`, given the `algorithm` the engine states (None: it does not).

    * not predictable: the engine states an algorithm the gateway does not reproduce, or
      it is SGLang (its own chain);
    * skipped: the engine published no blocks for the probe (`chain` None or empty);
    * mismatch, likely cause named: block size (its events' tokens per block differ), seed
      (the engine says sha256_cbor, or its hashes are those of another known seed), hash
      algorithm (the engine states none, and its hashes are not sha256_cbor's);
    * ok: every published hash is the predicted one.
    """
    gateway_seed = VLLM_DEFAULT_SEED if seed is None else seed
    verdict: dict[str, Any] = {"algorithm": algorithm, "seed": gateway_seed}
    if chain is not None and chain.hashes:  # the evidence, whatever the verdict
        verdict["block_size"] = chain.block_size
        verdict["published"] = chain.hashes
    if algorithm is not None and algorithm != PREDICTED_ALGORITHM:
        why = _NOT_PREDICTABLE.get(
            algorithm,
            f"the engine's hash algorithm {algorithm!r} is not vLLM's sha256_cbor, the one "
            "the gateway reproduces",
        )
        return HashVerdict("not predictable", why, **verdict)
    if algorithm is None and sglang:
        why = "SGLang hashes pages with its own chain, not vLLM's (the gateway does not predict it)"
        return HashVerdict("not predictable", why, **verdict)
    if chain is None or not chain.hashes:
        why = "the engine published no block of the probe (see the content-key check)"
        return HashVerdict("skipped", why, **verdict)
    n = len(chain.hashes)
    prompt = list(tokens)
    extra, unbuildable = _extra_keys(chain)
    if unbuildable:
        return HashVerdict("not predictable", unbuildable, **verdict)
    if chain.block_size != block_size:
        predicted = vllm_event_hashes(prompt[: n * block_size], block_size, seed=gateway_seed)
        same_size = vllm_event_hashes(
            chain.token_ids, chain.block_size, seed=gateway_seed, extra_keys=extra
        )
        why = (
            f"block size: the engine hashes blocks of {chain.block_size} tokens, the gateway "
            f"predicts blocks of {block_size}"
        )
        if same_size.tolist() == chain.hashes:
            why += f" (with {chain.block_size}-token blocks its hashes are predicted exactly)"
        return HashVerdict("mismatch", why, predicted=predicted.tolist(), **verdict)
    predicted = vllm_event_hashes(
        prompt[: n * block_size], block_size, seed=gateway_seed, extra_keys=extra
    ).tolist()
    verdict["predicted"] = predicted
    if predicted == chain.hashes:
        return HashVerdict("ok", "", **verdict)
    if gateway_seed != VLLM_DEFAULT_SEED:
        default = vllm_event_hashes(
            prompt[: n * block_size], block_size, seed=VLLM_DEFAULT_SEED, extra_keys=extra
        )
        if default.tolist() == chain.hashes:
            why = (
                f"seed: the engine's NONE_HASH comes from vLLM's default seed "
                f"{VLLM_DEFAULT_SEED!r} (its PYTHONHASHSEED is unset), the gateway's from "
                f"hash_seed {gateway_seed!r}"
            )
            return HashVerdict("mismatch", why, **verdict)
    if algorithm == PREDICTED_ALGORITHM:
        why = (
            f"seed: the engine hashes with sha256_cbor, but not from NONE_HASH seed "
            f"{gateway_seed!r}: set the worker's hash_seed to the engine's PYTHONHASHSEED "
            "(vLLM before 0.32 seeds randomly when it is unset)"
        )
        return HashVerdict("mismatch", why, **verdict)
    why = (
        f"hash algorithm: the engine does not state its algorithm (no prefix_caching_hash_algo "
        f"in vllm:cache_config_info) and its hashes are not sha256_cbor's from seed "
        f"{gateway_seed!r}; {_FIX}"
    )
    return HashVerdict("mismatch", why, **verdict)
