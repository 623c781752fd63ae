"""Token ids of a request, for routing: exactly the ids the engine will hash.

- "engine": the engine's own `POST /tokenize` (with `messages` for chat, so its chat
  template is used). One extra local round trip per request (on the aiohttp session of
  the data path); always faithful.
- "builtin" or a tokenizer.json path: a local tokenizer (chat template applied
  locally); no round trip, faithful when it is the engine's tokenizer.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from quillcache.errors import QuillCacheError
from quillcache.tokenization.local import Tokenizer, load_tokenizer


class TokenizationError(QuillCacheError):
    """The request's prompt could not be tokenized (bad shape, or the engine refused)."""


class EngineUnreachable(TokenizationError):
    """The engine's /tokenize could not be reached (a dead engine, not a bad request)."""


_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError)


class RequestTokenizer:
    """`timeout_s`: how long an engine's /tokenize may take before the engine counts as
    unreachable (a hung engine keeps its socket open: without a limit the request would
    wait for the data path's whole request timeout)."""

    def __init__(self, spec: str, client: aiohttp.ClientSession, timeout_s: float = 10.0) -> None:
        self.spec = spec
        self.client = client
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.local: Tokenizer | None = None if spec == "engine" else load_tokenizer(spec)

    async def tokens(self, body: dict[str, Any], chat: bool, engine_url: str | None) -> list[int]:
        if self.local is not None:
            return self.local_tokens(body, chat)
        if engine_url is None:
            raise EngineUnreachable("no healthy engine to tokenize with")
        return await self._engine(body, chat, engine_url)

    def local_tokens(self, body: dict[str, Any], chat: bool) -> list[int]:
        assert self.local is not None
        try:
            if chat:
                text = self.local.apply_chat_template(body["messages"], True)
                return self.local.encode(text)
            prompt = body["prompt"]
        except (KeyError, TypeError) as exc:
            raise TokenizationError(f"cannot read the prompt: {exc}") from exc
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.local.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise TokenizationError("'prompt' must be a string, one string in a list, or token ids")

    async def _engine(self, body: dict[str, Any], chat: bool, url: str) -> list[int]:
        if chat:
            payload: dict[str, Any] = {"messages": body["messages"], "add_generation_prompt": True}
        else:
            prompt = body["prompt"]
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            payload = {"prompt": prompt}
        if "model" in body:
            payload["model"] = body["model"]
        try:
            async with self.client.post(
                f"{url}/tokenize", json=payload, timeout=self.timeout
            ) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    raise TokenizationError(f"engine /tokenize answered {resp.status}: {text}")
                data = await resp.json(content_type=None)
        except _CONNECT_ERRORS as exc:
            raise EngineUnreachable(f"engine {url} unreachable: {exc}") from exc
        except TimeoutError:  # aiohttp's timeouts are TimeoutErrors
            raise EngineUnreachable(
                f"engine {url} did not answer /tokenize within {self.timeout.total} s"
            ) from None
        except (aiohttp.ClientError, ValueError) as exc:
            raise TokenizationError(f"engine /tokenize failed: {exc}") from exc
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list):
            raise TokenizationError("engine /tokenize returned no 'tokens'")
        return tokens
