"""Which of a server's models are loaded: loads on first use, unloads when idle, and the room a
load needs (--max-loaded-models, the memory available), made by unloading the least recently
used idle model or refused with a 503 that says why.

Loads and unloads run one at a time (a load's memory check must see the last one's effect);
requests for a model already loaded never wait for them.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from api_server.protocol import RequestError
from api_server.served_model import ServedModel
from api_server.startup_error import StartupError
from pipelines.config import ModelPoolConfig
from processes.host_memory import available_memory_bytes

logger = logging.getLogger("loom")

GiB = 1 << 30
LOAD_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)





class ModelPool:
    def __init__(self, models: list[ServedModel], cfg: ModelPoolConfig) -> None:
        self.models = {model.name: model for model in models}
        self.default = models[0]  # for requests that name no model
        self.max_loaded = cfg.max_loaded_models or len(models)
        self.idle_timeout = cfg.model_idle_timeout
        self.known_paths: set[str] = set()  # of the models' routes (the HTTP metrics' labels)
        self.routes = []  # a loaded model's routes: which paths a model answers
        self._room = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        for model in models:
            model.on_failure = self._on_failure
        self.registry = CollectorRegistry()
        label = ["model_name"]
        self.loads = Counter("loom:model_loads", "Models loaded.", label, registry=self.registry)
        self.unloads = Counter("loom:model_unloads", "Models unloaded, by reason (idle, "
                               "evicted: room for another, failed: its processes died or hung).",
                               ["model_name", "reason"], registry=self.registry)
        self.load_seconds = Histogram("loom:model_load_duration_seconds", "Time to load a model "
                                      "(processes started, weights and KV cache ready).", label,
                                      buckets=LOAD_BUCKETS, registry=self.registry)
        loaded = Gauge("loom:model_loaded", "1 while the model is loaded.", label,
                       registry=self.registry)
        for model in models:  # (labels bounded by the configured names)
            loaded.labels(model.name).set_function(lambda m=model: float(m.loaded))

    @property
    def num_in_flight(self) -> int:
        return sum(model.in_flight for model in self.models.values())

    async def start(self) -> None:
        """Load the first --max-loaded-models models, side by side (a RequestError if one
        cannot load)."""
        async with self._room:
            loads = [asyncio.ensure_future(self._load(model))
                     for model in list(self.models.values())[:self.max_loaded]]
            try:
                await asyncio.gather(*loads)
            except BaseException:
                for load in loads:
                    load.cancel()
                await asyncio.gather(*loads, return_exceptions=True)
                raise
        if self.idle_timeout is not None:
            self._spawn(self._unload_idle())

    async def acquire(self, name: str) -> ServedModel:
        """The model, loaded (waiting for its load), counted in use until `release`d. A
        RequestError (503) when it cannot be loaded now."""
        model = self.models[name]
        model.in_flight += 1  # (in use from here: not evicted while its request waits)
        try:
            while not model.loaded:
                async with self._room:
                    if not model.loaded:
                        await self._make_room(model)
                        await self._load(model)
        except BaseException:
            model.in_flight -= 1
            raise
        model.last_used = time.monotonic()
        return model

    def release(self, model: ServedModel) -> None:
        model.in_flight -= 1
        model.last_used = time.monotonic()

    async def _make_room(self, model: ServedModel) -> None:
        while sum(m.loaded for m in self.models.values()) >= self.max_loaded:
            victim = self._idle_lru(model)
            if victim is None:
                raise RequestError(
                    f"the model `{model.name}` is not loaded and cannot be now: "
                    f"{self.max_loaded} models are loaded (--max-loaded-models) and all are "
                    f"serving requests; retry later", param="model", status=503,
                    code="model_capacity")
            await self._unload(victim, "evicted")
        if model.cfg.devices.startswith("cuda"):
            return  # (its weights and KV cache go to the GPU, sized from its free memory)
        needed = model.estimated_bytes()
        while needed > (available := available_memory_bytes()):
            victim = self._idle_lru(model)
            if victim is None:
                raise RequestError(
                    f"the model `{model.name}` is not loaded and cannot be now: it needs about "
                    f"{needed / GiB:.1f} GiB and {available / GiB:.1f} GiB of memory is "
                    f"available (no idle model is left to unload); retry later", param="model",
                    status=503, code="insufficient_memory")
            await self._unload(victim, "evicted")

    def _idle_lru(self, keep: ServedModel) -> ServedModel | None:
        idle = [m for m in self.models.values() if m.loaded and not m.in_flight and m is not keep]
        return min(idle, key=lambda m: m.last_used, default=None)

    async def _load(self, model: ServedModel) -> None:
        """(Holding the room lock.)"""
        started = time.monotonic()
        model.status = "loading"
        try:
            await model.load(self.known_paths)
            self.routes = model.app.routes
        except StartupError as exc:
            model.status = "unloaded"
            raise RequestError(f"the model `{model.name}` failed to load: {exc}", param="model",
                               status=503, code="model_load_failed") from exc
        except BaseException:
            model.status = "unloaded"
            raise
        model.status = "loaded"
        model.last_used = time.monotonic()
        seconds = model.last_used - started
        self.loads.labels(model.name).inc()
        self.load_seconds.labels(model.name).observe(seconds)
        logger.info("model %s loaded in %.1fs", model.name, seconds)

    async def _unload(self, model: ServedModel, reason: str) -> None:
        """(Holding the room lock.)"""
        model.status = "unloading"
        await model.unload()
        model.status = "unloaded"
        self.unloads.labels(model.name, reason).inc()
        logger.info("model %s unloaded (%s)", model.name, reason)

    async def _unload_idle(self) -> None:
        """--model-idle-timeout: unload each model no request has used for that long."""
        while True:
            await asyncio.sleep(min(1.0, self.idle_timeout / 4))
            now = time.monotonic()
            for model in self.models.values():
                if model.loaded and not model.in_flight and \
                        now - model.last_used > self.idle_timeout:
                    try:
                        async with self._room:
                            if model.loaded and not model.in_flight and \
                                    time.monotonic() - model.last_used > self.idle_timeout:
                                await self._unload(model, "idle")
                    except Exception:  # (the other models still unload on idle)
                        logger.exception("unloading model %s", model.name)

    def _on_failure(self, model: ServedModel, reason: str) -> None:
        async def unload():
            await asyncio.sleep(0.5)  # its requests get their errors first
            async with self._room:
                if model.loaded:
                    await self._unload(model, "failed")

        self._spawn(unload())

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for model in self.models.values():
            if model.loaded:
                await model.unload()
