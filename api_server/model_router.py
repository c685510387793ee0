"""The HTTP front of a server that serves several models (`loom serve --model A --model B`,
`--models-dir`): it answers /v1/models, /health and /metrics for all of them, and hands every
other request to the routes of the model its body names (the first model's when it names
none), loading that model first when it is not loaded. Each model's routes are the
single-model server's, on its own engine (api_server/served_model.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time

import msgspec
import uvicorn
from prometheus_client import Metric, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route

from api_server.app import VERSION, secure_app, server_error_handlers
from api_server.http_protocol import bounded_http_protocol, fit_descriptor_limit
from api_server.launcher import (
    _event_loop_factory,
    _import_streaming_backend,
    _Server,
    bind_listen_socket,
    check_exposure,
    ready_line,
)
from api_server.middleware import replay_body
from api_server.model_pool import ModelPool
from api_server.openapi import build_openapi
from api_server.protocol import RequestError
from api_server.served_model import ServedModel
from api_server.serving_context import error_response, json_response
from api_server.startup_error import StartupError
from pipelines.config import PipelineConfig
from processes.lifecycle import freeze_startup_heap

logger = logging.getLogger("loom")

# Routes whose `model` names no served model: the voices (--speech) are the first model's.
DEFAULT_MODEL_PATHS = frozenset({"/v1/audio/speech"})


class _Named(msgspec.Struct):
    model: str | None = None


_named = msgspec.json.Decoder(_Named)


def model_named(body: bytes) -> str | None:
    """The body's `model`, if it is a JSON object that names one (else the model's own routes
    say what is wrong with it)."""
    try:
        return _named.decode(body).model
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class ModelRouter:
    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool
        self.draining = False
        self.front = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/live", self.live, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
        ], exception_handlers=server_error_handlers())
        self.front_paths = {route.path for route in self.front.routes}
        self.openapi_doc = build_openapi(VERSION)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.front_paths or \
                scope["path"].startswith("/v1/models/") or not self.model_answers(scope):
            return await self.front(scope, receive, send)  # (its 404 for a path of no route)
        body = b""
        if scope["method"] not in ("GET", "HEAD"):
            body = await _read_body(receive)
        name = model_named(body) if body else None
        if name is None or name not in self.pool.models and scope["path"] in DEFAULT_MODEL_PATHS:
            name = self.pool.default.name
        try:
            served = self.model_serving(name)
            if served is None:
                raise RequestError(f"the model `{name}` does not exist", param="model",
                                   status=404, code="model_not_found")
            name = served
            if self.draining:
                raise RequestError("the server is not accepting requests: shutting down",
                                   status=503, code="service_unavailable")
            scope["loom.model_name"] = name
            model = await self.pool.acquire(name)
        except RequestError as exc:
            return await error_response(exc)(scope, receive, send)
        try:
            await model.app(scope, replay_body(body, receive), send)
        finally:
            self.pool.release(model)

    def model_serving(self, name: str) -> str | None:
        """The model that serves `name`: itself, or the loaded model with a LoRA adapter of
        that name (--enable-lora)."""
        if name in self.pool.models:
            return name
        for model in self.pool.models.values():
            loras = model.serving.loras if model.loaded else None
            if loras is not None and name in loras:
                return model.name
        return None

    def model_answers(self, scope) -> bool:
        """A model's routes have this path (no model is loaded for a path none has)."""
        routes = self.pool.routes
        return not routes or any(route.matches(scope)[0] is not Match.NONE for route in routes)

    # ---- the front's own routes ---------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        models = {name: model.status for name, model in self.pool.models.items()}
        if self.draining:
            return json_response({"status": "unhealthy", "reason": "shutting down",
                                  "models": models}, status=503, headers={"Retry-After": "1"})
        return json_response({"status": "ok", "models": models})

    async def live(self, request: Request) -> Response:
        return json_response({"status": "alive"})

    async def version(self, request: Request) -> Response:
        return json_response({"version": VERSION})

    async def openapi(self, request: Request) -> Response:
        return json_response(self.openapi_doc)

    async def list_models(self, request: Request) -> Response:
        cards = []
        for model in self.pool.models.values():
            cards.append(model.card())
            loras = model.serving.loras if model.loaded else None
            if loras is not None:  # (a loaded model's adapters, their base as parent)
                cards += loras.model_cards(model.created)
        return json_response({"object": "list", "data": cards})

    async def get_model(self, request: Request) -> Response:
        model = self.pool.models.get(request.path_params["model"])
        if model is None:
            return error_response(RequestError(
                f"the model `{request.path_params['model']}` does not exist", param="model",
                status=404, code="model_not_found"))
        return json_response(model.card())

    async def metrics(self, request: Request) -> Response:
        registries = [self.pool.registry,
                      *(model.metrics.registry_now() for model in self.pool.models.values())]
        return Response(generate_latest(_Merged(registries)), media_type=CONTENT_TYPE_LATEST)


class _Merged:
    """Several registries as one exposition: each family once, its samples from all of them
    (every model's carry its own model_name label)."""

    def __init__(self, registries) -> None:
        self.registries = registries

    def collect(self):
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit)
                merged.samples.extend(family.samples)
        return families.values()


async def _read_body(receive) -> bytes:
    """(Bounded already: limit_body_size read it whole and replays it.)"""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


# ---- `loom serve` with several models -------------------------------------------------------
def serve_models(cfgs: list[PipelineConfig]) -> int:
    server_cfg = cfgs[0].server_config
    try:
        check_exposure(server_cfg)
        listen_socket = bind_listen_socket(server_cfg.host, server_cfg.port)
    except StartupError as exc:
        print(f"loom: error: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
            return runner.run(_serve(cfgs, listen_socket))
    except StartupError as exc:
        print(f"loom: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        listen_socket.close()


async def _serve(cfgs: list[PipelineConfig], listen_socket: socket.socket) -> int:
    server_cfg = cfgs[0].server_config
    pool = ModelPool([ServedModel(cfg) for cfg in cfgs], cfgs[0].model_pool_config)
    router = ModelRouter(pool)
    known_paths = pool.known_paths
    known_paths.update(router.front_paths)
    # The first model's metrics count the HTTP requests (the rejected ones by the model the
    # router picked).
    app = secure_app(router, pool.default.metrics, known_paths, server_cfg.api_key,
                     server_cfg.max_request_bytes, server_cfg.metrics_public, server_cfg.host,
                     server_cfg.allowed_hosts, server_cfg.allowed_origins, server_cfg.web_ui)
    server = _Server(uvicorn.Config(
        app, log_level=server_cfg.log_level, access_log=server_cfg.log_level == "debug",
        timeout_graceful_shutdown=1.0, lifespan="off",
        http=bounded_http_protocol(fit_descriptor_limit(server_cfg.http))))
    tasks = []
    server.on_stop = lambda: tasks.append(asyncio.ensure_future(_drain(router, server,
                                                                       server_cfg)))
    _import_streaming_backend()
    try:
        try:
            await pool.start()
        except RequestError as exc:
            raise StartupError(exc.message) from None
        freeze_startup_heap()
        host, port = listen_socket.getsockname()[:2]
        print(ready_line(", ".join(pool.models), host, port, server_cfg), flush=True)
        await server.serve(sockets=[listen_socket])
    finally:
        for task in tasks:
            task.cancel()
        await pool.close()
    return 0


async def _drain(router: ModelRouter, server: uvicorn.Server, server_cfg) -> None:
    """SIGTERM: refuse new requests (503), give in-flight ones --shutdown-timeout to finish."""
    router.draining = True
    deadline = time.monotonic() + server_cfg.shutdown_timeout
    while router.pool.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    server.should_exit = True
