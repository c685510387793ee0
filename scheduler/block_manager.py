"""The paged KV cache's bookkeeping: fixed-size blocks, per-request block tables, and a
prefix cache of full blocks keyed by a keyed SHA-256 chained over the tokens and the request's
`cache_salt` (vLLM's scheme; scheduler/block_hash.py).

A block whose last reference goes away returns to the free queue but keeps its hash: until it is
handed out again (least recently freed first), a later request with the same prefix reuses it.

With `record_kv_events`, blocks entering and leaving the cache are recorded as vLLM's KV cache
events (scheduler/kv_events.py) for the scheduler process to publish once per step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import groupby

import numpy as np

from scheduler.block_hash import BlockHash, hash_blocks, new_hash_key, root_hash
from scheduler.kv_events import MEDIUM, BlockRemoved, BlockStored, KVCacheEvent, external_hash


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Covers every token before the block's end (a chain), so equal hashes are equal prefixes:
    # no token comparison needed.
    hash: BlockHash | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_kv_events: bool = False, hash_key: bytes | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_key = hash_key or new_hash_key()
        self.cached: dict[BlockHash, int] = {}  # hash -> block id
        self.tables: dict[str, list[int]] = {}
        self.hashed_blocks: dict[str, int] = {}  # how many leading blocks of a request are hashed
        self.block_hashes: dict[str, list[BlockHash]] = {}
        # Counters for metrics.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Cache changes since the last take_kv_events(); None: not recorded (no cost).
        self.kv_events: list[KVCacheEvent] | None = [] if record_kv_events else None

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    # ---- prefix cache -----------------------------------------------------------------------
    def find_cached_prefix(self, tokens: np.ndarray, cache_salt: str | None = None) -> list[int]:
        """Blocks that already hold a prefix of `tokens` under the same `cache_salt`.

        At least one token is always left to compute, so the step has logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        size = self.block_size
        full_blocks = (len(tokens) - 1) // size
        self.prefix_queries += len(tokens)
        found: list[int] = []
        for h in hash_blocks(self.hash_key, root_hash(self.hash_key, cache_salt),
                             tokens[: full_blocks * size], size):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            found.append(block_id)
        self.prefix_hits += len(found) * size
        return found

    def register_full_blocks(self, request_id: str, tokens: np.ndarray, num_computed: int,
                             cache_salt: str | None = None, lora_id: int | None = None) -> None:
        """Offer the request's blocks that are now full of computed tokens to the prefix cache.
        Each block is hashed once, chained on the request's previous block (or, for the first,
        on the root of its `cache_salt`). `lora_id`: the request's adapter, for the events."""
        if not self.enable_prefix_caching:
            return
        table = self.tables[request_id]
        hashes = self.block_hashes.setdefault(request_id, [])
        done = self.hashed_blocks.get(request_id, 0)
        full = min(num_computed // self.block_size, len(table))
        if full <= done:
            return
        size = self.block_size
        parent = hashes[done - 1] if done else root_hash(self.hash_key, cache_salt)
        stored: list[int] = []
        new = hash_blocks(self.hash_key, parent, tokens[done * size : full * size], size)
        for i, h in enumerate(new, start=done):
            hashes.append(h)
            block = self.blocks[table[i]]
            if block.hash is None and h not in self.cached:
                block.hash = h
                self.cached[h] = block.block_id
                stored.append(i)
        self.hashed_blocks[request_id] = full
        if stored and self.kv_events is not None:
            self._record_stored(hashes, tokens, stored, lora_id)

    def _record_stored(self, hashes: list[BlockHash], tokens: np.ndarray, stored: list[int],
                       lora_id: int | None) -> None:
        """One BlockStored per run of consecutive blocks (a block whose hash another block
        already holds is not stored again, and splits the run)."""
        size = self.block_size
        for _, run in groupby(enumerate(stored), lambda pair: pair[1] - pair[0]):
            indices = [i for _, i in run]
            first, end = indices[0], indices[-1] + 1
            self.kv_events.append(BlockStored(
                block_hashes=[external_hash(hashes[i]) for i in indices],
                parent_block_hash=external_hash(hashes[first - 1]) if first else None,
                token_ids=tokens[first * size : end * size].tolist(),
                block_size=size, lora_id=lora_id, medium=MEDIUM))

    def take_kv_events(self) -> list[KVCacheEvent]:
        events, self.kv_events = self.kv_events, []
        return events

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, cached_prefix: list[int] = ()) -> bool:
        """Make the request's table cover `num_tokens` tokens; False (no change) if it can't."""
        table = self.tables.get(request_id)
        if table is None:
            # Reusing a cached block that sits in the free queue takes it out of the queue.
            reclaimed = sum(1 for b in cached_prefix if self.blocks[b].ref_count == 0)
            needed = max(0, -(-num_tokens // self.block_size) - len(cached_prefix))
            if needed + reclaimed > len(self.free_queue):
                return False
            table = self.tables[request_id] = []
            for block_id in cached_prefix:
                self._take(block_id)
                table.append(block_id)
            if cached_prefix:
                self.hashed_blocks[request_id] = len(cached_prefix)
                self.block_hashes[request_id] = [self.blocks[b].hash for b in cached_prefix]
        else:
            needed = max(0, -(-num_tokens // self.block_size) - len(table))
            if needed > len(self.free_queue):
                return False
        for _ in range(needed):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.blocks[block_id].ref_count = 1
            table.append(block_id)
        return True

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Free the request's blocks past those `num_tokens` tokens need (speculative
        decoding's rejected proposals took them; never hashed: they were not verified)."""
        table = self.tables.get(request_id)
        keep = -(-num_tokens // self.block_size)
        if not table or len(table) <= keep:
            return
        for block_id in reversed(table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        del table[keep:]
        self.hashed_blocks[request_id] = min(self.hashed_blocks.get(request_id, 0), keep)
        del self.block_hashes.get(request_id, [])[keep:]

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        self.hashed_blocks.pop(request_id, None)
        self.block_hashes.pop(request_id, None)
        if not table:
            return
        # Tail blocks first, so the queue hands them out before the shared prefix blocks.
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                if self.kv_events is not None:
                    self.kv_events.append(BlockRemoved(
                        block_hashes=[external_hash(block.hash)], medium=MEDIUM))
            block.hash = None
