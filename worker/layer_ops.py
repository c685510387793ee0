"""Fused float32 element-wise ops of a decoder layer (`worker/kernels/layer_ops.c`).

Used by the Llama model whenever it computes in float32 and the kernel could be built: float32
models, and bfloat16 models running on the packed GEMM (bfloat16 weights and KV cache, float32
activations). Models computing in bfloat16 or float16 keep PyTorch's ops.
"""

from __future__ import annotations

import ctypes

import torch

from worker.kernels import load_kernel

_lib = load_kernel("layer_ops")
if _lib is not None:
    _P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    for _name, _args in {
        "loom_rms_norm": [_P, _L, _P, _P, _I, _I, _F],
        "loom_add_rms_norm": [_P, _P, _P, _P, _I, _I, _F],
        "loom_rope_store_kv": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P],
        "loom_rope_store_kv_bf16": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P],
        "loom_silu_mul": [_P, _P, _I, _I],
        "loom_gelu_tanh_mul": [_P, _P, _I, _I],
    }.items():
        getattr(_lib, _name).restype = None
        getattr(_lib, _name).argtypes = _args


def applies(x: torch.Tensor) -> bool:
    """Whether the native layer ops run on `x`: float32 on the CPU, with the kernels built."""
    return _lib is not None and x.dtype == torch.float32 and x.device.type == "cpu"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight over rows of x ([T, dim], rows may be strided)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    _lib.loom_rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
                       x.shape[0], x.shape[1], eps)
    return out


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual += delta (in place); returns rmsnorm(residual) * weight."""
    delta = delta.contiguous()
    out = torch.empty(residual.shape, dtype=torch.float32)
    _lib.loom_add_rms_norm(residual.data_ptr(), delta.data_ptr(), weight.data_ptr(),
                           out.data_ptr(), residual.shape[0], residual.shape[1], eps)
    return out


def rope_store_kv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                  positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor) -> None:
    """Rotates the q and k heads of qkv ([T, (H + 2 KVH) * D], contiguous) in place and
    writes k and v into the cache (float32, or bfloat16: rounded) at `slots`."""
    store = _lib.loom_rope_store_kv_bf16 if k_cache.dtype == torch.bfloat16 \
        else _lib.loom_rope_store_kv
    store(
        qkv.data_ptr(), qkv.shape[0], heads, kv_heads, head_dim, positions.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slots.data_ptr())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up rows [gate | up]."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    _lib.loom_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for gate_up rows [gate | up] (Gemma's MLP)."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    _lib.loom_gelu_tanh_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out
