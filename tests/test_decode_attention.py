"""The native paged decode-attention kernel against PyTorch's SDPA on gathered blocks."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from worker.decode_attention import native_decode_available, paged_decode_attention


def reference(q, k_cache, v_cache, tables, seq_lens, scale, window=0):
    out = []
    for i in range(q.shape[0]):
        n = int(seq_lens[i])
        blocks = tables[i, : -(-n // k_cache.shape[1])].long()
        first = n - window if 0 < window < n else 0  # (a sliding window: the last `window`)
        k = k_cache[blocks].flatten(0, 1)[first:n].float().transpose(0, 1)  # [KVH, n, D]
        v = v_cache[blocks].flatten(0, 1)[first:n].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(q[i].float().unsqueeze(1), k, v, scale=scale,
                                           enable_gqa=True)
        out.append(o.squeeze(1))
    return torch.stack(out)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler: the PyTorch fallback is used")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_seqs", [1, 5])  # 1: fewer sequences than threads, split by head
# a sliding window (Gemma 3's local layers): 1 token; within a block; across blocks and chunks
@pytest.mark.parametrize("window", [0, 1, 10, 150])
def test_native_kernel_matches_sdpa(dtype, tol, num_seqs, window):
    assert native_decode_available(dtype)
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, heads, dim = 80, 16, 3, 9, 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    seq_lens = torch.tensor([1, 17, 200, 64, 33], dtype=torch.int32)
    tables = torch.randperm(num_blocks)[:5 * 13].reshape(5, 13).to(torch.int32)
    q = torch.randn(5, heads, dim).to(dtype)
    q, tables, seq_lens = q[-num_seqs:].contiguous(), tables[-num_seqs:].contiguous(), \
        seq_lens[-num_seqs:].contiguous()
    got = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, window)
    want = reference(q, k_cache, v_cache, tables, seq_lens, 0.125, window)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler: the PyTorch fallback is used")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_one_sequence_equal_each_row_alone(dtype):
    """A speculative verify step's rows (one sequence's last tokens, each a row over the same
    blocks) share one pass over K/V: each row's output must be the very numbers it gets
    alone, or greedy output would change with speculation. Two runs of rows beside a row of
    another sequence, one run crossing a block boundary."""
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, heads, dim = 40, 16, 3, 9, 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    a, b = torch.randperm(num_blocks)[:20].reshape(2, 10).to(torch.int32)
    tables = torch.stack([a] * 6 + [b] + [b] * 4).contiguous()
    seq_lens = torch.tensor([45, 46, 47, 48, 49, 50, 100, 30, 31, 32, 33], dtype=torch.int32)
    q = torch.randn(len(seq_lens), heads, dim)
    together = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)
    for i in range(len(seq_lens)):
        alone = paged_decode_attention(q[i:i + 1].contiguous(), k_cache, v_cache,
                                       tables[i:i + 1].contiguous(), seq_lens[i:i + 1], 0.125)
        assert torch.equal(together[i], alone[0]), i
    want = reference(q, k_cache, v_cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(together, want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler: the PyTorch fallback is used")
def test_one_sequence_split_over_threads_equals_one_thread():
    """One user's attention is split by chunks of positions over the threads (flash-decoding):
    its numbers must be those of one thread, and of its row among others, over contexts of
    many chunks, ending inside and at the end of a chunk and of a block."""
    from worker.decode_attention import set_kernel_threads

    torch.manual_seed(1)
    num_blocks, block_size, kv_heads, heads, dim = 200, 16, 3, 9, 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    seq_lens = torch.tensor([700, 64, 129, 1], dtype=torch.int32)
    tables = torch.randperm(num_blocks)[:4 * 44].reshape(4, 44).to(torch.int32)
    q = torch.randn(len(seq_lens), heads, dim)
    rows = [(q[i:i + 1].contiguous(), tables[i:i + 1].contiguous(), seq_lens[i:i + 1])
            for i in range(len(seq_lens))]
    try:
        set_kernel_threads(1)
        one = [paged_decode_attention(*r[:1], k_cache, v_cache, *r[1:], 0.125) for r in rows]
        set_kernel_threads(2)
        two = [paged_decode_attention(*r[:1], k_cache, v_cache, *r[1:], 0.125) for r in rows]
        together = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)
    finally:
        set_kernel_threads(torch.get_num_threads())
    for i in range(len(seq_lens)):
        assert torch.equal(one[i], two[i]), i
        assert torch.equal(one[i][0], together[i]), i
    want = reference(q, k_cache, v_cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(together, want, atol=1e-5, rtol=1e-5)
