"""Sizing and allocating the paged KV cache from the memory it is given."""

from __future__ import annotations

import ctypes
import logging
import mmap
import time

import torch

from pipelines.checkpoint.model_config import ModelConfig
from processes.host_memory import available_memory_bytes
from worker import hugepages

logger = logging.getLogger(__name__)

GiB = 1 << 30
# Without --kv-cache-memory: this share of the RAM still available after the weights,
# capped, and never more than max_num_seqs full-length sequences need.
DEFAULT_KV_FRACTION = 0.4
DEFAULT_KV_CAP_BYTES = 4 * GiB





def bytes_per_block(config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    return config.kv_bytes_per_token * block_size * torch.tensor([], dtype=dtype).element_size()


def estimate_kv_cache_size(
    config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    kv_cache_memory: int | None,
) -> int:
    """Number of KV blocks to allocate."""
    per_block = bytes_per_block(config, dtype, block_size)
    if kv_cache_memory is None:
        budget = min(int(available_memory_bytes() * DEFAULT_KV_FRACTION), DEFAULT_KV_CAP_BYTES)
        wanted_blocks = max_num_seqs * -(-max_model_len // block_size)
        budget = min(budget, wanted_blocks * per_block)
    else:
        budget = kv_cache_memory
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise MemoryError(
            f"KV cache memory {budget} bytes is less than one block ({per_block} bytes)"
        )
    return num_blocks


def allocate_kv_cache(
    config: ModelConfig, dtype: torch.dtype, num_blocks: int, block_size: int,
    device: torch.device = torch.device("cpu"),
) -> torch.Tensor:
    """[layers, 2 (K and V), num_blocks, block_size, kv_heads, head_dim], zeroed.

    Zeroed, not empty: attention reads whole blocks and masks the unused slots, and a masked
    slot holding a NaN bit pattern would still poison the weighted sum (0 * NaN = NaN).
    The memory is an anonymous mmap, which the kernel zero-fills page by page on first touch:
    torch.zeros would write every page up front (seconds for gigabytes) and start-up would wait.
    The worker faults them in while idle (KVCachePrefault). Not huge pages: touching a fresh
    2 MiB page costs a compaction and a 2 MiB zeroing, which made a new request's first prefill
    ~40% slower, and decode steps gained nothing measurable.
    """
    shape = (
        config.num_hidden_layers, 2, num_blocks, block_size,
        config.num_key_value_heads, config.head_dim,
    )
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return hugepages.empty_tensor(shape, dtype, huge=False)


class KVCachePrefault:
    """Faults the KV cache's pages in, a few blocks at a time, while the worker is idle.

    The cache is mapped lazily (start-up would otherwise wait ~1 s per GiB), so a request whose
    blocks were never used paid for their page faults inside its prefill: ~4 ms for a 256-token
    prompt of SmolLM2-135M. The worker runs it briefly before it reports ready, then calls
    `step()` once it has been idle for a while; each call covers `blocks_per_call` blocks of
    one layer's K or V (~0.1 ms, what a step arriving meanwhile waits; all layers at once took
    1-4 ms), lowest block ids first, the order the block manager hands fresh blocks out.
    MADV_POPULATE_WRITE maps pages without writing them.
    (A background thread did this too, and its page-table lock made the first steps ~50% slower.)
    """

    MADV_POPULATE_WRITE = 23  # Linux 5.14

    def __init__(self, cache: torch.Tensor, blocks_per_call: int = 8) -> None:
        self.cache = cache
        self.blocks_per_call = blocks_per_call
        self.num_blocks = cache.shape[2]
        self.block_bytes = cache[0, 0, 0].numel() * cache.element_size()
        # [layer, K/V] regions, each [num_blocks, ...] and contiguous
        self.regions = [region for layer in cache for region in layer]
        self.next_block = 0
        self.next_region = 0
        self._madvise = _libc_function("madvise")
        self._page = mmap.PAGESIZE

    @property
    def done(self) -> bool:
        return self._madvise is None or self.next_block >= self.num_blocks

    def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.done and time.monotonic() < deadline:
            self.step()

    def step(self) -> None:
        first = self.next_block
        last = min(first + self.blocks_per_call, self.num_blocks)
        start = self.regions[self.next_region].data_ptr() + first * self.block_bytes
        aligned = start - start % self._page
        length = (last - first) * self.block_bytes + (start - aligned)
        if self._madvise(aligned, length, self.MADV_POPULATE_WRITE) != 0:
            self._madvise = None  # an older kernel: pages fault in on first use
            return
        self.next_region += 1
        if self.next_region == len(self.regions):
            self.next_region, self.next_block = 0, last


def _libc_function(name: str):
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn
