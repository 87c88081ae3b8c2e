"""Middlewares, outermost first: OpenAI error shape for everything, API key, content type.

The body size limit is aiohttp's `client_max_size` (413 when the body is read); this module turns
aiohttp's own HTTP errors (404 route, 405 method, 413 body) into the OpenAI error shape as well.
"""

from __future__ import annotations

import hmac

import structlog
from aiohttp import web

from mtpserve.web.errors import ApiError

log = structlog.get_logger("mtpserve.server")
OPEN_PATHS = frozenset({"/health"})
JSON_TYPES = frozenset({"application/json"})


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return web.json_response(err.body(), status=err.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = ApiError(exc.status, exc.reason if exc.status != 413 else "Request body too large.",
                       code=_HTTP_CODES.get(exc.status))
        return web.json_response(err.body(), status=exc.status, headers=_allow_header(exc))
    except Exception:  # NOTE: never leak a traceback; bad input is caught before this point
        log.exception("unhandled error", path=request.path)
        return web.json_response(ApiError(500, "Internal server error.").body(), status=500)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _allow_header(exc: web.HTTPException) -> dict:
    return {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}


def api_key_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise ApiError(401, "Invalid or missing API key.", code="invalid_api_key")
        return await handler(request)

    return check_api_key


@web.middleware
async def content_type_middleware(request: web.Request, handler) -> web.StreamResponse:
    # NOTE: a POST without a body (`curl -X POST .../reset_prefix_cache`) has no type to check
    if request.method == "POST" and request.body_exists and request.content_type not in JSON_TYPES:
        raise ApiError(415, f"Content type must be application/json, got `{request.content_type}`.",
                       code="unsupported_media_type")
    return await handler(request)
