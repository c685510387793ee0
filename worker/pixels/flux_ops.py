"""The element-wise parts of a FLUX block, native (`worker/kernels/flux_ops.c`), for
flux_forward.FluxForward: float32 tensors on the CPU when the kernel could be built; every
other case keeps PyTorch's ops (flux_forward's own functions)."""

from __future__ import annotations

import ctypes

import torch

from worker.kernels import load_kernel

_lib = load_kernel("flux_ops")
if _lib is not None:
    _P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    for _name, _args in {
        "loom_flux_modulated_norm": [_P, _P, _I, _I, _I, _P, _P, _L, _F],
        "loom_flux_qk_norm_rope": [_P, _I, _I, _L, _L, _I, _I, _I, _P, _P, _P, _F],
        "loom_flux_gelu_tanh": [_P, _L, _P, _L, _L, _I],
    }.items():
        getattr(_lib, _name).restype = None
        getattr(_lib, _name).argtypes = _args


def applies(x: torch.Tensor) -> bool:
    return _lib is not None and x.dtype == torch.float32 and x.device.type == "cpu"


def modulated_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """LayerNorm(x) * (1 + scale) + shift per sample: x [B, S, D]; shift, scale [B, D] rows
    of the same stride (chunks of one modulation output)."""
    assert shift.stride() == scale.stride() and shift.stride(-1) == 1
    x = x.contiguous()
    out = torch.empty_like(x)
    samples, rows, dim = x.shape
    _lib.loom_flux_modulated_norm(x.data_ptr(), out.data_ptr(), samples, rows, dim,
                                  shift.data_ptr(), scale.data_ptr(), shift.stride(0), eps)
    return out


def qk_norm_rope_(x: torch.Tensor, text_rows: int, text_weight: torch.Tensor,
                  image_weight: torch.Tensor, rope: torch.Tensor, eps: float) -> None:
    """In place on x [B, S, H, d] (each row's heads contiguous): RMSNorm per head (text_weight
    on the first text_rows rows), then the image rows rotated by rope (complex [S - text_rows,
    1, d / 2], flux_forward.rope_table)."""
    samples, rows, heads, head_dim = x.shape
    assert x.stride(3) == 1 and x.stride(2) == head_dim
    table = torch.view_as_real(rope)
    assert table.is_contiguous() and table.shape[0] >= rows - text_rows
    _lib.loom_flux_qk_norm_rope(x.data_ptr(), samples, rows, x.stride(0), x.stride(1), heads,
                                head_dim, text_rows, text_weight.data_ptr(),
                                image_weight.data_ptr(), table.data_ptr(), eps)


def gelu_tanh(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = tanh-GELU(x) over x, out [..., C] (rows may be strided, columns contiguous; out
    may be x)."""
    src, dst = x.view(-1, x.shape[-1]), out.view(-1, out.shape[-1])  # (raise where not rows)
    assert src.shape == dst.shape and src.stride(-1) == 1 and dst.stride(-1) == 1
    _lib.loom_flux_gelu_tanh(src.data_ptr(), src.stride(0), dst.data_ptr(), dst.stride(0),
                             src.shape[0], src.shape[1])
    return out
