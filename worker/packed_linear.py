"""PackedLinear: an nn.Linear whose weight is packed once for the native GEMM kernel.

`worker/kernels/packed_linear.c` says why (PyTorch's CPU GEMM leaves most of the machine idle
at the row counts a server runs). Float32 and bfloat16 weights are packed; the kernel widens
bfloat16 weights and inputs to float32 and accumulates in float32, and the output has the
input's dtype (a bfloat16 input gets its output rounded once, as PyTorch's bf16 linear does).
Without the kernel (no C compiler, no AVX2) or for float16 weights, `pack_linear_layers` leaves
the model as it is.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from worker import hugepages
from worker.kernels import cpu_flags, load_kernel


class LinearKernel:
    """One build of packed_linear.c: its panel width and its float32 / bfloat16 entry points."""

    def __init__(self, lib) -> None:
        self.panel = lib.loom_linear_panel_width()
        self.funcs = {torch.float32: lib.loom_linear_f32, torch.bfloat16: lib.loom_linear_bf16}
        for fn in self.funcs.values():
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int]

    @classmethod
    def load(cls, defines: tuple[str, ...] = ()) -> "LinearKernel | None":
        lib = load_kernel("packed_linear", defines)
        return None if lib is None else cls(lib)


KERNEL = LinearKernel.load()


def packed_linear_available(dtype: torch.dtype) -> bool:
    return KERNEL is not None and dtype in KERNEL.funcs


def pack_weight(weight: torch.Tensor, panel: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / panel), K, panel]: each panel's K rows of `panel` outputs contiguous,
    the last panel padded with zero outputs."""
    n, k = weight.shape
    panels = -(-n // panel)
    if n % panel:  # (the usual widths are whole panels: no padded copy of every weight)
        padded = torch.zeros(panels * panel, k, dtype=weight.dtype)
        padded[:n] = weight
        weight = padded
    packed = hugepages.empty_tensor((panels, k, panel), weight.dtype)
    packed.copy_(weight.view(panels, panel, k).transpose(1, 2))
    return packed


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, kernel: LinearKernel | None = None) -> None:
        super().__init__()
        kernel = kernel or KERNEL
        weight = linear.weight.detach()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self._kernel = kernel.funcs[weight.dtype]
        self.register_buffer("packed", pack_weight(weight, kernel.panel), persistent=False)
        bias = None
        if linear.bias is not None:  # padded to whole panels: the kernel reads full panels
            bias = torch.zeros(self.packed.shape[0] * kernel.panel, dtype=torch.float32)
            bias[: self.out_features] = linear.bias.detach().float()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows:
            self._kernel(
                x2.data_ptr(), x2.stride(0), self.packed.data_ptr(),
                None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                self.out_features, rows, self.out_features, self.in_features,
            )
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"dtype={self.dtype}, bias={self.bias is not None}"


def packing_pays_off(dtype: torch.dtype) -> bool:
    """Whether to use the kernel for weights of `dtype` on this CPU. It beats PyTorch's GEMM at
    serving shapes on AVX2, float32 and bfloat16 alike (docs/performance.md); but a CPU with
    AMX multiplies bfloat16 in its matrix units, which PyTorch's oneDNN GEMM uses and this
    kernel does not. (Timing both at start-up was tried: with the cores shared by the other
    processes starting up, the timings picked the slower one.)"""
    if not packed_linear_available(dtype):
        return False
    return not (dtype == torch.bfloat16 and "amx_bf16" in cpu_flags())


def pack_linear_layers(model: nn.Module) -> int:
    """Swap every nn.Linear of `model` for a PackedLinear (the original weight is dropped, so
    a tied lm_head gets its own packed copy). Returns how many were packed."""
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear) and packed_linear_available(child.weight.dtype):
                swaps.append((parent, name, child))
    with torch.no_grad():
        for parent, name, child in swaps:
            setattr(parent, name, PackedLinear(child))
    return len(swaps)
