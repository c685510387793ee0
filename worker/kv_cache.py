"""Sizing and allocating the paged KV cache from the memory it is given."""

from __future__ import annotations

import ctypes
import logging
import torch

from worker import hugepages
from worker.kernels import load_kernel
from worker.model_config import ModelConfig

logger = logging.getLogger(__name__)

GiB = 1 << 30
# Without --kv-cache-memory: this share of the RAM still available after the weights,
# capped, and never more than max_num_seqs full-length sequences need.
DEFAULT_KV_FRACTION = 0.4
DEFAULT_KV_CAP_BYTES = 4 * GiB


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the kernel can hand out without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


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
    config: ModelConfig, dtype: torch.dtype, num_blocks: int, block_size: int
) -> torch.Tensor:
    """[layers, 2 (K and V), num_blocks, block_size, kv_heads, head_dim], zeroed.

    Zeroed, not empty: attention reads whole blocks and masks the unused slots, and a masked
    slot holding a NaN bit pattern would still poison the weighted sum (0 * NaN = NaN).
    The memory is an anonymous mmap, which the kernel zero-fills page by page on first touch:
    torch.zeros would write every page up front (7.5 s for 4 GiB here) and start-up would wait.
    A background thread faults the pages in instead, on cores nothing else wants. Not huge pages: touching a fresh 2 MiB page costs a compaction and a 2 MiB zeroing, which
    made a new request's first prefill ~40% slower, and decode steps gained nothing measurable.
    """
    shape = (
        config.num_hidden_layers, 2, num_blocks, block_size,
        config.num_key_value_heads, config.head_dim,
    )
    cache = hugepages.empty_tensor(shape, dtype, huge=False)
    prefault_in_background(cache)
    return cache


def prefault_in_background(tensor: torch.Tensor) -> None:
    """Fault the tensor's pages in from an idle-priority native thread (see
    worker/kernels/prefault.c), so requests landing on fresh blocks do not pay for it."""
    lib = load_kernel("prefault")
    if lib is None:
        return
    lib.loom_prefault_async.restype = ctypes.c_int
    lib.loom_prefault_async.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    if lib.loom_prefault_async(tensor.data_ptr(), tensor.numel() * tensor.element_size()) != 0:
        logger.warning("could not start the KV cache prefault thread")
