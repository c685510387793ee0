"""The GPU's paged attention kernels (worker/triton_attention.py), run on the CPU by Triton's
interpreter, against attention computed directly from each sequence's keys and values: decode
over block tables, and prefill chunks over a cached prefix (causal), with GQA groups that are
not powers of two, head sizes that are not either, and scattered blocks."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # (read when the kernels are defined: before the import)

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed (the test extra has it)")
from worker import triton_attention  # noqa: E402


def make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return (torch.randn(shape, generator=gen).to(dtype),
            torch.randn(shape, generator=gen).to(dtype))


def scattered_tables(seq_lens, block_size, num_blocks, seed=1):
    """Each sequence's blocks, drawn without repetition from the whole cache (padding -1)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = order[used:used + n]
        used += n
    return tables


def reference(q_rows, k_cache, v_cache, table, seq_len, scale):
    """Attention of q_rows [n, H, D] (the sequence's last n positions) over its first
    `seq_len` keys, causal, in float64."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    heads = q_rows.shape[1]
    blocks = table[: -(-seq_len // block_size)].long()
    k = k_cache[blocks].reshape(-1, kv_heads, k_cache.shape[3])[:seq_len].double()
    v = v_cache[blocks].reshape(-1, kv_heads, v_cache.shape[3])[:seq_len].double()
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    n = q_rows.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q_rows.double(), k) * scale
    q_pos = torch.arange(seq_len - n, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),  # SmolLM2's shape: groups of 3
    (4, 4, 24, 8),  # no GQA, a head size that is not a power of two, small blocks
    (8, 2, 16, 32),
])
def test_decode_over_block_tables(heads, kv_heads, head_dim, block_size):
    seq_lens = [1, 5, block_size, block_size + 1, 3 * block_size + 7]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 5
    k_cache, v_cache = make_cache(num_blocks, block_size, kv_heads, head_dim, torch.float32)
    tables = scattered_tables(seq_lens, block_size, num_blocks)
    q = torch.randn(len(seq_lens), heads, head_dim)
    scale = head_dim ** -0.5
    out = triton_attention.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), scale)
    for i, n in enumerate(seq_lens):
        want = reference(q[i:i + 1], k_cache, v_cache, tables[i], n, scale)[0]
        torch.testing.assert_close(out[i].double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (6, 3, 20)])
def test_prefill_chunks_over_a_cached_prefix(heads, kv_heads, head_dim):
    """Three sequences in one step: a fresh prompt, a chunk after a cached prefix that ends
    mid-block, and a chunk longer than one tile of query rows; rows packed back to back."""
    block_size = 16
    prefixes, chunks = [0, 21, 40], [7, 12, 37]
    seq_lens = [p + c for p, c in zip(prefixes, chunks)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    k_cache, v_cache = make_cache(num_blocks, block_size, kv_heads, head_dim, torch.float32)
    tables = scattered_tables(seq_lens, block_size, num_blocks)
    total = sum(chunks)
    q = torch.randn(total, heads, head_dim)
    first_rows = torch.tensor([0, chunks[0], chunks[0] + chunks[1]], dtype=torch.int32)
    out = torch.full((total, heads, head_dim), float("nan"))
    scale = 0.125
    triton_attention.paged_prefill_attention(
        q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(chunks, dtype=torch.int32), first_rows, out, scale, max(chunks))
    for i, (n, c) in enumerate(zip(seq_lens, chunks)):
        rows = slice(int(first_rows[i]), int(first_rows[i]) + c)
        want = reference(q[rows], k_cache, v_cache, tables[i], n, scale)
        torch.testing.assert_close(out[rows].double(), want, rtol=1e-4, atol=1e-5)


def test_prefill_reads_strided_query_rows():
    """q as a view of a fused qkv output (rows wider than the heads), as the models pass it."""
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 16
    k_cache, v_cache = make_cache(4, block_size, kv_heads, head_dim, torch.float32)
    tables = torch.tensor([[2, 0]], dtype=torch.int32)
    qkv = torch.randn(20, heads * head_dim + 2 * kv_heads * head_dim)
    q = qkv[:, : heads * head_dim].view(20, heads, head_dim)
    out = torch.empty(20, heads, head_dim)
    one = torch.tensor([20], dtype=torch.int32)
    triton_attention.paged_prefill_attention(q, k_cache, v_cache, tables, one, one,
                                             torch.tensor([0], dtype=torch.int32), out, 0.25,
                                             20)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, tables[0], 20, 0.25),
                               rtol=1e-4, atol=1e-5)


def test_a_mixed_step_through_the_gpu_dispatch_equals_the_cpu_path():
    """The glue `paged_attention` uses on a GPU (`_gpu_kernels` with the step's metadata):
    two decodes and two prefill chunks (one after a cached prefix) in one step give what the
    CPU path gives for the same step."""
    import numpy as np

    from worker.attention import _gpu_kernels, build_attention_metadata, paged_attention

    heads, kv_heads, head_dim, block_size = 6, 2, 32, 16
    query_lens = np.array([1, 9, 1, 30])
    seq_lens = np.array([17, 9, 40, 50])
    num_blocks = 16
    k_cache, v_cache = make_cache(num_blocks, block_size, kv_heads, head_dim, torch.float32)
    tables = scattered_tables(seq_lens.tolist(), block_size, num_blocks).numpy()
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    tokens = int(query_lens.sum())
    q = torch.randn(tokens, heads, head_dim)
    k = torch.randn(tokens, kv_heads, head_dim)
    v = torch.randn(tokens, kv_heads, head_dim)
    flat_k = k_cache.view(-1, kv_heads, head_dim)
    flat_v = v_cache.view(-1, kv_heads, head_dim)
    flat_k[meta.slot_mapping], flat_v[meta.slot_mapping] = k, v  # (store_kv's work)
    want = paged_attention(q, k, v, k_cache, v_cache, meta, 0.2)
    got = torch.full_like(want, float("nan"))
    for group in meta.groups:
        assert _gpu_kernels(group, q, k_cache, v_cache, got, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
