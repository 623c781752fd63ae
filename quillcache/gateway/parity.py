"""The startup parity self-check: do the engine's events carry the keys we predict?

A tokenizer, chat template, block size or namespace mismatch would make every routing
decision blind, so each engine gets probe prompts and the gateway checks that the blocks
its events report are exactly the predicted keys, and warns loudly otherwise. With a
local tokenizer a chat probe checks the chat template too.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import httpx

from quillcache.connectors import EventIngestor
from quillcache.controlplane import ControlPlane
from quillcache.errors import QuillCacheError
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
        """Probe one engine; sets and returns `w.parity` ("ok", "mismatch: ...", "skipped: ...")."""
        if not w.sources:
            w.parity = "skipped: no KV event source"
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
                problem = await self._probe(w, body, is_chat, timeout_s)
            except (httpx.HTTPError, QuillCacheError) as exc:
                w.parity = f"skipped: probe failed: {exc}"
                log.warning("parity check of worker %d skipped: %s", w.id, exc)
                return w.parity
            if problem:
                problems.append(f"{name}: {problem}")
        if not problems:
            w.parity = "ok"
            log.info("parity check of worker %d passed", w.id)
            return w.parity
        w.parity = "mismatch: " + "; ".join(problems)
        log.error(
            "PARITY CHECK FAILED for worker %d (%s): %s. Routing will not see this engine's "
            "cache: check the tokenizer, chat template, block size and model name.",
            w.id,
            w.url,
            w.parity,
        )
        return w.parity

    async def _probe(
        self, w: Worker, body: dict[str, Any], chat: bool, timeout_s: float
    ) -> str | None:
        """One probe request; None when the engine's events cover every predicted block."""
        tokens = await self.tokenizer.tokens(body, chat, w.url)
        keys = content_keys(
            tokens, self.plane.block_size, self.identifier.namespace_of(w.base_model, "")
        )
        path = "/v1/chat/completions" if chat else "/v1/completions"
        resp = await self.client.post(f"{w.url}{path}", json=body)
        resp.raise_for_status()
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
