"""Prefix-cache block keys: SHA-256 chained block by block, keyed per process (vLLM's scheme
since CVE-2025-25183, where Python's unkeyed, invertible `hash()` let crafted prompts collide).

A block's hash covers its parent's hash, so a hit means the whole prefix matches, not only the
block's own tokens. The chain starts at a root derived from the key and the request's
`cache_salt`: requests with different salts (tenants) never share a block, and without the key
nobody can precompute a block's hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Iterator

import numpy as np

BlockHash = bytes  # a SHA-256 digest


def new_hash_key() -> bytes:
    """A random key per process; with PYTHONHASHSEED set (as vLLM reads it), one derived from
    it, so that replicas started alike name a prefix by the same hashes (for KV-aware routers
    that compare the hashes of several replicas)."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None or seed == "random":
        return secrets.token_bytes(32)
    return hashlib.sha256(b"loom prefix cache key " + seed.encode()).digest()


def root_hash(key: bytes, cache_salt: str | tuple | None) -> BlockHash:
    """The parent of a prompt's first block: the salt enters the chain here, so it changes the
    hash of every block after it. No salt and an empty salt differ by the tag byte. A tuple
    is a LoRA request's salt (`TextContext.prefix_salt`: the salt, the adapter's name and
    path), its own tag byte and JSON keeping it apart from every plain salt."""
    if cache_salt is None:
        return hashlib.sha256(key + b"\x00").digest()
    if isinstance(cache_salt, tuple):
        return hashlib.sha256(key + b"\x02" + json.dumps(cache_salt).encode()).digest()
    return hashlib.sha256(key + b"\x01" + cache_salt.encode("utf-8", "surrogatepass")).digest()


def hash_blocks(key: bytes, parent: BlockHash, tokens: np.ndarray, block_size: int,
                ) -> Iterator[BlockHash]:
    """The hashes of the blocks of `tokens` (a whole number of blocks), chained on `parent`,
    one at a time: a lookup that misses stops hashing there. Each input is the key, the parent
    digest, then the block's tokens as little-endian int64: fixed lengths, so no two different
    (parent, tokens) give the same bytes. A vision context's images are keyed by their pixels
    as negative token values in `tokens` (pipelines/vision_context.py)."""
    data = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    step = block_size * 8
    for start in range(0, len(data), step):
        parent = hashlib.sha256(key + parent + data[start : start + step]).digest()
        yield parent

