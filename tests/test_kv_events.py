"""KV cache events (--kv-events-endpoint): a real server publishes the prefix cache's changes in
vLLM's format, checked against vLLM's own struct definitions re-declared here (the oracle:
the shapes of `vllm.distributed.kv_events`, old and new, not Loom's code)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import zmq

from scheduler.block_manager import BlockManager
from scheduler.kv_events import KVEventPublisher
from tests.helpers import ROOT, free_port, start_server

BLOCK = 16
TOPIC = b"kv@127.0.0.1@tiny"


# ---- the oracle: vLLM's KVEventBatch as its kv_events module and subscriber example define it --
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM 0.9's first version (no medium, no data_parallel_rank): consumers built on it must still
# decode the batches (msgspec ignores trailing fields it does not know).
class OldEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class OldKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class OldBlockRemoved(OldKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class OldAllBlocksCleared(OldKVCacheEvent, tag="AllBlocksCleared"):
    pass


class OldKVEventBatch(OldEventBatch):
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(KVEventBatch).decode
DECODE_OLD = msgspec.msgpack.Decoder(OldKVEventBatch).decode


class Subscriber:
    """A SUB socket bound on loopback, as llm-d's indexer binds; the server connects to it.
    It receives on its own thread from the start, as a real subscriber does: ZeroMQ sends a
    SUB's subscription to a new peer only while the SUB is being read, and until then the
    publisher drops what it sends."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.port = free_port()
        self.batches: list[tuple[int, KVEventBatch]] = []
        self.errors: list[BaseException] = []
        self.running = True
        ready = threading.Event()
        self.thread = threading.Thread(target=self._receive, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(5)

    def _receive(self, ready: threading.Event) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sock.bind(f"tcp://127.0.0.1:{self.port}")
        ready.set()
        while self.running:
            if not sock.poll(50):
                continue
            try:
                topic, seq, payload = sock.recv_multipart()
                assert topic == TOPIC and len(seq) == 8
                DECODE_OLD(payload)  # the first format's decoders read it too
                self.batches.append((int.from_bytes(seq, "big"), DECODE(payload)))
            except (AssertionError, ValueError, msgspec.DecodeError) as exc:
                self.errors.append(exc)
        sock.close(linger=0)

    def wait(self, until, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until():
            time.sleep(0.02)
        assert not self.errors, self.errors

    def events(self, kind):
        return [e for _, b in list(self.batches) for e in b.events if isinstance(e, kind)]

    def close(self) -> None:
        self.running = False
        self.thread.join(5)
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    from bench.lora import write_adapter
    from pipelines.checkpoint.model_config import load_model_config

    sub = Subscriber()
    adapter = write_adapter(str(tmp_path_factory.mktemp("kv-lora") / "tiny-lora"),
                            load_model_config(tiny_model_dir), rank=2, seed=0)
    # 20 blocks of 16 tokens: a handful of prompts fill the cache and force evictions.
    srv = start_server(tiny_model_dir, "--served-model-name", "tiny", "--max-model-len", "128",
                       "--kv-cache-memory", "160KiB", "--block-size", str(BLOCK),
                       "--kv-events-endpoint", f"tcp://127.0.0.1:{sub.port}",
                       "--kv-events-topic", TOPIC.decode(), "--enable-lora",
                       "--max-lora-rank", "2", "--lora-paths", f"tiny-lora={adapter}")
    yield srv, sub
    srv.stop()
    sub.close()


def complete(srv, prompt: list[int], max_tokens: int = 1, model: str = "tiny") -> None:
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text


def stored_tokens(sub) -> int:
    return sum(len(e.token_ids) for e in sub.events(BlockStored))


def test_events_follow_the_prefix_cache(served):
    srv, sub = served
    # The scheduler starts with a clean slate: the first batch, sequence number 0.
    sub.wait(lambda: sub.batches)
    assert sub.batches[0][0] == 0 and sub.batches[0][1].events == [AllBlocksCleared()]

    rng = np.random.default_rng(0)
    prefix = rng.integers(1000, 40000, 3 * BLOCK).tolist()
    first = prefix + rng.integers(1000, 40000, 5).tolist()  # 53 tokens: 3 full blocks
    complete(srv, first)
    sub.wait(lambda: stored_tokens(sub) >= 3 * BLOCK)
    (stored,) = sub.events(BlockStored)
    # One event for the prompt's three blocks (one batch per step, not a message per block).
    assert stored.token_ids == first[: 3 * BLOCK] and len(stored.block_hashes) == 3
    assert stored.parent_block_hash is None and stored.block_size == BLOCK
    assert stored.lora_id is None and stored.medium == "GPU"
    assert len(set(stored.block_hashes)) == 3

    # The same prefix, another tail: the shared blocks are reused, not stored again; the new
    # block chains onto the prefix's last one.
    second = prefix + rng.integers(1000, 40000, BLOCK + 3).tolist()
    complete(srv, second)
    sub.wait(lambda: stored_tokens(sub) >= 4 * BLOCK)
    _, new = sub.events(BlockStored)
    assert new.token_ids == second[3 * BLOCK : 4 * BLOCK]
    assert new.parent_block_hash == stored.block_hashes[-1] and len(new.block_hashes) == 1

    # Generated tokens fill blocks too: the stored tokens are the prompt's, then the output's.
    third = rng.integers(1000, 40000, BLOCK - 4).tolist()
    complete(srv, third, max_tokens=12)
    sub.wait(lambda: stored_tokens(sub) >= 5 * BLOCK)
    assert sub.events(BlockStored)[-1].token_ids[: BLOCK - 4] == third

    # Distinct prompts overflow the 20-block cache: every block removed is one stored before,
    # removed once (unless stored again in between).
    for _ in range(12):
        complete(srv, rng.integers(1000, 40000, 2 * BLOCK + 1).tolist())
    sub.wait(lambda: len(sub.events(BlockRemoved)) >= 4)
    assert len(sub.events(BlockRemoved)) >= 4
    held: set[int] = set()
    for _, batch in sub.batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert held.isdisjoint(event.block_hashes)
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= held and event.medium == "GPU"
                held.difference_update(event.block_hashes)
    assert all(0 <= h < 2**64 for e in sub.events(BlockStored) for h in e.block_hashes)

    seqs = [seq for seq, _ in sub.batches]
    assert seqs == list(range(len(seqs)))  # nothing lost, in order
    assert all(b.data_parallel_rank == 0 and abs(b.ts - time.time()) < 120 for _, b in sub.batches)


def test_an_adapters_blocks_carry_its_lora_id(served):
    """vLLM's BlockStored.lora_id: None for the base model's blocks, the adapter's id for an
    adapter's (the same id for all of them), under hashes of their own."""
    srv, sub = served
    rng = np.random.default_rng(2)
    prompt = rng.integers(1000, 40000, 2 * BLOCK + 1).tolist()
    other = rng.integers(1000, 40000, BLOCK + 1).tolist()
    count = len(sub.events(BlockStored))
    complete(srv, prompt)
    complete(srv, prompt, model="tiny-lora")
    complete(srv, other, model="tiny-lora")

    def these() -> list[BlockStored]:
        # (By their tokens: an earlier test's blocks may still be arriving.)
        return [e for e in sub.events(BlockStored)[count:]
                if e.token_ids in (prompt[:2 * BLOCK], other[:BLOCK])]

    sub.wait(lambda: len(these()) >= 3)
    base, adapter, again = these()[:3]
    assert base.lora_id is None and base.token_ids == adapter.token_ids == prompt[:2 * BLOCK]
    assert isinstance(adapter.lora_id, int) and adapter.lora_id == again.lora_id
    assert set(base.block_hashes).isdisjoint(adapter.block_hashes)


def prefix_cache_hits(srv) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return float(re.search(r"^loom:prefix_cache_hits_total{[^}]*} (\S+)$", text, re.M).group(1))


def test_cache_salt_keeps_tenants_apart_in_every_api(served):
    """The same prompt under another cache_salt finds nothing of the first's blocks (its own
    are stored beside them, under other hashes); under the same salt it hits. The hits are
    counted as the request is admitted, before its response ends."""
    srv, sub = served
    rng = np.random.default_rng(1)

    def words() -> str:
        return " ".join(f"w{x}" for x in rng.integers(0, 10**6, 10))

    bodies = {
        "/v1/completions": {"prompt": rng.integers(1000, 40000, 3 * BLOCK + 1).tolist(),
                            "max_tokens": 1},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": words()}],
                                 "max_tokens": 1},
        "/v1/responses": {"input": words(), "max_output_tokens": 1},
        "/v1/messages": {"messages": [{"role": "user", "content": words()}], "max_tokens": 1},
    }
    def send(path: str, body: dict, salt: str) -> float:
        before = prefix_cache_hits(srv)
        r = httpx.post(srv.url + path, timeout=60, json={
            "model": "tiny", "temperature": 0, **body, "cache_salt": salt})
        assert r.status_code == 200, (path, r.text)
        return prefix_cache_hits(srv) - before

    def stored_after(count: int) -> list[BlockStored]:
        sub.wait(lambda: len(sub.events(BlockStored)) > count)
        return sub.events(BlockStored)

    for path, body in bodies.items():
        # Salts of their own per API: chat templates share a system prompt across the APIs.
        count = len(sub.events(BlockStored))
        send(path, body, f"a{path}")
        count = len(stored_after(count))
        assert send(path, body, f"b{path}") == 0, path
        first, second = stored_after(count)[-2:]
        assert first.token_ids[: 2 * BLOCK] == second.token_ids[: 2 * BLOCK]
        assert set(first.block_hashes).isdisjoint(second.block_hashes)
        assert send(path, body, f"a{path}") >= 2 * BLOCK, path


@pytest.mark.parametrize("salt", ["", "x" * 257, 7, ["a"]])
def test_a_bad_cache_salt_is_a_400_naming_it(served, salt):
    srv, _ = served
    for path, body in [("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses", {"input": "hi"}),
                       ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 1})]:
        r = httpx.post(srv.url + path, timeout=60,
                       json={"model": "tiny", **body, "cache_salt": salt})
        assert r.status_code == 400, (path, r.text)
        assert "cache_salt" in r.text, (path, r.text)


def test_block_manager_records_only_when_asked():
    prompt = np.arange(100, 140)
    quiet = BlockManager(num_blocks=8, block_size=BLOCK)
    quiet.allocate("a", 40)
    quiet.register_full_blocks("a", prompt, 40)
    assert quiet.kv_events is None

    bm = BlockManager(num_blocks=3, block_size=BLOCK, record_kv_events=True)
    bm.allocate("a", 40)
    bm.register_full_blocks("a", prompt, 33)
    (stored,) = bm.take_kv_events()
    assert stored.token_ids == prompt[:32].tolist() and bm.kv_events == []
    bm.free("a")
    bm.allocate("b", 48)  # takes the three blocks back: both cached ones are evicted
    removed = bm.take_kv_events()
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(stored.block_hashes)


def test_hashes_are_keyed_per_process_unless_pythonhashseed_is_shared():
    """Each process draws its own key, so nobody can precompute a block's hash; replicas given
    the same PYTHONHASHSEED (as vLLM reads it) name a prefix alike, for routers that compare."""
    code = ("import numpy as np; from scheduler.block_manager import BlockManager as B\n"
            "b = B(4, 16, record_kv_events=True); b.allocate('a', 32)\n"
            "b.register_full_blocks('a', np.arange(32), 32)\n"
            "print(b.take_kv_events()[0].block_hashes)")

    def hashes(**env):
        base = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                              text=True, check=True, env=dict(base, **env)).stdout

    assert hashes() != hashes()
    assert hashes(PYTHONHASHSEED="7") == hashes(PYTHONHASHSEED="7") != hashes(PYTHONHASHSEED="8")


def test_publisher_binds_ipc_and_frames_like_vllm(tmp_path):
    ctx = zmq.Context()
    try:
        endpoint = f"ipc://{tmp_path}/kv"
        pub = KVEventPublisher(ctx, endpoint, "t")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        time.sleep(0.2)  # the subscription reaches the publisher
        pub.publish([])
        pub.publish([])
        frames = [sub.recv_multipart() for _ in range(2)]
        assert [f[:2] for f in frames] == [[b"t", bytes(8)], [b"t", (1).to_bytes(8, "big")]]
        assert DECODE(frames[0][2]).events == []
    finally:
        ctx.destroy(linger=0)


def test_bad_endpoint_is_one_line_and_exit_1(tiny_model_dir, tmp_path):
    def serve(endpoint):
        return subprocess.run(
            [sys.executable, "-m", "api_server.cli", "serve", "--model", tiny_model_dir,
             "--port", str(free_port()), "--num-threads", "1", "--no-speech",
             "--kv-events-endpoint", endpoint], cwd=ROOT, capture_output=True, text=True,
            timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))

    result = serve("localhost:5557")
    assert result.returncode == 1 and "--kv-events-endpoint localhost:5557" in result.stderr
    # Found only once the scheduler opens it: reported by the server, not a traceback.
    result = serve(f"ipc://{tmp_path}/no/such/dir/kv")
    assert result.returncode == 1
    assert "loom: error: --kv-events-endpoint ipc://" in result.stderr, result.stderr
