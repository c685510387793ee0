"""One model of a server that serves several (api_server/model_pool.py): its configuration and
metrics, kept for the server's life, and while it is loaded its own scheduler and worker
processes, engine client and routes, started and stopped as a unit.

A loaded model's processes are the ones `loom serve` starts for a single model (the same
Launcher, its own IPC directory and KV budget); its routes are the single-model server's
(api_server/app.py's build_routes), so every API behaves the same with one model or many.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import select
import threading
import time

from api_server.app import build_routes
from api_server.chat_template import TemplateSandbox
from api_server.engine_client import EngineClient
from api_server.launcher import Launcher, _any_exited, load_tokenizer, model_serving
from api_server.metrics import Metrics
from pipelines.config import PipelineConfig
from serialization.messages import SchedulerStats

logger = logging.getLogger("loom")

# Beside its weights and KV cache, a loaded model's processes hold their interpreters, PyTorch
# and activations: a margin the memory check counts for each load.
PROCESS_OVERHEAD_BYTES = 512 << 20
# transformers' lazy imports are not thread-safe: two models' tokenizers load one at a time.
_tokenizer_loads = threading.Lock()


def _load_tokenizer(cfg: PipelineConfig):
    with _tokenizer_loads:
        return load_tokenizer(cfg)


class ServedModel:
    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.name = cfg.model_config.served_model_name
        self.metrics = Metrics(self.name)  # counters last across loads
        self.created = int(time.time())
        self.status = "unloaded"  # loading, loaded, unloading
        self.in_flight = 0  # requests routed to it (or waiting for it to load)
        self.last_used = time.monotonic()
        self.lock = asyncio.Lock()  # one load or unload at a time
        self.launcher: Launcher | None = None
        self.engine: EngineClient | None = None
        self.state = None
        self.serving = None
        self.app = None
        self.watcher: asyncio.Task | None = None
        self.on_failure = None  # (model, reason) -> None: its processes died or hung

    @property
    def loaded(self) -> bool:
        return self.app is not None

    def estimated_bytes(self) -> int:
        """Memory a load takes: its weights as stored (a float checkpoint may widen on load;
        a GGUF file stays in its blocks), --kv-cache-memory when given (else the worker sizes
        the KV cache from what is left), and the processes' own margin."""
        path = self.cfg.model_config.model_path
        files = [path] if os.path.isfile(path) else [
            f for pattern in ("*.safetensors", "*.bin", "*.gguf", "*.pt")
            for f in glob.glob(os.path.join(path, "**", pattern), recursive=True)]
        weights = sum(os.path.getsize(f) for f in files)
        return weights + (self.cfg.kv_cache_config.kv_cache_memory or 0) + PROCESS_OVERHEAD_BYTES

    def card(self) -> dict:
        """Its /v1/models entry: the single-model server's card when loaded."""
        card = self.serving.model_card() if self.loaded else {
            "id": self.name, "object": "model", "created": self.created, "owned_by": "loom",
            "root": self.name, "parent": None, "max_model_len": self.cfg.model_config.max_length}
        return {**card, "loaded": self.loaded, "status": self.status}

    async def load(self, known_paths: set[str]) -> None:
        """Start its processes and wait until they serve; StartupError if they cannot."""
        cfg, server_cfg = self.cfg, self.cfg.server_config
        launcher = Launcher(cfg)
        engine = EngineClient(launcher.endpoints, self.metrics)
        exited = None
        try:
            launcher.start_children()
            engine.start()
            exited = asyncio.ensure_future(self._settled_exit(launcher, engine))
            tokenizer, embedding_dim = await asyncio.to_thread(_load_tokenizer, cfg)
            if server_cfg.trust_request_chat_template:
                tokenizer.request_templates = TemplateSandbox()
                await asyncio.to_thread(tokenizer.request_templates.start)
            await launcher.wait_ready(engine, exited)
        except BaseException:
            if exited is not None:
                exited.cancel()
            engine.close()
            await asyncio.to_thread(launcher.stop_children)
            raise
        state, serving, speech, images = model_serving(cfg, engine, self.metrics, tokenizer,
                                                       embedding_dim)
        self.metrics.observe_cache_config(engine.ready.block_size, engine.ready.num_blocks)
        app = build_routes(state, serving, self.metrics, speech, server_cfg.web_ui, images)
        known_paths.update(route.path for route in app.routes)
        self.launcher, self.engine, self.state, self.serving = launcher, engine, state, serving
        self.app = app
        self.watcher = asyncio.create_task(self._watch(exited))

    async def unload(self) -> None:
        """Stop its processes (their memory goes with them)."""
        self.app = None  # (new requests wait for a reload from here on)
        if self.watcher is not None:
            self.watcher.cancel()
        tokenizer = self.serving.tokenizer
        self.engine.close()
        await asyncio.to_thread(self.launcher.stop_children)
        if tokenizer.request_templates is not None:
            tokenizer.request_templates.stop()
        # The next load's scheduler counts its totals from zero again.
        self.metrics.observe_scheduler(SchedulerStats())
        self.launcher = self.engine = self.state = self.serving = self.watcher = None

    @staticmethod
    async def _settled_exit(launcher: Launcher, engine: EngineClient) -> None:
        """A child exited; a failing child's own explanation may still be in flight."""
        await _any_exited(launcher.children)
        if engine.ready is None:
            await asyncio.sleep(0.5)

    async def _watch(self, exited: asyncio.Future) -> None:
        """A child that dies or a step that hangs fails this model's requests and unloads it
        (the next request loads it afresh); the other models serve on."""
        limit = self.state.limits.step_timeout
        while not exited.done() and self.state.stalled_for() <= limit:
            await asyncio.wait({exited}, timeout=1.0)
        if exited.done():
            # (A child's sentinel reads closed a moment before the child can be reaped.)
            dead = [c for c in self.launcher.children
                    if select.select([c.sentinel], [], [], 0)[0]]
            await asyncio.to_thread(lambda: [c.join(1.0) for c in dead])
            reason = ", ".join(f"{c.name} (exit code {c.exitcode})" for c in dead) + " died"
        else:
            exited.cancel()
            reason = f"no step finished in {limit:g}s (--step-timeout)"
        logger.error("model %s: %s; failing its requests and unloading it", self.name, reason)
        self.engine.mark_dead(reason)
        self.watcher = None  # (unload must not cancel this task, which calls it)
        if self.on_failure is not None:
            self.on_failure(self, reason)
