"""Reading requests and writing errors: the pieces every gateway endpoint shares.

Handlers raise `ApiError` for anything the client got wrong (or an engine failure);
the wrappers in `asgi` turn it into OpenAI's error shape, so no handler builds error
responses by hand or checks for them after each step.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

# Deeper JSON is refused before parsing: json.loads recurses once per level (a body
# nested ~1,000 deep raised RecursionError), and so do json.dumps and msgpack on the
# way to an engine. Real requests (chat content parts, tool and response_format
# schemas) stay far below this.
MAX_JSON_DEPTH = 128


class ApiError(Exception):
    """A 4xx/5xx answer with a message the client can act on."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "BadRequestError",
        *,
        code: str | int | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param

    def response(self) -> JSONResponse:
        return error_json(self.status, self.message, self.kind, code=self.code, param=self.param)


def error_json(
    status: int,
    message: str,
    kind: str = "BadRequestError",
    *,
    code: str | int | None = None,
    param: str | None = None,
) -> JSONResponse:
    """OpenAI's error shape (the `openai` client maps it to typed exceptions); `code` is
    the status unless OpenAI has a name for the case (e.g. "model_not_found")."""
    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": kind,
                "param": param,
                "code": status if code is None else code,
            }
        },
        status_code=status,
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 once it exceeds `limit` (read in chunks, so a lying or
    missing Content-Length cannot make us buffer more)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_big(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_big(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        # The input ended before the body did; a client that only shut its sending side
        # still reads this answer (a gone one never will).
        raise ApiError(400, "the request body ended before its declared length") from None
    return b"".join(chunks)


def _too_big(limit: int) -> ApiError:
    return ApiError(413, f"request body larger than {limit} bytes", "PayloadTooLarge")


def parse_object(raw: bytes) -> dict[str, Any]:
    if json_depth_over(raw, MAX_JSON_DEPTH):
        raise ApiError(400, f"request body is JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw)
    except RecursionError:  # not reached below MAX_JSON_DEPTH; kept as a 400 all the same
        raise ApiError(400, "request body is JSON nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth_over(raw: bytes, limit: int) -> bool:
    """Whether the JSON text `raw` nests arrays and objects deeper than `limit`, without
    parsing it. Brackets inside strings do not count. A body with at most `limit` opening
    brackets cannot be deeper (two `count`s: the completion path's whole cost); else the
    strings are cut out and the depth is the running sum of the brackets left, all in C."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if len(brackets) <= limit:
        return False
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return bool(np.cumsum(steps).max() > limit)


async def json_object(request: Request, limit: int, default: bytes = b"") -> dict[str, Any]:
    """The body as a JSON object (`default` when the body is empty)."""
    return parse_object(await read_body(request, limit) or default)


def bearer(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def check_bearer(headers: Mapping[str, str], accepted: Iterable[str], what: str) -> None:
    """401 unless the request's `headers` carry one of the `accepted` bearer tokens."""
    given = bearer(headers)
    if not given or not any(hmac.compare_digest(given, a) for a in accepted):
        raise ApiError(
            401, f"missing or invalid {what} (Authorization: Bearer <key>)", "AuthenticationError"
        )


def validate_completion(body: dict[str, Any], chat: bool) -> None:
    """The fields routing reads, checked enough for a clear 400 (the engine checks the
    rest and its error passes through)."""
    problem = _completion_problem(body, chat)
    if problem:
        raise ApiError(400, problem)


def check_prompt_bytes(body: dict[str, Any], chat: bool, raw_size: int, limit: int) -> None:
    """400 when the prompt's text (a chat's message texts) exceeds `limit` UTF-8 bytes,
    before anything tokenizes it. A body no larger than the limit passes unmeasured."""
    if raw_size <= limit:
        return
    texts: list[Any] = []
    if chat:
        for message in body.get("messages") or ():
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                texts += [p.get("text") for p in content if isinstance(p, dict)]
            else:
                texts.append(content)
    else:
        prompt = body.get("prompt")
        texts = prompt if isinstance(prompt, list) else [prompt]
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts if isinstance(t, str))
    if size > limit:
        what = "message texts are" if chat else "prompt is"
        raise ApiError(
            400,
            f"the {what} {size} bytes long, over the gateway's limit of {limit} bytes "
            "(max_prompt_bytes)",
            param="messages" if chat else "prompt",
        )


def check_context(prompt_tokens: int, limit: int | None) -> None:
    """400 in vLLM's words when the prompt alone exceeds the serving engines' context."""
    if limit is not None and prompt_tokens > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {prompt_tokens} input tokens. Please reduce the length of the input "
            "messages.",
        )


#: `max_tokens` from here on is refused as a bad request (the routing kernels count
#: tokens in signed 64-bit integers).
MAX_OUTPUT_TOKENS = 2**63


def _completion_problem(body: dict[str, Any], chat: bool) -> str | None:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list of {role, content} objects"
        if not all(isinstance(m, dict) for m in messages):
            return "every message must be an object with 'role' and 'content'"
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            return "'prompt' must be a string, a list with one string, or a list of token ids"
        if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
            # a batch of prompts: each may belong on another engine
            return (
                "'prompt' holds one prompt per request (a string, a list with one string, "
                "or token ids): send a batch's prompts as separate requests"
            )
    if "model" in body and not isinstance(body["model"], str):
        return "'model' must be a string"
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        return "'cache_salt' must be a string"
    for field in ("max_tokens", "max_completion_tokens"):
        v = body.get(field)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            return f"'{field}' must be a non-negative integer"
        if v is not None and v >= MAX_OUTPUT_TOKENS:
            # no engine's context holds it, and the cost model counts tokens in int64
            return f"'{field}' must be below 2**63 (at most the model's context length)"
    if "stream" in body and not isinstance(body["stream"], bool):
        return "'stream' must be true or false"
    return None


def single_headers(headers: Headers, names: Iterable[str]) -> None:
    """A 400 naming the header when one of `names` comes more than once with different
    values (a proxy and the client each adding one): which one counts is not for the
    gateway to guess. The values are not echoed (a key may be among them)."""
    for name in names:
        values = headers.getlist(name)
        if len(values) > 1 and len({v.strip() for v in values}) > 1:
            raise ApiError(
                400,
                f"the {name} header is given {len(values)} times with different values: "
                "give it once",
                code="duplicate_header",
                param=name,
            )


# a decimal number as a header carries it (no `1_000`, `nan`, `inf` or `0x10`, which
# Python's `float` would take or half take)
_HEADER_NUMBER = re.compile(r"\s*[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?\s*")


def header_number(text: str) -> float | None:
    """A header's decimal number, or None when it is not one."""
    return float(text) if _HEADER_NUMBER.fullmatch(text) else None
