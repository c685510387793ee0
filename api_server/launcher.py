"""`loom serve`: start the worker and scheduler processes, serve HTTP, stop everything.

The API server runs in this (parent) process; the scheduler and worker are spawned children
that die with it (PR_SET_PDEATHSIG). If a child dies while serving, the server says which,
fails the in-flight requests, and exits non-zero so a supervisor can restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from api_server.engine_client import EngineClient, EngineDeadError
from api_server.metrics import Metrics
from api_server.openai_routes import OpenAIRoutes
from api_server.tokenizer import TextTokenizer
from scheduler.process import SchedulerProcessConfig, run_scheduler
from serialization.sockets import Endpoints, make_private_ipc_dir
from worker.model_config import RunnerConfig, load_model_config, resolve_max_model_len
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
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_cache_memory: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    log_level: str = "info"
    startup_timeout: float = 300.0
    shutdown_timeout: float = 10.0


def bind_listen_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn, with our own signal handling: SIGINT/SIGTERM start a graceful shutdown and
    are not re-raised afterwards, so the children are stopped in order."""

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
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


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
            model_dir=cfg.model_dir, dtype=cfg.dtype, block_size=cfg.block_size,
            max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
            kv_cache_memory=cfg.kv_cache_memory,
        )
        sched_cfg = SchedulerProcessConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_prefix_caching=cfg.enable_prefix_caching, log_level=cfg.log_level,
        )
        self.children = [
            mp.Process(target=run_worker, name="loom-worker",
                       args=(runner_cfg, self.endpoints, threads, cfg.log_level)),
            mp.Process(target=run_scheduler, name="loom-scheduler",
                       args=(sched_cfg, self.endpoints)),
        ]
        for child in self.children:
            child.start()

    async def watch_children(self, engine: EngineClient, server: uvicorn.Server) -> None:
        """Wait for any child to exit; then fail everything in flight and shut down."""
        await _any_exited(self.children)
        if server.should_exit:
            return
        if engine.ready is None:
            await asyncio.sleep(0.5)  # a failing child's own explanation may still be in flight
        dead = [c for c in self.children if not c.is_alive()]
        names = ", ".join(f"{c.name} (exit code {c.exitcode})" for c in dead)
        logger.error("%s died; stopping the server", names)
        engine.mark_dead(f"{names} died")
        self.exit_code = 1
        server.should_exit = True

    def stop_children(self) -> None:
        for child in self.children:
            if child.is_alive():
                child.terminate()
        deadline = time.monotonic() + 5
        for child in self.children:
            child.join(max(0.0, deadline - time.monotonic()))
            if child.is_alive():
                child.kill()
                child.join(1)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    async def serve(self, listen_socket: socket.socket) -> int:
        cfg = self.cfg
        metrics = Metrics(cfg.served_model_name)
        engine = EngineClient(self.endpoints, metrics)
        engine.start()
        model_config = load_model_config(cfg.model_dir)
        max_model_len = resolve_max_model_len(model_config, cfg.max_model_len)
        tokenizer = TextTokenizer(cfg.model_dir, max_model_len, model_config.eos_token_ids)
        routes = OpenAIRoutes(engine, tokenizer, cfg.served_model_name,
                              {cfg.model_dir}, max_model_len)
        app = build_app(engine, routes, metrics)
        server = _Server(uvicorn.Config(
            app, log_level=cfg.log_level, access_log=cfg.log_level == "debug",
            timeout_graceful_shutdown=cfg.shutdown_timeout, lifespan="off",
        ))
        watcher = asyncio.create_task(self.watch_children(engine, server))
        try:
            await self._wait_ready(engine, watcher)
            host, port = listen_socket.getsockname()[:2]
            print(f"loom: serving {cfg.served_model_name} on http://{host}:{port}", flush=True)
            await server.serve(sockets=[listen_socket])
        finally:
            watcher.cancel()
            engine.close()
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


def serve(cfg: ServeConfig) -> int:
    try:
        listen_socket = bind_listen_socket(cfg.host, cfg.port)
    except StartupError as exc:
        print(f"loom: error: {exc}", file=sys.stderr, flush=True)
        return 1
    launcher = Launcher(cfg)
    try:
        launcher.start_children()
        return asyncio.run(launcher.serve(listen_socket))
    except StartupError as exc:
        print(f"loom: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        launcher.stop_children()
        listen_socket.close()
