"""A completion request's routing identity: its tokens, namespace and content keys.

The rule itself (namespace, content keys) lives in `quillcache.identity`; this is where
the gateway feeds it: which base model and LoRA adapter a request names, which engine
tokenizes it when the gateway does not, the images of a chat prompt (their items fold
into the content keys as vLLM folds them into its block hashes:
`quillcache.tokenization.multimodal`), and the request's session and output budget.
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from quillcache import _native
from quillcache.gateway.parent_hints import ParentIds
from quillcache.gateway.tenancy import Identity
from quillcache.gateway.workers import WorkerPool
from quillcache.identity import content_keys, namespace
from quillcache.routing import Request as RouteRequest
from quillcache.tokenization.multimodal import (
    MmBlocks,
    MmPrompt,
    MultimodalPrompts,
    MultimodalUnavailable,
    has_media,
)
from quillcache.tokenization.request import EngineUnreachable, RequestTokenizer


class RequestIdentifier:
    """Turns a checked completion body into the `RouteRequest` the control plane routes."""

    def __init__(
        self,
        *,
        pool: WorkerPool,
        tokenizer: RequestTokenizer,
        block_size: int,
        tokenizer_id: str,
        session_header: str,
        on_tokenize_retry: Callable[[int], None],
        multimodal: MultimodalPrompts | None = None,
    ) -> None:
        self._pool = pool
        self._tokenizer = tokenizer
        self.block_size = block_size
        self._tokenizer_id = tokenizer_id
        self._session_header = session_header
        self._on_tokenize_retry = on_tokenize_retry
        self.multimodal = multimodal or MultimodalPrompts()
        # unique within this gateway: the plane tracks in-flight requests by it
        self._request_ids = itertools.count()
        self._parents = ParentIds()  # the clients' request ids, for parent hints

    @property
    def tokenizes_locally(self) -> bool:
        """Whether `identify_now` answers: a local tokenizer, and no image URL to await
        (a gateway that fetches them identifies every request in a task)."""
        return self._tokenizer.local is not None and not self.multimodal.config.fetch

    def base_model_of(self, model: str | None) -> str:
        """The base model of the worker serving `model` (any worker's when None)."""
        for w in self._pool.workers.values():
            if not model or model in w.models:
                return w.base_model
        return ""

    def model_root_of(self, model: str | None) -> str:
        """What the engine serving `model` hashes images with: its base model's `root`
        (vLLM's --model), which a --served-model-name does not change."""
        for w in self._pool.workers.values():
            if not model or model in w.models:
                return w.model_root or w.base_model
        return ""

    def namespace_of(self, model: str | None, salt: str) -> int:
        lora = self._pool.models().get(model or "", "")
        base = self.base_model_of(model)
        return namespace(base, self._tokenizer_id, lora, salt, self.block_size)

    async def identify(
        self,
        body: dict[str, Any],
        chat: bool,
        headers: Mapping[str, str],
        identity: Identity,
        candidates: frozenset[int] | None = None,
    ) -> tuple[RouteRequest, int]:
        """The routing request of a completion body, and its prompt length in tokens
        (tokenized by one of the `candidates` when the engine tokenizes)."""
        request, tokens = await self.identify_tokens(body, chat, headers, identity, candidates)
        return request, len(tokens)

    async def identify_tokens(
        self,
        body: dict[str, Any],
        chat: bool,
        headers: Mapping[str, str],
        identity: Identity,
        candidates: frozenset[int] | None = None,
    ) -> tuple[RouteRequest, list[int]]:
        """`identify` with the prompt's token ids themselves: what the policy engine
        keeps of a prefix it retains (the index keeps no tokens)."""
        tokens, mm = await self._prompt(body, chat, candidates)
        return self._route_request(body, tokens, headers, identity, mm), tokens

    def identify_now(
        self, body: dict[str, Any], chat: bool, headers: Mapping[str, str], identity: Identity
    ) -> tuple[RouteRequest, list[int]] | None:
        """`identify_tokens` without awaiting, when the gateway tokenizes locally (else
        None)."""
        local = self._tokenizer.local
        if local is None:
            return None
        if chat and has_media(body):
            if self.multimodal.needs_fetch(body):
                return None
            try:
                mm = self.multimodal.prompt_now(local, body, self.model_root_of(body.get("model")))
                return self._mm_route_request(body, mm, headers, identity), mm.tokens
            except MultimodalUnavailable as exc:
                self.multimodal.fallback(exc)
        tokens = self._tokenizer.local_tokens(body, chat)
        return self._route_request(body, tokens, headers, identity), tokens

    def _mm_route_request(
        self, body: dict[str, Any], mm: MmPrompt, headers: Mapping[str, str], identity: Identity
    ) -> RouteRequest:
        return self._route_request(body, mm.tokens, headers, identity, mm.blocks(self.block_size))

    def _route_request(
        self,
        body: dict[str, Any],
        tokens: list[int],
        headers: Mapping[str, str],
        identity: Identity,
        mm: MmBlocks | None = None,
    ) -> RouteRequest:
        """Keys in the namespace of the salt the engine gets: the engine's events carry
        that salt back, and the index namespaces its blocks by it. `mm`: each block's
        multimodal items (None: a text prompt)."""
        ns = self.namespace_of(body.get("model"), identity.salt or "")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        rid = next(self._request_ids)
        return RouteRequest(
            request_id=rid,
            content_keys=(
                content_keys(tokens, self.block_size, ns)
                if mm is None
                else _mm_content_keys(tokens, self.block_size, ns, mm)
            ),
            prompt_tokens=len(tokens),
            namespace=ns,
            session_id=headers.get(self._session_header),
            expected_output_tokens=int(max_tokens) if isinstance(max_tokens, int) else 16,
            arrival_s=time.monotonic(),
            parent_id=self._parents.resolve(ns, headers, rid),
        )

    async def _prompt(
        self, body: dict[str, Any], chat: bool, candidates: frozenset[int] | None
    ) -> tuple[list[int], MmBlocks | None]:
        """The prompt's token ids, and its blocks' multimodal items when it has images
        the gateway can identify (else None: it is keyed on its text, as before)."""
        if chat and has_media(body):
            local = self._tokenizer.local
            try:
                if local is None:
                    raise MultimodalUnavailable(
                        "engine_tokenizes",
                        "the engine tokenizes (tokenizer: engine); its /tokenize does not "
                        "say where the images are",
                    )
                model_id = self.model_root_of(body.get("model"))
                mm = await self.multimodal.prompt(local, body, model_id)
                return mm.tokens, mm.blocks(self.block_size)
            except MultimodalUnavailable as exc:
                self.multimodal.fallback(exc)
        return await self._tokens(body, chat, candidates), None

    async def _tokens(
        self, body: dict[str, Any], chat: bool, candidates: frozenset[int] | None
    ) -> list[int]:
        """Tokenize (with some routable engine's /tokenize when configured so). An engine
        that cannot be reached is marked down and, once, another one asked: the health
        check may not have seen it die yet (real vLLM killed between two checks)."""
        for attempt in range(2):
            w = self._pool.any_routable(candidates)
            if w is None and self._tokenizer.local is None:
                raise EngineUnreachable(self._why_none_tokenizes(candidates))
            try:
                return await self._tokenizer.tokens(body, chat, w.url if w else None)
            except EngineUnreachable:
                if w is None:  # no engine left to ask
                    raise
                self._pool.mark_down(w.id, "its /tokenize is unreachable")
                if attempt == 1:
                    raise
                self._on_tokenize_retry(w.id)
        raise AssertionError("unreachable")

    def _why_none_tokenizes(self, candidates: frozenset[int] | None) -> str:
        """Why no engine can tokenize (the engines tokenize and none is routable)."""
        engines = [
            w for w in self._pool.workers.values() if candidates is None or w.id in candidates
        ]
        draining = sum(1 for w in engines if w.draining)
        down = sum(1 for w in engines if not w.healthy and not w.draining)
        if not engines:
            return "no engine to tokenize with (none serves the model yet)"
        return (
            f"no engine to tokenize with: of {len(engines)} serving the model, "
            f"{draining} draining and {down} down"
        )


def _mm_content_keys(
    tokens: list[int], block_size: int, ns: int, mm: MmBlocks
) -> npt.NDArray[np.uint64]:
    """`content_keys` with each block's multimodal items (docs/content-key.md, `mm_i`)."""
    try:
        arr = np.frombuffer(array("I", tokens), dtype=np.uint32)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers that fit in 32 bits: {exc}") from None
    return np.asarray(_native.content_keys(arr, block_size, ns, mm=mm), dtype=np.uint64)
