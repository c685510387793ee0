"""FluxLinear: a FLUX linear layer on Loom's packed GEMM (`worker/kernels/packed_linear.c`).

In float32 on a CPU, with the kernel built. At a FLUX step's shapes it equals MKL where the
input has 128 features and runs 1.1-1.2x where it has 512; and it writes into a slice of a
wider tensor (rows strided), which spares FluxForward its concatenations: the text and image
streams' q/k/v go straight into one [text; image] tensor, a single block's attention output
and MLP activations side by side into its output projection's input. The weight is packed
once and the modules' own copies are released: from then on FluxForward is the transformer's
forward (the modules cannot run). Elsewhere F.linear on the modules' weights, made views of
one concatenated weight where several linears share an input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.packed_linear import KERNEL, pack_weight


class FluxLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight, bias
        self._gemm = None
        if KERNEL is not None and weight.dtype == torch.float32 and weight.device.type == "cpu":
            self._gemm = KERNEL.funcs[torch.float32]
            self.packed = pack_weight(weight.detach(), KERNEL.panel)
            if bias is not None:  # padded to whole panels: the kernel reads full panels
                self.bias = torch.zeros(self.packed.shape[0] * KERNEL.panel)
                self.bias[:self.out_features] = bias.detach()
            self.weight = None

    @classmethod
    def of(cls, linears: list[nn.Linear]) -> "FluxLinear":
        """One layer for linears of the same input, their outputs side by side."""
        weight = torch.cat([m.weight.detach() for m in linears])
        bias = torch.cat([m.bias.detach() for m in linears])
        layer = cls(weight, bias)
        start = 0
        for m in linears:
            rows = m.weight.shape[0]
            if layer._gemm is None:  # the modules keep views of the one weight (no copy)
                m.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
                m.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
            else:  # packed: the modules' copies go
                m.weight = nn.Parameter(torch.empty(0, m.in_features), requires_grad=False)
                m.bias = nn.Parameter(torch.empty(0), requires_grad=False)
            start += rows
        return layer

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out], into `out` if given (rows may be strided). A 3-D x or out
        whose samples are not one row stride apart runs sample by sample."""
        if self._gemm is None:
            y = F.linear(x, self.weight, self.bias)
            return y if out is None else out.copy_(y)
        assert x.dtype == torch.float32
        if out is None:
            out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype)
        if x.dim() == 3 and not (_rows_of(x) and _rows_of(out)):
            for sample in range(x.shape[0]):
                self(x[sample], out[sample])
            return out
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y2 = out.view(-1, self.out_features)
        if x2.shape[0]:
            self._gemm(x2.data_ptr(), x2.stride(0), self.packed.data_ptr(),
                       None if self.bias is None else self.bias.data_ptr(), y2.data_ptr(),
                       y2.stride(0), x2.shape[0], self.out_features, self.in_features)
        return out


def _rows_of(x: torch.Tensor) -> bool:
    """Whether x [B, S, C]'s rows are one stride apart across samples (a 2-D view exists)."""
    return x.stride(-1) == 1 and (x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1))
