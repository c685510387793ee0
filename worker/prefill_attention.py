"""Prefill attention (prompt chunks, causal) over the paged KV cache, in place.

Uses the native kernel in `worker/kernels/paged_prefill_attention.c` for float32 queries over a
float32 or bfloat16 cache when it could be built; otherwise `paged_attention` gathers blocks and calls PyTorch's SDPA.
"""

from __future__ import annotations

import ctypes

import torch

from worker.kernels import load_kernel

_lib = load_kernel("paged_prefill_attention")
if _lib is not None:
    _lib.loom_prefill_attention.restype = ctypes.c_int
    _lib.loom_prefill_attention.argtypes = (
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
         ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p])


PREFILL_BLOCK_SIZE = 16  # (the kernel's BS: the KV block size it handles)


def native_prefill_limits(head_dim: int, heads: int, kv_heads: int) -> bool:
    """Whether the native kernel takes these heads over 16-token blocks."""
    return _lib is not None and bool(_lib.loom_prefill_attention_limits(
        PREFILL_BLOCK_SIZE, head_dim, heads, kv_heads))


def native_prefill_available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (_lib is not None and q.dtype == torch.float32
            and k_cache.dtype in (torch.float32, torch.bfloat16)
            and q.stride(2) == 1 and q.stride(1) == q.shape[2]
            and bool(_lib.loom_prefill_attention_limits(k_cache.shape[1], k_cache.shape[3],
                                                        q.shape[1], k_cache.shape[2])))


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D], rows may be strided (a view of the fused qkv output)
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], f32 or bf16, with this step's K/V
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: tokens each sequence attends to (this chunk's last)
    q_lens: torch.Tensor,  # [B] int32: its rows in this step
    first_rows: torch.Tensor,  # [B] int32: its first row in q
    out: torch.Tensor,  # [T, H, D] float32, contiguous: the sequences' rows are written
    scale: float,
    window: int = 0,  # > 0: a query at position p sees keys p - window < k <= p only
) -> None:
    tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    rc = _lib.loom_prefill_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.dtype == torch.bfloat16,
        block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), q_lens.data_ptr(),
        first_rows.data_ptr(), block_tables.shape[0], heads, kv_heads, head_dim, block_size,
        window, scale, out.data_ptr())
    if rc != 0:
        raise MemoryError("prefill attention could not allocate its scratch memory")
