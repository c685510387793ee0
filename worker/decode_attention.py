"""Decode attention (one query token per sequence) over the paged KV cache, in place.

Uses the native kernel in `worker/kernels/paged_decode_attention.c` when it could be built;
otherwise `paged_attention` falls back to gathering blocks and calling PyTorch's SDPA.
"""

from __future__ import annotations

import ctypes

import torch

from worker.kernels import load_kernel

_lib = load_kernel("paged_decode_attention")
_FUNCS = {}
if _lib is not None:
    _FUNCS = {torch.float32: _lib.paged_decode_attention_f32,
              torch.bfloat16: _lib.paged_decode_attention_bf16}
    for fn in _FUNCS.values():
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 7 + [ctypes.c_float]


def native_decode_available(cache_dtype: torch.dtype) -> bool:
    return cache_dtype in _FUNCS


def set_kernel_threads(n: int) -> None:
    if _lib is not None:
        _lib.loom_set_num_threads(n)


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D] (read as float32)
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, contiguous
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    window: int = 0,  # > 0: each row attends to its last `window` tokens only
) -> torch.Tensor:
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    q = q.to(torch.float32).contiguous()
    out = torch.empty((batch, heads, head_dim), dtype=torch.float32)
    rc = _FUNCS[k_cache.dtype](
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(), batch, heads, kv_heads, head_dim, block_size,
        block_tables.shape[1], window, scale,
    )
    if rc != 0:
        raise MemoryError("decode attention could not allocate its scratch memory")
    return out
