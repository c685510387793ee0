"""The web chat at `/`: a page and its assets, hand-written and shipped in the wheel
(api_server/static/), so it works offline and with no CDN.

It goes through the same middlewares as every route: with an API key the page needs it too (the
browser asks for it: any user name, the key as password, see middleware.require_api_key), and
the cross-site rules hold. Model output is untrusted: the page renders it with markdown.js
(DOM nodes from text, no HTML parsing), and the Content-Security-Policy below lets no inline
script, event handler or foreign resource run even if something slipped through.
"""

from __future__ import annotations

import os

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
ASSETS = {"chat.js": "text/javascript", "markdown.js": "text/javascript",
          "chat.css": "text/css"}
# The paths whose 401 invites the browser to ask for the key (the page and its assets).
UI_PATHS = frozenset({"/", *(f"/ui/{name}" for name in ASSETS)})
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data: blob:; media-src 'self' blob:; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _read(name: str) -> bytes:
    with open(os.path.join(STATIC_DIR, name), "rb") as f:
        return f.read()


def web_chat_routes() -> list[Route]:
    # Read once: a few tens of kilobytes, and no file system access per request.
    page = _read("index.html")
    assets = {name: _read(name) for name in ASSETS}

    async def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    def asset(name: str):
        async def serve(request: Request) -> Response:
            return Response(assets[name], media_type=f"{ASSETS[name]}; charset=utf-8",
                            headers=SECURITY_HEADERS)
        return serve

    return [Route("/", index, methods=["GET"]),
            *(Route(f"/ui/{name}", asset(name), methods=["GET"]) for name in ASSETS)]
