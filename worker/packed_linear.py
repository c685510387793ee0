"""PackedLinear: an nn.Linear whose weight is packed once for the native GEMM kernel.

`worker/kernels/packed_linear.c` says why (PyTorch's CPU GEMM leaves most of the machine idle
at the row counts a server runs). Float32 and bfloat16 weights are packed; inputs are widened
to float32 and outputs rounded back to the weight dtype, as PyTorch's own bf16 linear does
(float32 accumulation). Without the kernel (no C compiler, no AVX2) or for float16 weights,
`pack_linear_layers` leaves the model as it is.
"""

from __future__ import annotations

import ctypes
import logging
import math
import time

import torch
from torch import nn

from worker import hugepages
from worker.kernels import load_kernel

logger = logging.getLogger(__name__)


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
    padded = torch.zeros(panels * panel, k, dtype=weight.dtype)
    padded[:n] = weight
    packed = hugepages.empty_tensor((panels, k, panel), weight.dtype)
    packed.copy_(padded.view(panels, panel, k).transpose(1, 2))
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
        if self.dtype != torch.float32:
            y = y.to(self.dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"dtype={self.dtype}, bias={self.bias is not None}"


def packing_pays_off(linear: nn.Linear, rows: tuple[int, ...] = (1, 16, 256)) -> bool:
    """Whether the kernel beats PyTorch on this machine for a layer like `linear`, timed at a
    decode-sized and a prefill-sized batch. It does on AVX2 and AVX-512 CPUs in float32; with
    bfloat16 on a CPU with AMX, PyTorch's oneDNN GEMM uses the matrix units and wins."""
    if not packed_linear_available(linear.weight.dtype):
        return False
    packed = PackedLinear(linear)
    speedups = []
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, linear.in_features).to(linear.weight.dtype)
            speedups.append(_best_time(lambda: linear(x)) / _best_time(lambda: packed(x)))
    # Each batch size counts alike: the geometric mean of the speed-ups decides.
    pays = math.prod(speedups) ** (1 / len(speedups)) > 1.0
    logger.info("linear layers: packed kernel vs PyTorch at %s rows: %s times as fast: using %s",
                "/".join(map(str, rows)), "/".join(f"{r:.2f}" for r in speedups),
                "the packed kernel" if pays else "PyTorch")
    return pays


def _best_time(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


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
