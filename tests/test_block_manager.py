"""The paged KV block manager: allocation, freeing, prefix reuse, eviction."""

import numpy as np

from scheduler.block_manager import BlockManager


def test_allocate_grows_by_blocks_and_free_returns_everything():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 5)
    assert len(bm.block_table("a")) == 2
    assert bm.allocate("a", 8) and len(bm.block_table("a")) == 2
    assert bm.allocate("a", 9) and len(bm.block_table("a")) == 3
    assert bm.num_free_blocks == 5
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_allocation_fails_without_side_effects():
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate("a", 8)
    assert not bm.allocate("b", 8)
    assert bm.block_table("b") == [] and bm.num_free_blocks == 1


def test_prefix_blocks_are_shared_and_survive_their_first_owner():
    bm = BlockManager(num_blocks=10, block_size=4)
    prompt = np.arange(100, 113)  # 13 tokens: 3 full blocks
    assert bm.find_cached_prefix(prompt) == []
    assert bm.allocate("a", 13)
    bm.register_full_blocks("a", prompt, 13)
    cached = bm.find_cached_prefix(prompt)
    assert cached == bm.block_table("a")[:3]
    bm.free("a")
    # Freed but still cached: a new request with the same prefix gets the same blocks.
    cached = bm.find_cached_prefix(np.concatenate([prompt[:12], [7, 8, 9]]))
    assert len(cached) == 3
    assert bm.allocate("b", 15, cached)
    assert bm.block_table("b")[:3] == cached
    # A different prefix shares nothing.
    assert bm.find_cached_prefix(np.arange(500, 513)) == []


def test_whole_prompt_hit_leaves_a_token_to_compute():
    bm = BlockManager(num_blocks=10, block_size=4)
    prompt = np.arange(8)
    bm.allocate("a", 8)
    bm.register_full_blocks("a", prompt, 8)
    assert len(bm.find_cached_prefix(prompt)) == 1  # not 2: the last token must be fed


def test_cached_free_blocks_are_evicted_when_needed():
    bm = BlockManager(num_blocks=4, block_size=4)
    prompt = np.arange(16)
    bm.allocate("a", 16)
    bm.register_full_blocks("a", prompt, 16)
    bm.free("a")
    assert bm.allocate("b", 16)  # takes every block, evicting the cached ones
    assert bm.find_cached_prefix(np.concatenate([prompt, [1]])) == []
    bm.free("b")
    assert bm.num_free_blocks == 4


def test_shared_block_freed_only_when_last_owner_goes():
    bm = BlockManager(num_blocks=6, block_size=4)
    prompt = np.arange(9)
    bm.allocate("a", 9)
    bm.register_full_blocks("a", prompt, 9)
    cached = bm.find_cached_prefix(prompt)
    bm.allocate("b", 9, cached)
    bm.free("a")
    assert all(bm.blocks[b].ref_count == 1 for b in cached)
    bm.free("b")
    assert bm.num_free_blocks == 6


def test_a_block_hits_only_under_the_same_ancestors():
    """The key chains over every earlier block: a block's own tokens after another prefix
    never match (a hit compares whole prefixes, not 16 tokens)."""
    bm = BlockManager(num_blocks=10, block_size=4)
    prompt = np.arange(100, 113)
    bm.allocate("a", 13)
    bm.register_full_blocks("a", prompt, 13)
    moved = np.concatenate([[7, 7, 7, 7], prompt[4:]])  # block 0 differs, blocks 1-2 the same
    assert bm.find_cached_prefix(moved) == []
    swapped = np.concatenate([prompt[4:8], prompt[:4], prompt[8:]])
    assert bm.find_cached_prefix(swapped) == []
    assert len(bm.find_cached_prefix(prompt)) == 3


def test_different_cache_salts_never_share_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    prompt = np.arange(100, 113)
    bm.allocate("a", 13)
    bm.register_full_blocks("a", prompt, 13, cache_salt="tenant-a")
    assert bm.find_cached_prefix(prompt, "tenant-a") == bm.block_table("a")[:3]
    assert bm.find_cached_prefix(prompt, "tenant-b") == []
    assert bm.find_cached_prefix(prompt) == []  # no salt is a salt of its own
    assert bm.find_cached_prefix(prompt, "") == []
    # The second tenant's blocks are its own, beside the first's.
    bm.allocate("b", 13)
    bm.register_full_blocks("b", prompt, 13, cache_salt="tenant-b")
    assert bm.find_cached_prefix(prompt, "tenant-b") == bm.block_table("b")[:3]
    assert set(bm.block_table("a")).isdisjoint(bm.block_table("b"))


def test_block_keys_are_keyed_sha256_not_pythons_hash(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    prompt = np.arange(100, 108)

    def hashes(key):
        bm = BlockManager(num_blocks=4, block_size=4, hash_key=key)
        bm.allocate("a", 8)
        bm.register_full_blocks("a", prompt, 8)
        return bm.block_hashes["a"]

    one, other = hashes(b"k" * 32), hashes(b"K" * 32)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in one)
    assert one == hashes(b"k" * 32) and set(one).isdisjoint(other)
    # A cache under another key finds nothing of these blocks, even for the same tokens.
    bm = BlockManager(num_blocks=4, block_size=4, hash_key=b"k" * 32)
    bm.allocate("a", 8)
    bm.register_full_blocks("a", prompt, 8)
    assert bm.block_hashes["a"] == one
    assert len(bm.find_cached_prefix(np.append(prompt, 1))) == 2
    bm.hash_key = b"K" * 32
    assert bm.find_cached_prefix(np.append(prompt, 1)) == []
    # Two managers made without a key each draw their own.
    assert BlockManager(4, 4).hash_key != BlockManager(4, 4).hash_key
