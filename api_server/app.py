"""The Starlette application: routes, health, and errors in OpenAI's shape."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api_server.anthropic_errors import anthropic_errors
from api_server.anthropic_route import AnthropicRoute
from api_server.cross_site import HostPolicy, guard_cross_site
from api_server.embeddings_route import EmbeddingsRoute
from api_server.extra_routes import ExtraRoutes
from api_server.images_route import ImagesRoute
from api_server.lora_adapters import LoRARoutes
from api_server.metrics import Metrics
from api_server.middleware import PUBLIC_PATHS, limit_body_size, require_api_key
from api_server.openai_routes import OpenAIRoutes
from api_server.openapi import build_openapi
from api_server.protocol import RequestError
from api_server.responses_route import ResponsesRoute
from api_server.server_state import ServerState
from api_server.serving_context import ServingContext, error_response, json_response
from api_server.speech_route import SpeechRoute
from api_server.web_chat import UI_PATHS, web_chat_routes
from pipelines.status import PipelineTask

logger = logging.getLogger("loom.api")

VERSION = "0.1.0"


def build_app(state: ServerState, serving: ServingContext, metrics: Metrics,
              api_key: str | None = None, max_request_bytes: int = 16 << 20,
              speech: SpeechRoute | None = None, metrics_public: bool = False,
              bound_host: str = "127.0.0.1", allowed_hosts: tuple[str, ...] = (),
              allowed_origins: tuple[str, ...] = (), web_ui: bool = True,
              images: ImagesRoute | None = None):
    app = build_routes(state, serving, metrics, speech, web_ui, images)
    return secure_app(app, metrics, {route.path for route in app.routes}, api_key,
                      max_request_bytes, metrics_public, bound_host, allowed_hosts,
                      allowed_origins, web_ui)


def build_routes(state: ServerState, serving: ServingContext, metrics: Metrics,
                 speech: SpeechRoute | None = None, web_ui: bool = True,
                 images: ImagesRoute | None = None) -> Starlette:
    """One model's routes, with no middleware (secure_app adds it)."""
    async def health(request: Request) -> Response:
        reason = state.unhealthy_reason()
        if reason is None:
            return json_response({"status": "ok"})
        return json_response({"status": "unhealthy", "reason": reason}, status=503,
                             headers={"Retry-After": "1"})

    async def live(request: Request) -> Response:
        # Liveness: answered by the event loop itself, whatever the engine is doing (loading,
        # draining, dead): a probe that fails here means this process is stuck, not just busy.
        return json_response({"status": "alive"})

    async def version(request: Request) -> Response:
        return json_response({"version": VERSION})

    openapi_doc = build_openapi(VERSION)

    async def openapi(request: Request) -> Response:
        return json_response(openapi_doc)

    routes = OpenAIRoutes(serving)
    extra = ExtraRoutes(serving)
    embeddings = EmbeddingsRoute(serving, serving.engine,
                                 serving.task is PipelineTask.EMBEDDINGS_GENERATION)
    speech = speech or SpeechRoute(serving.engine, state, metrics, serving.tokenizer,
                                   serving.max_model_len)
    responses = ResponsesRoute(serving)
    messages = AnthropicRoute(serving)
    lora = LoRARoutes(serving)

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/live", live, methods=["GET"]),
            Route("/version", version, methods=["GET"]),
            Route("/metrics", metrics.endpoint, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            Route("/v1/models", routes.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", extra.get_model, methods=["GET"]),
            Route("/tokenize", extra.tokenize, methods=["POST"]),
            Route("/detokenize", extra.detokenize, methods=["POST"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/responses", responses.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", responses.get, methods=["GET"]),
            Route("/v1/responses/{response_id}/input_items", responses.input_items,
                  methods=["GET"]),
            Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
            Route("/v1/messages", messages.create, methods=["POST"]),
            Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
            Route("/v1/embeddings", embeddings.create, methods=["POST"]),
            Route("/v1/load_lora_adapter", lora.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", lora.unload, methods=["POST"]),
            Route("/v1/audio/speech", speech.create, methods=["POST"]),
            *(web_chat_routes() if web_ui else []),
            *([Route("/v1/images/generations", images.create, methods=["POST"]),
               Route("/v1/images/{image_id}/content", images.content, methods=["GET"])]
              if images is not None else []),
        ],
        exception_handlers=server_error_handlers(),
    )
    return app


def server_error_handlers() -> dict:
    """Starlette's exceptions, and bugs, as OpenAI-shaped errors."""

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(RequestError(exc.detail or "error", status=exc.status_code))

    async def server_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(RequestError("internal server error", status=500))

    return {HTTPException: http_error, Exception: server_error}


def secure_app(app, metrics: Metrics, known_paths: set[str], api_key: str | None = None,
               max_request_bytes: int = 16 << 20, metrics_public: bool = False,
               bound_host: str = "127.0.0.1", allowed_hosts: tuple[str, ...] = (),
               allowed_origins: tuple[str, ...] = (), web_ui: bool = True):
    """The middleware every request passes: body size, API key, cross-site guards, HTTP
    metrics, Anthropic-shaped errors."""
    wrapped = limit_body_size(app, max_request_bytes)
    if api_key:
        wrapped = require_api_key(wrapped, api_key,
                                  PUBLIC_PATHS | {"/metrics"} if metrics_public else PUBLIC_PATHS,
                                  UI_PATHS if web_ui else frozenset())
    # A key keeps DNS-rebound pages out already (they cannot know it): the Host check is for
    # key-less servers. CORS preflights come before the key check (browsers send none).
    host_policy = None if api_key else HostPolicy(bound_host, allowed_hosts)
    wrapped = guard_cross_site(wrapped, host_policy, allowed_origins)
    # Outermost: Anthropic's routes answer every error, the middlewares' too, in its shape.
    return anthropic_errors(metrics.http_middleware(wrapped, known_paths))
