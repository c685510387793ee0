"""ASGI middleware: request body size limit and API-key authentication."""

from __future__ import annotations

import base64
import hmac

import msgspec

_json = msgspec.json.Encoder()

# Routes that stay open without a key: load balancers must reach them. /metrics is not one
# unless --metrics-public: its counters (the prefix cache's hits among them) tell one client
# about the others' requests.
PUBLIC_PATHS = frozenset({"/health", "/live", "/openapi.json"})


async def send_error(send, status: int, message: str, type_: str, code: str,
                     headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = _json.encode({"error": {"message": message, "type": type_, "param": None,
                                   "code": code}})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def limit_body_size(app, max_bytes: int):
    """Refuse bodies over `max_bytes` with a 413, before they are buffered in full.

    The whole (bounded) body is read here and replayed to the app, so a chunked upload can't
    grow past the limit either.
    """

    async def middleware(scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        too_big = f"the request body exceeds {max_bytes} bytes (--max-request-bytes)"
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            return await send_error(send, 413, too_big, "invalid_request_error",
                                    "request_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                return await send_error(send, 413, too_big, "invalid_request_error",
                                        "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return await app(scope, replay_body(b"".join(chunks), receive), send)

    return middleware


def require_api_key(app, api_key: str, public_paths: frozenset[str] = PUBLIC_PATHS,
                    browser_paths: frozenset[str] = frozenset()):
    """Every route but `public_paths` needs `Authorization: Bearer <key>`, or
    `x-api-key: <key>` (how Anthropic's clients send it), or HTTP Basic with the key as
    password (any user name): how a browser sends it to the web chat and its page's requests,
    after the 401 of a `browser_paths` page asked for it."""
    expected = f"Bearer {api_key}".encode()
    expected_header = api_key.encode()

    async def middleware(scope, receive, send):
        if scope["type"] != "http" or scope["path"] in public_paths:
            return await app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        given_header = headers.get(b"x-api-key", b"")
        # All compared, in constant time, whichever was sent.
        bearer_ok = hmac.compare_digest(given, expected)
        header_ok = hmac.compare_digest(given_header, expected_header)
        basic_ok = hmac.compare_digest(_basic_password(given), expected_header)
        if not (bearer_ok or header_ok or basic_ok):
            challenge = (b'Basic realm="Loom", charset="UTF-8"'
                         if scope["path"] in browser_paths else b"Bearer")
            return await send_error(send, 401, "missing or invalid API key",
                                    "authentication_error", "invalid_api_key",
                                    [(b"www-authenticate", challenge)])
        return await app(scope, receive, send)

    return middleware


def _basic_password(authorization: bytes) -> bytes:
    """The password of `Authorization: Basic base64(user:password)`, or b"" ."""
    scheme, _, credentials = authorization.partition(b" ")
    if scheme.lower() != b"basic":
        return b""
    try:
        return base64.b64decode(credentials.strip(), validate=True).partition(b":")[2]
    except ValueError:
        return b""


def replay_body(body: bytes, receive):
    """An ASGI `receive` that hands the app the already-read `body` once, then what the
    client sends next (its disconnect)."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
