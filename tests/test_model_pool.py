"""ModelPool's decisions (api_server/model_pool.py) on stand-in models that load and unload
instantly: which model an unload makes room with, when a load is refused and why, and idle
unloading. (tests/test_several_models.py: the same on a real server's processes.)"""

import asyncio
import types

import pytest

from api_server import model_pool
from api_server.model_pool import ModelPool
from api_server.protocol import RequestError
from pipelines.config import ModelPoolConfig, PipelineConfig

GiB = 1 << 30


class StandIn:
    """What the pool reads and calls of a ServedModel."""

    def __init__(self, name: str, size: int = GiB) -> None:
        self.name, self.size = name, size
        self.cfg = PipelineConfig(devices="cpu")
        self.status, self.in_flight, self.last_used, self.on_failure = "unloaded", 0, 0.0, None
        self.loaded = False

    def estimated_bytes(self) -> int:
        return self.size

    async def load(self, known_paths) -> None:
        self.loaded = True
        self.app = types.SimpleNamespace(routes=[])

    async def unload(self) -> None:
        self.loaded = False


def run(coro):
    return asyncio.run(coro)


def loaded(pool) -> set[str]:
    return {name for name, m in pool.models.items() if m.loaded}


def test_a_load_unloads_the_least_recently_used_idle_model():
    async def go():
        pool = ModelPool([StandIn("a"), StandIn("b"), StandIn("c")],
                         ModelPoolConfig(max_loaded_models=2))
        await pool.start()
        assert loaded(pool) == {"a", "b"}
        pool.release(await pool.acquire("a"))  # b is now the least recently used
        c = await pool.acquire("c")
        assert loaded(pool) == {"a", "c"} and c.in_flight == 1
        assert pool.unloads.labels("b", "evicted")._value.get() == 1

    run(go())


def test_a_full_pool_of_busy_models_refuses_a_load_with_503():
    async def go():
        pool = ModelPool([StandIn("a"), StandIn("b")], ModelPoolConfig(max_loaded_models=1))
        await pool.start()
        await pool.acquire("a")  # in use
        with pytest.raises(RequestError) as caught:
            await pool.acquire("b")
        return caught.value, pool

    error, pool = run(go())
    assert error.status == 503 and error.code == "model_capacity"
    assert "--max-loaded-models" in error.message
    assert loaded(pool) == {"a"} and pool.models["b"].in_flight == 0


def test_memory_short_unloads_idle_models_or_refuses_saying_how_much(monkeypatch):
    free = {"bytes": 3 * GiB}
    monkeypatch.setattr(model_pool, "available_memory_bytes", lambda: free["bytes"])

    async def go():
        models = [StandIn("a"), StandIn("big", size=5 * GiB)]
        pool = ModelPool(models, ModelPoolConfig())  # (nothing loaded before asked for)
        user = await pool.acquire("a")
        with pytest.raises(RequestError) as caught:  # a is busy: nothing to unload
            await pool.acquire("big")
        pool.release(user)
        original_unload = models[0].unload

        async def unload_frees_memory():
            await original_unload()
            free["bytes"] += 3 * GiB

        models[0].unload = unload_frees_memory
        await pool.acquire("big")  # a is idle now: unloaded for room
        return caught.value, pool

    error, pool = run(go())
    assert error.status == 503 and error.code == "insufficient_memory"
    assert "5.0 GiB" in error.message and "3.0 GiB" in error.message
    assert loaded(pool) == {"big"}


def test_idle_models_unload_after_the_timeout():
    async def go():
        pool = ModelPool([StandIn("a"), StandIn("b")],
                         ModelPoolConfig(model_idle_timeout=0.2))
        await pool.start()
        busy = await pool.acquire("b")
        await asyncio.sleep(0.6)
        still = loaded(pool)
        pool.release(busy)
        await asyncio.sleep(0.6)
        after = loaded(pool)
        await pool.close()
        return still, after, pool

    still, after, pool = run(go())
    assert still == {"b"} and after == set()
    assert pool.unloads.labels("a", "idle")._value.get() == 1
