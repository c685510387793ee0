"""The Starlette application: routes, health, and errors in OpenAI's shape."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api_server.engine_client import EngineClient
from api_server.metrics import Metrics
from api_server.openai_routes import OpenAIRoutes, error_response, json_response
from api_server.protocol import RequestError

logger = logging.getLogger("loom.api")

VERSION = "0.1.0"


def build_app(engine: EngineClient, routes: OpenAIRoutes, metrics: Metrics):
    async def health(request: Request) -> Response:
        if engine.is_healthy:
            return json_response({"status": "ok"})
        reason = engine.dead_reason or "starting"
        return json_response({"status": "unhealthy", "reason": reason}, status=503)

    async def version(request: Request) -> Response:
        return json_response({"version": VERSION})

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(RequestError(exc.detail or "error", status=exc.status_code))

    async def server_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(RequestError("internal server error", status=500))

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/version", version, methods=["GET"]),
            Route("/metrics", metrics.endpoint, methods=["GET"]),
            Route("/v1/models", routes.list_models, methods=["GET"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
    known_paths = {route.path for route in app.routes}
    return metrics.http_middleware(app, known_paths)
