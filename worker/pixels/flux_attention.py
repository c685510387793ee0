"""FLUX's joint attention, native where it can be (`worker/kernels/flux_attention.c`):
float32 on a CPU with AVX-512, head_dim a multiple of 16; PyTorch's scaled_dot_product_attention
otherwise. Both compute softmax(q k^T / sqrt(d)) v over every key, per sample and head."""

from __future__ import annotations

import ctypes
import math

import torch
import torch.nn.functional as F

from worker.kernels import load_kernel

_lib = load_kernel("flux_attention")
if _lib is not None:
    if _lib.loom_flux_attention_available():
        _L, _I = ctypes.c_int64, ctypes.c_int
        _lib.loom_flux_attention.restype = ctypes.c_int
        _lib.loom_flux_attention.argtypes = [
            ctypes.c_void_p, _L, _L, ctypes.c_void_p, _L, _L, ctypes.c_void_p, _L, _L,
            ctypes.c_void_p, _L, _I, _I, _I, _I, _I, ctypes.c_float]
    else:
        _lib = None


def _native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (_lib is not None and q.device.type == "cpu" and q.shape[-1] % 16 == 0
            and all(x.dtype == torch.float32 and x.stride(-1) == 1
                    and x.stride(-2) == x.shape[-1] for x in (q, k, v)))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Sq, H, d], k and v [B, S, H, d] (rows may be strided: slices of a projection's
    output) -> [B, Sq, H * d], into `out` if given (rows may be strided: a column slice of a
    wider tensor)."""
    batch, rows, heads, head_dim = q.shape
    if not (_native(q, k, v) and (out is None or (out.stride(-1) == 1 and (
            batch == 1 or out.stride(0) == rows * out.stride(1))))):
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2)).transpose(1, 2).flatten(2)
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty((batch, rows, heads * head_dim), dtype=q.dtype, device=q.device)
    rc = _lib.loom_flux_attention(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1), out.data_ptr(), out.stride(1), batch, rows,
        k.shape[1], heads, head_dim, 1.0 / math.sqrt(head_dim))
    if rc != 0:
        raise MemoryError("FLUX attention could not allocate its scratch memory")
    return out
