"""The KV cache's lazy pages and the idle-time prefault that maps them in."""

import ctypes
import mmap

import numpy as np
import pytest
import torch

from worker import hugepages
from worker.kv_cache import KVCachePrefault

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 40, 16, 2, 64  # 8 KiB per block and region


def resident_pages(tensor: torch.Tensor) -> np.ndarray:
    """mincore(2): which of the tensor's pages are mapped in."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    assert start % page == 0
    length = tensor.numel() * tensor.element_size()
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
    return np.frombuffer(vec, dtype=np.uint8) & 1


@pytest.fixture
def cache():
    shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return hugepages.empty_tensor(shape, torch.float32, huge=False)


def region_pages(cache: torch.Tensor, layer: int, kv: int, first: int, last: int) -> np.ndarray:
    pages = resident_pages(cache[layer, kv])
    per_block = len(pages) // BLOCKS
    return pages[first * per_block:last * per_block]


def test_fresh_cache_is_not_resident(cache):
    assert resident_pages(cache).sum() == 0


def test_each_step_maps_one_region_of_a_few_blocks_lowest_first(cache):
    # A step arriving while the worker prefaults waits for one call: it must stay small.
    prefault = KVCachePrefault(cache, blocks_per_call=8)
    prefault.step()
    assert region_pages(cache, 0, 0, 0, 8).all()
    assert not region_pages(cache, 0, 0, 8, BLOCKS).any()
    assert not region_pages(cache, 0, 1, 0, BLOCKS).any()
    for _ in range(2 * LAYERS - 1):  # the same blocks in every layer's K and V
        prefault.step()
    for layer in range(LAYERS):
        for kv in range(2):
            assert region_pages(cache, layer, kv, 0, 8).all()
            assert not region_pages(cache, layer, kv, 8, BLOCKS).any()


def test_runs_to_the_end_and_leaves_zeros(cache):
    prefault = KVCachePrefault(cache, blocks_per_call=7)  # BLOCKS is no multiple of it
    steps = 0
    while not prefault.done:
        prefault.step()
        steps += 1
    assert steps == 2 * LAYERS * -(-BLOCKS // 7)
    assert resident_pages(cache).all()
    assert not cache.any()  # attention masks unused slots by weight, so they must stay 0
