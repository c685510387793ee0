"""`loom serve`: start the worker and scheduler processes, serve HTTP, stop everything.

The API server runs in this (parent) process; the scheduler and worker are spawned children
that die with it (PR_SET_PDEATHSIG). If a child dies while serving, the server says which,
fails the in-flight requests, and exits non-zero so a supervisor can restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import time
from typing import Any

import uvicorn

from api_server.app import build_app
from api_server.chat_template import TemplateSandbox
from api_server.engine_client import EngineClient, EngineDeadError
from api_server.http_protocol import bounded_http_protocol, fit_descriptor_limit
from api_server.lora_adapters import LoRAAdapters
from api_server.metrics import Metrics
from api_server.server_state import ServerState
from api_server.serving_context import ServingContext
from api_server.speech_route import SpeechRoute
from api_server.startup_error import StartupError
from api_server.tokenizer import TextTokenizer
from pipelines.checkpoint.bert_config import BertConfig
from pipelines.checkpoint.model_config import load_model_config
from pipelines.config import PipelineConfig, ServerConfig
from pipelines.progress import Progress
from pipelines.status import PipelineTask
from processes.cpu_placement import CpuPlacement
from processes.lifecycle import freeze_startup_heap, run_role
from processes.sockets import Endpoints, make_private_ipc_dir

logger = logging.getLogger("loom")

# The children's entry points, by name (processes.lifecycle.run_role imports them there).
WORKER_ENTRY = "worker.process:run_worker"
SCHEDULER_ENTRY = "scheduler.process:run_scheduler"


def check_exposure(cfg: ServerConfig) -> None:
    """Refuse to serve other machines without an API key, unless asked to: a server bound to
    0.0.0.0 by habit (or by a container's defaults) would otherwise be open to its network."""
    if cfg.api_key or cfg.allow_unauthenticated or is_loopback(cfg.host):
        return
    raise StartupError(f"--host {cfg.host} is reachable from other machines and no API key is "
                       f"set: pass --api-key (or set LOOM_API_KEY), or --allow-unauthenticated "
                       f"to serve without one")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost; anything else (0.0.0.0, names) may face a network."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_listen_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    # Accepted connections inherit TCP_NODELAY on Linux. Without it a response written as
    # headers then body waits for the client's delayed ACK: ~40 ms on every keep-alive request,
    # and on every SSE event, in exactly the latency we are trying to keep small.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


# After a child dies, keep answering 503 this long (so health checks and clients see why)
# before exiting non-zero for the supervisor to restart us.
DEAD_LINGER_SECONDS = 2.0


class _Server(uvicorn.Server):
    """uvicorn, with our own signal handling: SIGINT/SIGTERM call `on_stop` (which drains in
    flight requests first) and are not re-raised afterwards, so the children are stopped in
    order. A second signal exits at once."""

    on_stop = None

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self.stopping:
            self.should_exit = True
            self.force_exit = True
            return
        self.stopping = True
        if self.on_stop is not None:
            self.on_stop()
        else:
            self.should_exit = True

    stopping = False


class Launcher:
    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.ipc_dir = make_private_ipc_dir()
        self.endpoints = Endpoints.ipc(self.ipc_dir)
        self.children: list[multiprocessing.Process] = []
        self.exit_code = 0

    def start_children(self) -> None:
        cfg = self.cfg
        mp = multiprocessing.get_context("spawn")
        threads = cfg.device_config.num_threads or max(1, os.cpu_count() or 1)
        placement = CpuPlacement.plan(threads) if cfg.device_config.cpu_placement else None
        log_level = cfg.server_config.log_level
        ranks = cfg.device_config.tensor_parallel_size
        # A model split over `ranks` workers: the threads and cores shared among them.
        self.children = [
            mp.Process(target=run_role, name="loom-worker" + (f"-{rank}" if ranks > 1 else ""),
                       args=(WORKER_ENTRY, cfg, self.endpoints, max(1, threads // ranks),
                             log_level, _rank_placement(placement, rank, ranks), rank))
            for rank in range(ranks)
        ]
        self.children.append(
            mp.Process(target=run_role, name="loom-scheduler",
                       args=(SCHEDULER_ENTRY, cfg, log_level, self.endpoints, placement,
                             ranks)))
        for child in self.children:
            child.start()
        if placement is not None:  # after the children, which inherit this process' cores
            placement.enter_service()
            logger.info("cores: worker %s, API and scheduler %s", list(placement.worker),
                        list(placement.service))

    async def watch_children(self, engine: EngineClient, server: uvicorn.Server) -> None:
        """Wait for any child to exit; then fail everything in flight and shut down."""
        await _any_exited(self.children)
        if server.should_exit:
            return
        if engine.ready is None:
            await asyncio.sleep(0.5)  # a failing child's own explanation may still be in flight
        dead = [c for c in self.children if not c.is_alive()]
        names = ", ".join(f"{c.name} (exit code {c.exitcode})" for c in dead)
        await self._fail(engine, server, f"{names} died")

    async def watch_stalls(self, state: ServerState, engine: EngineClient,
                           server: uvicorn.Server) -> None:
        """A step that never finishes must not hang the server: treat it like a dead child."""
        while not server.should_exit:
            await asyncio.sleep(1.0)
            if engine.ready is not None and state.stalled_for() > state.limits.step_timeout:
                await self._fail(engine, server, f"no step finished in "
                                 f"{state.limits.step_timeout:g}s (--step-timeout)")
                return

    async def _fail(self, engine: EngineClient, server: uvicorn.Server, reason: str) -> None:
        logger.error("%s; failing in-flight requests and exiting", reason)
        engine.mark_dead(reason)
        self.exit_code = 1
        await asyncio.sleep(DEAD_LINGER_SECONDS)
        server.should_exit = True

    async def drain(self, state: ServerState, engine: EngineClient,
                    server: uvicorn.Server) -> None:
        """SIGTERM: refuse new requests (503), give in-flight ones --shutdown-timeout to
        finish, then stop."""
        state.draining = True
        logger.info("shutting down: draining %d in-flight requests (up to %gs)",
                    engine.num_in_flight, self.cfg.server_config.shutdown_timeout)
        deadline = time.monotonic() + self.cfg.server_config.shutdown_timeout
        while engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        server.should_exit = True

    def stop_children(self) -> None:
        # The children hold no state worth saving and ignore SIGTERM (see ignore_interrupts).
        for child in self.children:
            if child.is_alive():
                child.kill()
        for child in self.children:
            child.join(5)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    async def serve(self, listen_socket: socket.socket) -> int:
        cfg = self.cfg
        model, server_cfg = cfg.model_config, cfg.server_config
        metrics = Metrics(model.served_model_name)
        engine = EngineClient(self.endpoints, metrics)
        engine.start()
        tokenizer, embedding_dim = load_tokenizer(cfg)
        _import_streaming_backend()
        state, serving, speech, images = model_serving(cfg, engine, metrics, tokenizer,
                                                       embedding_dim)
        if server_cfg.trust_request_chat_template:
            tokenizer.request_templates = TemplateSandbox()
            tokenizer.request_templates.start()  # spawning takes ~1.5 s: not on a request
        app = build_app(state, serving, metrics, api_key=server_cfg.api_key,
                        max_request_bytes=server_cfg.max_request_bytes, speech=speech,
                        metrics_public=server_cfg.metrics_public, bound_host=server_cfg.host,
                        allowed_hosts=server_cfg.allowed_hosts,
                        allowed_origins=server_cfg.allowed_origins, web_ui=server_cfg.web_ui,
                        images=images)
        server = _Server(uvicorn.Config(
            app, log_level=server_cfg.log_level, access_log=server_cfg.log_level == "debug",
            timeout_graceful_shutdown=1.0, lifespan="off",
            http=bounded_http_protocol(fit_descriptor_limit(server_cfg.http)),
        ))
        tasks = []
        server.on_stop = lambda: tasks.append(asyncio.ensure_future(
            self.drain(state, engine, server)))
        watcher = asyncio.create_task(self.watch_children(engine, server))
        tasks.append(watcher)
        freeze_startup_heap()  # while the worker still loads: off the start-up path
        try:
            await self.wait_ready(engine, watcher)
            metrics.observe_cache_config(engine.ready.block_size, engine.ready.num_blocks)
            tasks.append(asyncio.create_task(self.watch_stalls(state, engine, server)))
            host, port = listen_socket.getsockname()[:2]
            logger.info("IPC sockets in %s", self.ipc_dir)
            print(ready_line(model.served_model_name, host, port, server_cfg), flush=True)
            await server.serve(sockets=[listen_socket])
        finally:
            for task in tasks:
                task.cancel()
            engine.close()
            if tokenizer.request_templates is not None:
                tokenizer.request_templates.stop()
        return self.exit_code

    async def wait_ready(self, engine: EngineClient, watcher: asyncio.Task) -> None:
        ready = asyncio.ensure_future(engine.wait_ready())
        # The worker builds any missing kernel (its own progress lines), loads the weights and
        # prefaults the KV cache: this says the server is still alive meanwhile.
        with Progress(f"loading {self.cfg.model_config.served_model_name} (weights, KV cache)"):
            done, _ = await asyncio.wait({ready, watcher},
                                         timeout=self.cfg.server_config.startup_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        if ready in done:
            try:
                ready.result()
                return
            except EngineDeadError as exc:
                raise StartupError(str(exc)) from None
        ready.cancel()
        if watcher in done:
            raise StartupError(engine.dead_reason or "a child process died during start-up")
        raise StartupError(f"the engine did not become ready in "
                           f"{self.cfg.server_config.startup_timeout:.0f}s")


def load_tokenizer(cfg: PipelineConfig) -> tuple[TextTokenizer, int | None]:
    """The model's tokenizer, warmed up, and its embedding width (an embeddings model's)."""
    model = cfg.model_config
    embedding_dim = None
    if model.task is PipelineTask.EMBEDDINGS_GENERATION:
        embedding_dim, eos = BertConfig.from_dir(model.model_path).hidden_size, []
    elif model.task is PipelineTask.PIXEL_GENERATION:
        eos = []
    else:
        eos = load_model_config(model.model_path, bool(cfg.custom_architectures)).eos_token_ids
    tokenizer = TextTokenizer(model.tokenizer or model.model_path, model.max_length, eos,
                              cfg.server_config.media)
    tokenizer.warm_up()
    return tokenizer, embedding_dim


def model_serving(cfg: PipelineConfig, engine: EngineClient, metrics: Metrics,
                  tokenizer: TextTokenizer, embedding_dim: int | None,
                  ) -> tuple[ServerState, ServingContext, SpeechRoute, Any]:
    """What the routes of one model share: its admission state, serving context, speech and
    images (an ImagesRoute, or None)."""
    model, server_cfg = cfg.model_config, cfg.server_config
    max_model_len = model.max_length  # (resolved by the CLI)
    state = ServerState(engine, server_cfg.admission)
    speech = SpeechRoute(engine, state, metrics, tokenizer, max_model_len,
                         model.sampling_params_defaults)
    images = _images_route(engine, state, cfg, metrics)
    serving = ServingContext(engine, tokenizer, model.served_model_name, {model.model_path},
                             max_model_len, state, server_cfg, model.task, embedding_dim,
                             extra_model_cards=_model_cards(speech, images, model.task),
                             sampling_defaults=model.sampling_params_defaults,
                             loras=lora_adapters(cfg, metrics))
    return state, serving, speech, images


def lora_adapters(cfg: PipelineConfig, metrics: Metrics) -> LoRAAdapters | None:
    """--enable-lora: the adapters requests may name (those of --lora-paths at first)."""
    lora = cfg.lora_config
    if not lora.enable_lora:
        return None
    metrics.max_lora = lora.max_num_loras
    base = load_model_config(cfg.model_config.model_path, bool(cfg.custom_architectures))
    return LoRAAdapters(lora, base, cfg.model_config.served_model_name)


def ready_line(model_name: str, host: str, port: int, cfg: ServerConfig) -> str:
    """What `loom serve` prints once it answers: where the API, the web chat and the metrics
    are."""
    base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    parts = [f"loom: serving {model_name} on {base} (API {base}/v1"]
    if cfg.web_ui:
        parts.append(f"web chat {base}/")
    parts.append(f"metrics {base}/metrics)")
    return ", ".join(parts)


def _rank_placement(placement: CpuPlacement | None, rank: int,
                    ranks: int) -> CpuPlacement | None:
    """Worker rank `rank`'s share of the worker cores (all of them when there are too few)."""
    if placement is None or ranks == 1:
        return placement
    per_rank = len(placement.worker) // ranks
    if per_rank == 0:
        return placement
    cores = placement.worker[rank * per_rank:(rank + 1) * per_rank]
    return dataclasses.replace(placement, worker=cores)


async def _any_exited(children: list[multiprocessing.Process]) -> None:
    """Wait, without a thread, until one of the children exits (its sentinel fd is readable)."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    for child in children:
        loop.add_reader(child.sentinel, lambda: exited.done() or exited.set_result(None))
    try:
        await exited
    finally:
        for child in children:
            loop.remove_reader(child.sentinel)


def _event_loop_factory():
    """uvloop's event loop where it is installed (the HTTP/SSE work per token is a third of
    asyncio's), else asyncio's own. The HTTP parser is httptools' (api_server/http_protocol.py)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def serve(cfg: PipelineConfig) -> int:
    try:
        check_exposure(cfg.server_config)
        listen_socket = bind_listen_socket(cfg.server_config.host, cfg.server_config.port)
    except StartupError as exc:
        print(f"loom: error: {exc}", file=sys.stderr, flush=True)
        return 1
    launcher = Launcher(cfg)
    try:
        launcher.start_children()
        with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
            return runner.run(launcher.serve(listen_socket))
    except StartupError as exc:
        print(f"loom: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        launcher.stop_children()
        listen_socket.close()


def _images_route(engine, state, cfg: PipelineConfig, metrics):
    """The Images API, for a diffusers pipeline directory served alone or beside a text model
    (--image-model: its id is the directory's name); None without one."""
    model = cfg.model_config
    if model.task is PipelineTask.PIXEL_GENERATION:
        path, name = model.model_path, model.served_model_name
    elif cfg.pixel_config.image_model_path is not None:
        path = cfg.pixel_config.image_model_path
        name = os.path.basename(path.rstrip("/"))
    else:
        return None
    from api_server.images_route import ImagesRoute
    from api_server.pixel_tokenizer import PixelGenerationTokenizer

    tokenizer = PixelGenerationTokenizer(path, max_image_size=cfg.pixel_config.max_image_size)
    return ImagesRoute(engine, state, tokenizer, name, metrics)


def _model_cards(speech, images, task: PipelineTask):
    """/v1/models' cards of the models served beside the main one: voices, an image model."""
    def cards(created: int) -> list[dict]:
        found = speech.model_cards(created)
        if images is not None and task is not PipelineTask.PIXEL_GENERATION:
            found.append(images.model_card(created))
        return found
    return cards


def _import_streaming_backend() -> None:
    """Starlette streams responses through anyio, which imports its asyncio backend on first
    use: ~25 ms the first streamed response of a fresh server would wait for."""
    import anyio._backends._asyncio  # noqa: F401
