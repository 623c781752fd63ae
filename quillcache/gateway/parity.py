"""The startup parity self-check: do the engine's events carry the keys we predict?

A tokenizer, chat template, block size or namespace mismatch would make every routing
decision blind, so each engine gets probe prompts and the gateway checks that the blocks
its events report are exactly the predicted keys, and warns loudly otherwise. With a
local tokenizer a chat probe checks the chat template too.

The completion probe also checks the engine's own block hashes (`engine_hashes.py`):
the probe's BlockStored events, read back from the engine's replay socket, against the
sha256_cbor chain the gateway predicts. The worker's `parity` is "ok" only when the
content keys match and the hashes are not a mismatch: an engine whose hashes cannot be
predicted (vLLM's default pickle-based sha256, a random seed) routes fine, and says so in
`hash_parity` ("not predictable: why").
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import httpx

from quillcache._native import decode_batch
from quillcache.connectors import EventIngestor
from quillcache.connectors.replay import ReplayError, fetch_replay
from quillcache.controlplane import ControlPlane
from quillcache.errors import EventDecodeError, QuillCacheError
from quillcache.gateway.engine_hashes import (
    HashVerdict,
    find_chain,
    hash_algorithm_of,
    judge,
    speaks_sglang,
)
from quillcache.gateway.identify import RequestIdentifier
from quillcache.gateway.workers import Worker
from quillcache.identity import content_keys
from quillcache.tokenization.request import RequestTokenizer

log = logging.getLogger(__name__)


class ParityChecker:
    """Probes engines: does each one's event stream carry the keys the gateway predicts?"""

    def __init__(
        self,
        *,
        identifier: RequestIdentifier,
        tokenizer: RequestTokenizer,
        client: httpx.AsyncClient,
        plane: ControlPlane,
        ingestor: EventIngestor,
    ) -> None:
        self.identifier = identifier
        self.tokenizer = tokenizer
        self.client = client
        self.plane = plane
        self.ingestor = ingestor

    async def check(self, w: Worker, timeout_s: float = 5.0) -> str:
        """Probe one engine; sets and returns `w.parity` ("ok", "mismatch: ...",
        "skipped: ...") and sets `w.hash_parity` (`HashVerdict`)."""
        if not w.sources:
            w.parity = "skipped: no KV event source"
            w.hash_parity = HashVerdict("skipped", "no KV event source")
            return w.parity
        probe = f"quillcache parity probe {uuid.uuid4().hex} " * 8
        probes: list[tuple[str, dict[str, Any], bool]] = [
            ("completion", {"model": w.base_model, "prompt": probe, "max_tokens": 1}, False)
        ]
        if self.tokenizer.local is not None:
            messages = [{"role": "user", "content": probe + " chat"}]
            chat = {"model": w.base_model, "messages": messages, "max_tokens": 1}
            probes.append(("chat template", chat, True))
        problems = []
        for name, body, is_chat in probes:
            try:
                problem = await self._probe(w, body, is_chat, timeout_s, hashes=not is_chat)
            except (httpx.HTTPError, QuillCacheError) as exc:
                w.parity = f"skipped: probe failed: {exc}"
                w.hash_parity = HashVerdict("skipped", f"probe failed: {exc}")
                log.warning("parity check of worker %d skipped: %s", w.id, exc)
                return w.parity
            if problem:
                problems.append(f"{name}: {problem}")
        verdict = w.hash_parity
        if verdict.state == "mismatch":
            problems.append(f"engine hashes: {verdict.detail}")
        if not problems:
            w.parity = "ok"
            if verdict.state == "ok":
                log.info("parity check of worker %d passed, engine hashes included", w.id)
            else:  # content keys match: routing works, the hashes are not checked
                log.warning(
                    "parity check of worker %d (%s): content keys match; engine hashes %s",
                    w.id,
                    w.url,
                    verdict,
                )
            return w.parity
        w.parity = "mismatch: " + "; ".join(problems)
        if len(problems) == 1 and verdict.state == "mismatch":
            log.error(
                "PARITY CHECK FAILED for worker %d (%s): %s. Its content keys match (routing "
                "sees its cache), its block hashes are not the predicted ones: check its hash "
                "algorithm, PYTHONHASHSEED (the worker's hash_seed) and block size.",
                w.id,
                w.url,
                w.parity,
            )
            return w.parity
        log.error(
            "PARITY CHECK FAILED for worker %d (%s): %s. Routing will not see this engine's "
            "cache: check the tokenizer, chat template, block size and model name.",
            w.id,
            w.url,
            w.parity,
        )
        return w.parity

    async def _probe(
        self, w: Worker, body: dict[str, Any], chat: bool, timeout_s: float, *, hashes: bool
    ) -> str | None:
        """One probe request; None when the engine's events cover every predicted block.
        With `hashes`, also judges the engine's hashes of the probe (`w.hash_parity`)."""
        tokens = await self.tokenizer.tokens(body, chat, w.url)
        keys = content_keys(
            tokens, self.plane.block_size, self.identifier.namespace_of(w.base_model, "")
        )
        starts = self._replay_starts(w)  # before the probe: its batches come after these
        path = "/v1/chat/completions" if chat else "/v1/completions"
        resp = await self.client.post(f"{w.url}{path}", json=body)
        resp.raise_for_status()
        problem = await self._await_keys(w, keys, timeout_s)
        if hashes:
            w.hash_parity = await self._judge_hashes(w, tokens, starts)
        return problem

    async def _await_keys(self, w: Worker, keys: Any, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        replay_at = time.monotonic() + timeout_s / 2  # then fetch the tail from the replay socket
        held = 0
        while time.monotonic() < deadline:
            matches = self.plane.match(keys)
            held = max((m.blocks for m in matches if m.worker == w.id), default=0)
            if held >= len(keys):
                return None
            if time.monotonic() > replay_at:
                self.ingestor.request_tail_replay(w.id)
                replay_at = deadline
            await asyncio.sleep(0.05)
        return f"engine events cover {held} of {len(keys)} predicted blocks"

    def _replay_starts(self, w: Worker) -> dict[str, int]:
        """Replay endpoint -> the first seq worth reading for a probe sent now: one past
        the source's last applied seq (0 when nothing is applied yet)."""
        starts = {}
        for src in w.sources:
            if src.replay_endpoint:
                status = self.ingestor.sources.get((w.id, src.dp_rank))
                last = status.last_seq if status is not None else -1
                starts[src.replay_endpoint] = max(last + 1, 0)
        return starts

    async def _judge_hashes(
        self, w: Worker, tokens: list[int], starts: dict[str, int]
    ) -> HashVerdict:
        try:
            page = (await self.client.get(f"{w.url}/metrics")).text
        except httpx.HTTPError as exc:
            log.warning("parity check of worker %d: /metrics unreadable: %s", w.id, exc)
            page = ""
        algorithm, sglang = hash_algorithm_of(page), speaks_sglang(page)
        chain = None
        if starts:
            events = await asyncio.to_thread(self._published_events, w, starts)
            chain = find_chain(events, tokens)
        verdict = judge(
            tokens,
            self.plane.block_size,
            algorithm=algorithm,
            seed=w.config.hash_seed,
            chain=chain,
            sglang=sglang,
        )
        if verdict.state == "skipped" and not starts:
            verdict = HashVerdict(
                "skipped",
                "no replay socket to read the engine's published hashes from",
                algorithm=algorithm,
                seed=verdict.seed,
            )
        return verdict

    def _published_events(self, w: Worker, starts: dict[str, int]) -> list[object]:
        """The events each replay socket of `w` holds from its start seq on (blocking: run
        in a thread). A socket that does not answer, or a batch that does not decode,
        adds nothing (the ingestor counts and logs those)."""
        events: list[object] = []
        for endpoint, start in starts.items():
            try:
                replayed = fetch_replay(self.ingestor.ctx, endpoint, start, timeout_s=1.0)
            except ReplayError as exc:
                log.warning("parity check of worker %d: replay %s: %s", w.id, endpoint, exc)
                continue
            for _, payload in replayed.batches:
                try:
                    events.extend(decode_batch(payload).events)
                except EventDecodeError:
                    continue
        return events
