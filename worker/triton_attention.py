"""Attention over the paged KV cache on a GPU, in Triton (the CPU has its C kernels).

Same contracts as the CPU kernels (`worker/decode_attention.py`, `worker/prefill_attention.py`),
so `paged_attention` picks by device:
- decode: one program per (sequence, key/value head) reads that head's blocks once through the
  block table and attends all the query heads of its group (GQA) with an online softmax, the
  group's heads as the rows of tensor-core matrix products;
- prefill chunks over a cached prefix: one program per (sequence, query head, tile of query
  rows) walks the blocks up to the tile's last position, causal (a query at position p sees
  keys 0..p), flash-attention style. The chunk's own K/V are already in the cache (store_kv).
Any head_dim and group size (masked up to powers of two); the prefill needs blocks of at least
16 tokens (Triton's dot products), else the PyTorch path runs.

Tested on the CPU through Triton's interpreter (TRITON_INTERPRET=1): tests/test_triton_attention.py.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # (a CPU-only install: the GPU path is never taken there)
    triton = None

PREFILL_TILE = 16  # query rows per program
DECODE_KEYS = 64  # keys per iteration of a decode program


def available(k_cache: torch.Tensor, prefill: bool) -> bool:
    """Whether the kernels run for this cache (on a GPU; Triton ships with PyTorch's CUDA
    wheels)."""
    return triton is not None and (not prefill or k_cache.shape[1] >= 16)


if triton is not None:

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                       stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot,
                       stride_oh, stride_tb, group, head_dim,
                       BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                       KEYS: tl.constexpr, IEEE: tl.constexpr):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        heads = kv_head * group + tl.arange(0, BLOCK_G)
        g_ok = tl.arange(0, BLOCK_G) < group
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        seq_len = tl.load(lens_ptr + seq)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        # KEYS keys (several blocks) per iteration: fewer dependent table -> K/V round trips,
        # which bound a short batch's step (8 programs per layer at batch 1 on a 1B model).
        s = tl.arange(0, KEYS)
        for j in range(0, tl.cdiv(seq_len, KEYS)):
            key_pos = j * KEYS + s
            s_ok = key_pos < seq_len
            block = tl.load(tables_ptr + seq * stride_tb + key_pos // BLOCK_SIZE, mask=s_ok,
                            other=0).to(tl.int64)
            offs = (block[:, None] * stride_kb + (key_pos % BLOCK_SIZE)[:, None] * stride_ks
                    + kv_head * stride_kh + d[None, :])
            kv_mask = s_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
            # The group's query heads as the rows of a matrix product (padded to 16, the
            # tensor cores' least): one dot per KEYS keys instead of a broadcast-and-sum.
            if IEEE:  # (float32 as float32: TF32's products would change a float32 model)
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [G, KEYS]
            scores = tl.where(s_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m = m_new
        out = acc / denom[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, qlens_ptr, first_ptr,
                        out_ptr, scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                        stride_ot, stride_oh, stride_tb, group, head_dim,
                        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_D: tl.constexpr,
                        IEEE: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        tile = tl.program_id(2)
        q_len = tl.load(qlens_ptr + seq)
        if tile * TILE >= q_len:
            return
        seq_len = tl.load(lens_ptr + seq)
        first = tl.load(first_ptr + seq)
        kv_head = head // group
        r = tile * TILE + tl.arange(0, TILE)  # rows of this sequence's chunk
        r_ok = r < q_len
        q_pos = seq_len - q_len + r  # their positions
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        rows = (first + r).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        m = tl.full([TILE], float("-inf"), tl.float32)
        denom = tl.zeros([TILE], tl.float32)
        acc = tl.zeros([TILE, BLOCK_D], tl.float32)
        s = tl.arange(0, BLOCK_SIZE)
        last = tl.minimum(seq_len - q_len + (tile + 1) * TILE, seq_len)  # keys < last
        for j in range(0, tl.cdiv(last, BLOCK_SIZE)):
            block = tl.load(tables_ptr + seq * stride_tb + j).to(tl.int64)
            key_pos = j * BLOCK_SIZE + s
            offs = block * stride_kb + s[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            kv_mask = (key_pos < seq_len)[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
            # (float32 as float32: TF32's 10-bit products would change a float32 model's tokens)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [TILE, BLOCK_SIZE]
            # Padded rows see key 0 only, so their softmax stays finite; they are not stored.
            visible = (key_pos[None, :] <= q_pos[:, None]) & (key_pos < seq_len)[None, :]
            visible = visible | (~r_ok[:, None] & (key_pos == 0)[None, :])
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m = m_new
        out = acc / denom[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q [B, H, D] (one query each) over the cache [num_blocks, block_size, KVH, D]; returns
    [B, H, D] in q's dtype."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    q = q if q.stride(2) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _decode_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0), group, head_dim,
        BLOCK_SIZE=block_size, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        KEYS=max(block_size, DECODE_KEYS), IEEE=q.dtype == torch.float32)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            q_lens: torch.Tensor, first_rows: torch.Tensor, out: torch.Tensor,
                            scale: float, max_q: int) -> None:
    """The prefill chunks' rows of out [T, H, D] (the CPU kernel's contract); `max_q`: the
    longest chunk (known on the host: no device sync)."""
    _, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    q = q if q.stride(2) == 1 else q.contiguous()
    tiles = triton.cdiv(max_q, PREFILL_TILE)
    _prefill_kernel[(len(seq_lens), heads, tiles)](
        q, k_cache, v_cache, block_tables, seq_lens, q_lens, first_rows, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0), heads // kv_heads, head_dim,
        BLOCK_SIZE=block_size, TILE=PREFILL_TILE,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), IEEE=q.dtype == torch.float32)
