"""`loom serve`: start the worker and scheduler processes, serve HTTP, stop everything.

The API server runs in this (parent) process; the scheduler and worker are spawned children
that die with it (PR_SET_PDEATHSIG). If a child dies while serving, the server says which,
fails the in-flight requests, and exits non-zero so a supervisor can restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass

import uvicorn

from api_server.app import build_app
from api_server.chat_template import TemplateSandbox
from api_server.engine_client import EngineClient, EngineDeadError
from api_server.image_inputs import MediaLimits
from api_server.metrics import Metrics
from api_server.openai_routes import OpenAIRoutes
from api_server.server_state import AdmissionLimits, ServerState
from api_server.speech_route import SpeechRoute
from api_server.tokenizer import TextTokenizer
from pipelines.cpu_placement import CpuPlacement
from pipelines.lifecycle import freeze_startup_heap
from scheduler.process import SchedulerProcessConfig, run_scheduler
from serialization.sockets import Endpoints, make_private_ipc_dir
from worker.model_config import RunnerConfig, load_model_config, resolve_max_model_len
from worker.models.bert_config import BertConfig
from worker.process import run_worker

logger = logging.getLogger("loom")


class StartupError(RuntimeError):
    """A problem the user can fix; reported as one line, no traceback."""


@dataclass
class ServeConfig:
    model_dir: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "float32"
    quantization: str | None = None  # RunnerConfig's: "gguf", "int8" or None
    tokenizer_dir: str | None = None  # default: model_dir (a GGUF file's: a cache directory)
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_cache_memory: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    num_threads: int | None = None
    cpu_placement: bool = True
    log_level: str = "info"
    startup_timeout: float = 300.0
    shutdown_timeout: float = 10.0
    request_timeout: float | None = None
    step_timeout: float = 120.0
    max_queued_requests: int = 512
    max_queued_tokens: int = 1_000_000
    max_sequences_per_request: int = 256
    trust_request_chat_template: bool = False
    api_key: str | None = None
    allow_unauthenticated: bool = False
    max_request_bytes: int = 16 << 20
    task: str = "generate"
    speech: bool = True
    speech_noise: bool = True
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    media_limits: MediaLimits = MediaLimits()  # a vision model's image limits


def check_exposure(cfg: ServeConfig) -> None:
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
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.ipc_dir = make_private_ipc_dir()
        self.endpoints = Endpoints.ipc(self.ipc_dir)
        self.children: list[multiprocessing.Process] = []
        self.exit_code = 0

    def start_children(self) -> None:
        cfg = self.cfg
        mp = multiprocessing.get_context("spawn")
        threads = cfg.num_threads or max(1, os.cpu_count() or 1)
        runner_cfg = RunnerConfig(
            model_dir=cfg.model_dir, dtype=cfg.dtype, quantization=cfg.quantization,
            tokenizer_dir=cfg.tokenizer_dir, block_size=cfg.block_size,
            max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
            kv_cache_memory=cfg.kv_cache_memory, task=cfg.task, speech=cfg.speech,
            speech_noise=cfg.speech_noise,
        )
        sched_cfg = SchedulerProcessConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_prefix_caching=cfg.enable_prefix_caching, log_level=cfg.log_level,
            kv_events_endpoint=cfg.kv_events_endpoint, kv_events_topic=cfg.kv_events_topic,
        )
        placement = CpuPlacement.plan(threads) if cfg.cpu_placement else None
        self.children = [
            mp.Process(target=run_worker, name="loom-worker",
                       args=(runner_cfg, self.endpoints, threads, cfg.log_level, placement)),
            mp.Process(target=run_scheduler, name="loom-scheduler",
                       args=(sched_cfg, self.endpoints, placement)),
        ]
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
                    engine.num_in_flight, self.cfg.shutdown_timeout)
        deadline = time.monotonic() + self.cfg.shutdown_timeout
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
        metrics = Metrics(cfg.served_model_name)
        engine = EngineClient(self.endpoints, metrics)
        engine.start()
        embedding_dim = None
        if cfg.task == "embed":
            bert = BertConfig.from_dir(cfg.model_dir)
            max_model_len, embedding_dim, eos = bert.max_seq_length, bert.hidden_size, []
        else:
            model_config = load_model_config(cfg.model_dir)
            max_model_len = resolve_max_model_len(model_config, cfg.max_model_len)
            eos = model_config.eos_token_ids
        tokenizer = TextTokenizer(cfg.tokenizer_dir or cfg.model_dir, max_model_len, eos,
                                  cfg.media_limits)
        tokenizer.warm_up()
        _import_streaming_backend()
        state = ServerState(engine, AdmissionLimits(
            max_queued_requests=cfg.max_queued_requests,
            max_queued_tokens=cfg.max_queued_tokens, step_timeout=cfg.step_timeout))
        routes = OpenAIRoutes(engine, tokenizer, cfg.served_model_name, {cfg.model_dir},
                              max_model_len, state, cfg.request_timeout, cfg.task,
                              embedding_dim, cfg.max_sequences_per_request,
                              cfg.trust_request_chat_template,
                              tool_call_parser=cfg.tool_call_parser,
                              reasoning_parser=cfg.reasoning_parser)
        if cfg.trust_request_chat_template:
            tokenizer.request_templates = TemplateSandbox()
            tokenizer.request_templates.start()  # spawning takes ~1.5 s: not on a request
        speech = SpeechRoute(engine, state, [], 0, metrics)
        app = build_app(state, routes, metrics, api_key=cfg.api_key,
                        max_request_bytes=cfg.max_request_bytes, speech=speech)
        server = _Server(uvicorn.Config(
            app, log_level=cfg.log_level, access_log=cfg.log_level == "debug",
            timeout_graceful_shutdown=1.0, lifespan="off",
        ))
        tasks = []
        server.on_stop = lambda: tasks.append(asyncio.ensure_future(
            self.drain(state, engine, server)))
        watcher = asyncio.create_task(self.watch_children(engine, server))
        tasks.append(watcher)
        freeze_startup_heap()  # while the worker still loads: off the start-up path
        try:
            await self._wait_ready(engine, watcher)
            speech.voices, speech.sample_rate = engine.ready.voices, engine.ready.sample_rate
            metrics.observe_cache_config(engine.ready.block_size, engine.ready.num_blocks)
            tasks.append(asyncio.create_task(self.watch_stalls(state, engine, server)))
            host, port = listen_socket.getsockname()[:2]
            logger.info("IPC sockets in %s", self.ipc_dir)
            print(f"loom: serving {cfg.served_model_name} on http://{host}:{port}", flush=True)
            await server.serve(sockets=[listen_socket])
        finally:
            for task in tasks:
                task.cancel()
            engine.close()
            if tokenizer.request_templates is not None:
                tokenizer.request_templates.stop()
        return self.exit_code

    async def _wait_ready(self, engine: EngineClient, watcher: asyncio.Task) -> None:
        ready = asyncio.ensure_future(engine.wait_ready())
        done, _ = await asyncio.wait({ready, watcher}, timeout=self.cfg.startup_timeout,
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
        raise StartupError(f"the engine did not become ready in {self.cfg.startup_timeout:.0f}s")


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
    asyncio's), else asyncio's own. uvicorn picks httptools' parser by itself."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def serve(cfg: ServeConfig) -> int:
    try:
        check_exposure(cfg)
        listen_socket = bind_listen_socket(cfg.host, cfg.port)
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


def _import_streaming_backend() -> None:
    """Starlette streams responses through anyio, which imports its asyncio backend on first
    use: ~25 ms the first streamed response of a fresh server would wait for."""
    import anyio._backends._asyncio  # noqa: F401
