"""KV cache events: which prefix blocks this replica holds, published for KV-aware routers
(llm-d's KV cache indexer, NVIDIA Dynamo, ...) in vLLM's format, so that a consumer written for
vLLM reads Loom unchanged.

Each scheduler step's events travel as one `KVEventBatch` (msgpack of msgspec's array-like
tagged structs, field for field vLLM's `vllm.distributed.kv_events`) in a ZeroMQ multipart
message [topic, sequence number (8 bytes, big-endian, from 0), payload] on a PUB socket.
"""

from __future__ import annotations

import time

import msgspec
import zmq

# The tier the blocks live in. vLLM names its primary KV cache "GPU" on every device (its CPU
# build too); consumers treat any other name as an offload tier.
MEDIUM = "GPU"
# The PUB socket keeps this many batches for a subscriber that is slow or not yet connected,
# then drops (a PUB never blocks the scheduler): a few seconds of steps.
SEND_HIGH_WATER_MARK = 10_000


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to the prefix cache."""


class BlockStored(KVCacheEvent):
    """Full blocks that entered the prefix cache: a run of consecutive blocks of one request,
    `parent_block_hash` the hash of the block before the run (None at the prompt's start)."""

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


def external_hash(block_hash: bytes) -> int:
    """A block's hash as an unsigned 64-bit integer, as vLLM publishes its hashes by default
    (the SHA-256 digest's first 8 bytes, big-endian; some consumers decode the field as
    uint64)."""
    return int.from_bytes(block_hash[:8], "big")


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address or an ipc path is bound; tcp://HOST:PORT connects to a
    subscriber that binds (llm-d's indexer gathers every replica's events that way)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, zctx: zmq.Context, endpoint: str, topic: str = "") -> None:
        self.socket = zctx.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            (self.socket.bind if binds(endpoint) else self.socket.connect)(endpoint)
        except zmq.ZMQError:
            self.socket.close()
            raise
        self.topic = topic.encode()
        self.seq = 0
        self.encode = msgspec.msgpack.Encoder().encode

    def publish(self, events: list[KVCacheEvent]) -> None:
        payload = self.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        self.socket.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1
