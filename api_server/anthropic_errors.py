"""Errors on Anthropic's routes in Anthropic's shape:
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`.

The routes and the middlewares in front of them (body size, API key) answer errors in
OpenAI's shape; this outermost middleware rewrites those of /v1/messages*, so every refusal
there (a 400 naming the parameter in its message, 401, 404, 413, 429, 503, ...) reads as
Anthropic's clients expect. Inner middlewares still see OpenAI's shape, so /metrics counts
refusals by the same reasons on every route.
"""

from __future__ import annotations

import msgspec

ANTHROPIC_PATH_PREFIX = "/v1/messages"
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    503: "overloaded_error", 529: "overloaded_error",
}
_json = msgspec.json.Encoder()


def anthropic_error_body(status: int, openai_body: bytes) -> bytes:
    try:
        error = msgspec.json.decode(openai_body).get("error") or {}
    except (msgspec.DecodeError, AttributeError):
        error = {}
    message = error.get("message") or "error"
    param = error.get("param")
    if param and param not in message:
        message = f"{param}: {message}"
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else
                                     "invalid_request_error")
    return _json.encode({"type": "error", "error": {"type": kind, "message": message}})


def anthropic_errors(app):
    async def middleware(scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(ANTHROPIC_PATH_PREFIX):
            return await app(scope, receive, send)
        start: dict | None = None
        chunks: list[bytes] = []

        async def rewrite(message):
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if message["status"] >= 400 and headers.get(b"content-type", b"").startswith(
                        b"application/json"):
                    start = message  # held until the whole body is here
                    return
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = anthropic_error_body(start["status"], b"".join(chunks))
                headers = [(k, v) for k, v in start.get("headers", [])
                           if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await app(scope, receive, rewrite)

    return middleware
