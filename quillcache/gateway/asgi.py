"""Endpoint wrappers and the ASGI fast path.

`api_errors` turns a raised `ApiError` into its JSON answer; `admin_only` adds the admin
token check in front. `HotPath` serves the two proxy endpoints straight from ASGI:
Starlette's middleware stack and router were a large share of the gateway's CPU per
proxied request in a profile (docs/online.md, "What the profiles changed").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from quillcache.gateway.httpio import ApiError, check_bearer, error_json

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


def api_errors(handler: Handler) -> Handler:
    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()

    return wrapped


def admin_only(handler: Handler, token: Callable[[], str | None]) -> Handler:
    """`handler` behind the admin bearer token; no token configured = the API is off."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        expected = token()
        if expected is None:
            raise ApiError(
                403,
                "the admin API is disabled: set admin_token in the config",
                "PermissionDeniedError",
            )
        check_bearer(request.headers, [expected], "admin token")
        return await handler(request)

    return api_errors(wrapped)


class HotPath:
    """POSTs to the `hot` paths go straight to their handler, everything else to `app`.
    An unexpected exception still becomes a JSON 500."""

    def __init__(self, app: Any, hot: Mapping[str, Handler]) -> None:
        self.app = app
        self.hot = hot

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.hot.get(scope["path"])
            if handler is not None:
                request = Request(scope, receive)
                try:
                    response = await handler(request)
                except Exception as exc:
                    response = await internal_error(request, exc)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def not_found(request: Request, exc: Exception) -> Response:
    return error_json(
        404, f"no such endpoint: {request.method} {request.url.path}", "NotFoundError"
    )


async def not_allowed(request: Request, exc: Exception) -> Response:
    return error_json(
        405, f"method {request.method} not allowed on {request.url.path}", "MethodNotAllowed"
    )


async def internal_error(request: Request, exc: Exception) -> Response:
    log.exception("gateway: unhandled error on %s", request.url.path, exc_info=exc)
    return error_json(500, f"internal gateway error: {type(exc).__name__}", "InternalServerError")
