"""The native paged prefill-attention kernel against PyTorch's SDPA on gathered keys."""

import pytest
import torch
import torch.nn.functional as F

from worker.prefill_attention import native_prefill_available, paged_prefill_attention


def reference(q, k_cache, v_cache, tables, seq_lens, q_lens, first_rows, scale, window=0):
    out = torch.zeros(q.shape)
    block = k_cache.shape[1]
    for s in range(len(seq_lens)):
        n, m, r = int(seq_lens[s]), int(q_lens[s]), int(first_rows[s])
        blocks = tables[s, : -(-n // block)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)  # [KVH, n, D]
        v = v_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)
        queries = q[r: r + m].transpose(0, 1)  # [H, m, D]
        positions = torch.arange(n - m, n)
        mask = torch.arange(n)[None, :] <= positions[:, None]  # causal, offset by the cache
        if window:  # a sliding window: keys p - window < k <= p (Hugging Face's mask)
            mask &= torch.arange(n)[None, :] > positions[:, None] - window
        o = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        out[r: r + m] = o.transpose(0, 1)
    return out


def test_other_block_sizes_take_the_pytorch_path():
    assert not native_prefill_available(torch.zeros(2, 9, 64), torch.zeros(8, 4, 3, 64))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16])
# a sliding window (Gemma 3's local layers): 1 token; inside a block; a tile's rows reaching
# back into different blocks; wider than every sequence
@pytest.mark.parametrize("window", [0, 1, 7, 40, 512])
def test_native_kernel_matches_sdpa(block_size, cache_dtype, window):
    torch.manual_seed(block_size)
    heads, kv_heads, dim, num_blocks = 9, 3, 64, 400
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(cache_dtype)
    # A fresh prompt, a later chunk of a long one, a one-row chunk, a chunk crossing blocks.
    seq_lens = torch.tensor([37, 300, 90, 17], dtype=torch.int32)
    q_lens = torch.tensor([37, 50, 1, 16], dtype=torch.int32)
    first_rows = torch.cumsum(q_lens, 0, dtype=torch.int32) - q_lens
    width = -(-300 // block_size)
    tables = torch.randperm(num_blocks)[: 4 * width].reshape(4, width).to(torch.int32)
    rows = int(q_lens.sum())
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)  # q as a strided view, as served
    q = qkv[:, : heads * dim].view(rows, heads, dim)
    assert native_prefill_available(q, k_cache)
    out = torch.full((rows, heads, dim), float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, q_lens, first_rows, out,
                            dim ** -0.5, window)
    # (a bfloat16 cache is read widened: the reference attends to the same values in float32)
    want = reference(q, k_cache.float(), v_cache.float(), tables, seq_lens, q_lens, first_rows,
                     dim ** -0.5, window)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_with_prefix_hits_matches_transformers(smollm2_dir, tmp_path):
    # Block size 16 (the kernel's): prompts cut into 7-token chunks attend to their earlier
    # chunks and to prefix-cache blocks through the kernel; greedy output must equal HF's.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.config import PipelineConfig
    from tests.helpers import hf_greedy, make_tiny_checkpoint
    from tests.test_model_oracle import NEW_TOKENS, PROMPTS, run_engine
    from worker.model_runner import ModelRunner

    path = make_tiny_checkpoint(str(tmp_path), smollm2_dir, architecture="qwen2", seed=5)
    runner = ModelRunner(PipelineConfig.for_model(path, kv_cache_page_size=16,
                                                  kv_cache_memory=8 << 20))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    shared = "A long shared system preamble that many requests start with. " * 4
    ids = [tok.encode(shared + p) for p in PROMPTS]
    ours, sched = run_engine(runner, ids, budget=7, block_size=16)
    assert sched.blocks.prefix_hits > 0
    for p, got in zip(ids, ours):
        assert got == hf_greedy(hf, tok, p, NEW_TOKENS)
