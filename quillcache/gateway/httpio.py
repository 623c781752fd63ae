"""Reading requests and writing errors: the pieces every gateway endpoint shares.

Handlers raise `ApiError` for anything the client got wrong (or an engine failure);
the wrappers in `asgi` turn it into OpenAI's error shape, so no handler builds error
responses by hand or checks for them after each step.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse


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
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_big(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_big(limit: int) -> ApiError:
    return ApiError(413, f"request body larger than {limit} bytes", "PayloadTooLarge")


def parse_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


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
    if "model" in body and not isinstance(body["model"], str):
        return "'model' must be a string"
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        return "'cache_salt' must be a string"
    for field in ("max_tokens", "max_completion_tokens"):
        v = body.get(field)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            return f"'{field}' must be a non-negative integer"
    if "stream" in body and not isinstance(body["stream"], bool):
        return "'stream' must be true or false"
    return None
