"""QuantLinear: a linear layer whose weight stays in its GGUF block format.

A GGUF file's weights are blocks of 32 (or 256) quantized values with their scales; keeping
them that way in memory keeps a decode step's weight traffic at the file's size (SmolLM2-135M:
~96 MB instead of 540 MB in float32). `worker/kernels/quant_linear.c` multiplies them as they
are, two ways:

- below `float_rows` rows (decode): it quantizes the activations to 8 bits per 32-element block,
  as llama.cpp does, and multiplies in integers: the output is x^ @ W^T with
  |x - x^| <= max|x in block| / 254 per element. 2-4x faster than float32 at one row.
- from `float_rows` rows on (prefill chunks): it dequantizes W a panel at a time into
  packed_linear.c's layout and runs its float32 tile: x @ W^T to float32 rounding, as fast as
  the float32 kernel there, where the integer path is 1.1-1.5x slower (on AVX2 without VNNI).
  With VNNI (AVX512-VNNI or AVX-VNNI) the integer path is the faster one at every row count
  (1.5x at 64-512 rows on a Zen 4 EPYC), and prefill chunks stay on it too (float_rows None),
  as llama.cpp's CPU matmuls quantize their activations at every batch size.

Each path gives a row the same result whatever the other rows of the call (a row's result does
not depend on the batch it is in), but the two paths give different results: a caller that
needs one row's numbers not to depend on the batch size keeps all its calls on one side of
`float_rows` (None: always the integer path). Without a C compiler the PyTorch path
dequantizes a tile of weight rows at a time and multiplies in float32 (exact, slower).

Formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, with the weight as GGUF stores it:
[out_features] rows of blocks covering in_features. On AVX2 builds every format but Q5_1
has its rows rearranged at load into groups of 8 interleaved block by block (the same bytes;
~1.35x faster at one row, ~2x at 4-64: docs/performance.md; Q5_0 and Q4_K, most of Gemma 3
270M's layers, 2-3x at one row, Q6_K 1.6x; ~2x at 16), which only the native kernel reads.
"""

from __future__ import annotations

import ctypes
import enum

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from worker import hugepages
from worker.kernels import load_kernel


class QuantType(enum.IntEnum):
    """The block formats QuantLinear multiplies, by GGML's type number."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14


# (elements, bytes) per block, as in GGML's ggml-common.h.
BLOCK_LAYOUT = {
    QuantType.Q4_0: (32, 18), QuantType.Q4_1: (32, 20), QuantType.Q5_0: (32, 22),
    QuantType.Q5_1: (32, 24), QuantType.Q8_0: (32, 34), QuantType.Q4_K: (256, 144),
    QuantType.Q5_K: (256, 176), QuantType.Q6_K: (256, 210),
}

ISA_NAMES = {0: "portable C", 1: "AVX2", 2: "AVX2+VNNI", 3: "NEON"}

# Added to a type number in a kernel call: the weight's rows are interleaved by 8
# (quant_linear.c's QL_X8 layout).
INTERLEAVED = 0x100


def quant_type(qtype) -> QuantType:
    """A QuantType from a gguf.GGMLQuantizationType, its number or its name ("Q4_1")."""
    if isinstance(qtype, str):
        return QuantType[qtype.upper()]
    return QuantType(int(qtype))


class QuantKernel:
    """One build of quant_linear.c."""

    def __init__(self, lib) -> None:
        self.isa = ISA_NAMES.get(lib.loom_quant_isa(), "unknown")
        self.linear, self.linear_f32 = lib.loom_quant_linear, lib.loom_quant_linear_f32
        for fn in (self.linear, self.linear_f32):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                           ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.interleave = lib.loom_quant_interleave
        self.interleave.restype = ctypes.c_int
        self.interleave.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                    ctypes.c_int, ctypes.c_void_p]
        self.dequantize_rows = lib.loom_quant_dequantize_rows
        self.dequantize_rows.restype = ctypes.c_int
        self.dequantize_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                         ctypes.c_void_p]

    @classmethod
    def load(cls, defines: tuple[str, ...] = ()) -> "QuantKernel | None":
        lib = load_kernel("quant_linear", defines)
        return None if lib is None else cls(lib)


_KERNEL: list = []  # built on first use: the library takes seconds to compile


def default_kernel() -> QuantKernel | None:
    if not _KERNEL:
        _KERNEL.append(QuantKernel.load())
    return _KERNEL[0]


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) for W [out_features, in_features] held as GGUF blocks.

    `raw` is the tensor's bytes as GGUF stores them: [out_features, row bytes] uint8 (or any
    shape holding those bytes), e.g. a gguf.ReaderTensor's `data`. `kernel=None` takes the
    native kernel if one builds here; pass `False` for the PyTorch path. `float_rows`: from how
    many rows on a call takes the float32 path (the module docstring says why; None: never;
    auto: never with VNNI, else FLOAT_ROWS).
    `interleave`: store the rows interleaved by 8 where the kernel has that layout for the
    format (quant_linear.c's QL_X8: ~1.5x faster at one row); `weight` then holds the GGUF
    bytes rearranged, which only the native kernel reads."""

    # Without VNNI: from this many rows the arithmetic, not the weights' bytes, decides, and
    # the dequantized float32 panels catch up with the integer path. With VNNI they never do
    # here (`python -m bench.quant_linear --prefill-paths 64 128 256 512` on the Zen 4 EPYC:
    # integer / panels 0.61-0.68; docs/performance.md, "Quantized linear kernels").
    FLOAT_ROWS = 128

    def __init__(self, qtype, raw, shape: tuple[int, int], bias: torch.Tensor | None = None,
                 kernel: QuantKernel | None | bool = None,
                 float_rows: int | None | str = "auto", interleave: bool = True) -> None:
        super().__init__()
        self.qtype = quant_type(qtype)
        self.out_features, self.in_features = (int(n) for n in shape)
        elements, nbytes = BLOCK_LAYOUT[self.qtype]
        if self.in_features % elements:
            raise ValueError(f"{self.qtype.name} rows are whole blocks of {elements} values; "
                             f"in_features={self.in_features} is not")
        self.row_bytes = self.in_features // elements * nbytes
        self.kernel = (default_kernel() if kernel is None else kernel) or None
        if float_rows == "auto":  # (the integer path throughout where it is the faster one)
            float_rows = None if self.kernel is not None and self.kernel.isa == "AVX2+VNNI" \
                else self.FLOAT_ROWS
        self.float_rows = float_rows
        weight, self.interleaved = self._weight_bytes(raw, interleave)
        self.register_buffer("weight", weight.reshape(self.out_features, self.row_bytes),
                             persistent=False)
        if bias is not None:
            bias = bias.detach().float().contiguous()
        self.register_buffer("bias", bias, persistent=False)
        self._bind()

    def _weight_bytes(self, raw, interleave: bool) -> tuple[torch.Tensor, bool]:
        """The weight's bytes as the kernel will read them, and whether interleaved."""
        source = _as_uint8_flat(raw)
        size = source.numel() if isinstance(source, torch.Tensor) else source.size
        if size != self.out_features * self.row_bytes:
            raise ValueError(f"{size} bytes do not hold a {self.qtype.name} "
                             f"[{self.out_features}, {self.in_features}] weight "
                             f"({self.out_features * self.row_bytes} bytes)")
        if interleave and self.kernel is not None:
            # Straight from the source (the file's mapping) into the layout, with no copy of
            # the GGUF layout in between.
            dest = hugepages.empty_tensor((size,), torch.uint8)
            pointer = source.data_ptr() if isinstance(source, torch.Tensor) \
                else source.ctypes.data
            if self.kernel.interleave(int(self.qtype), pointer, self.row_bytes,
                                      self.out_features, self.in_features,
                                      dest.data_ptr()) == 0:
                return dest, True
        return _as_uint8_tensor(source), False

    @property
    def kernel_kind(self) -> int:
        """The type number a kernel call takes for this weight (with its layout)."""
        return int(self.qtype) | (INTERLEAVED if self.interleaved else 0)

    def _bind(self) -> None:
        """The kernel call's fixed arguments, as plain ints: a decode step makes ~200 of
        these calls, and reading buffers through nn.Module's __getattr__ and converting an
        IntEnum each time cost as much as a small layer's arithmetic."""
        bias = self._buffers["bias"]
        self._call = None if self.kernel is None else self.kernel.linear
        self._call_f32 = None if self.kernel is None else self.kernel.linear_f32
        self._fixed = (self.kernel_kind, self._buffers["weight"].data_ptr(), self.row_bytes,
                       None if bias is None else bias.data_ptr())

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        self._bind()  # the buffers may be new tensors now
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = as_float_rows(x, self.in_features)
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        self.forward_into(x2, y)
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def forward_into(self, x2: torch.Tensor, y: torch.Tensor) -> None:
        """y = x2 @ W^T (+ bias) for x2 from `as_float_rows`; y float32 [rows, out_features],
        rows contiguous but possibly a column slice of a wider output (StackedQuantLinear)."""
        n_in, n_out = self.in_features, self.out_features
        rows = x2.shape[0]
        if self._call is None:
            y.copy_(self._forward_torch(x2))
            return
        qtype, weight, row_bytes, bias = self._fixed
        float_rows = self.float_rows
        call = self._call_f32 if float_rows is not None and rows >= float_rows else self._call
        status = call(qtype, x2.data_ptr(), x2.stride(0), weight, row_bytes, bias,
                      y.data_ptr(), y.stride(0), rows, n_out, n_in)
        if status:
            raise MemoryError(f"quant_linear failed ({status})")

    # Rows of weights the PyTorch path dequantizes at a time: 1024 x 1536 float32 is 6 MB.
    TILE_ROWS = 1024

    def _forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        for start in range(0, self.out_features, self.TILE_ROWS):
            rows = torch.arange(start, min(start + self.TILE_ROWS, self.out_features))
            w = dequantize_torch(self.qtype, self.weight[rows], self.in_features)
            y[:, start:start + len(rows)] = F.linear(x, w)
        if self.bias is not None:
            y += self.bias
        return y

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), in_features]: the rows `ids` of W (an embedding lookup from a
        quantized table: only the rows looked up are dequantized)."""
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise IndexError(f"row ids must be in [0, {self.out_features})")
        if self.kernel is None:
            return dequantize_torch(self.qtype, self.weight[ids], self.in_features)
        ids = ids.contiguous()
        out = torch.empty(len(ids), self.in_features, dtype=torch.float32)
        if len(ids):
            self.kernel.dequantize_rows(self.kernel_kind, self.weight.data_ptr(), self.row_bytes,
                                        ids.data_ptr(), len(ids), self.in_features,
                                        out.data_ptr())
        return out

    def dequantize(self) -> torch.Tensor:
        """The whole weight in float32 [out_features, in_features]."""
        return self.dequantize_rows(torch.arange(self.out_features))

    def extra_repr(self) -> str:
        path = "PyTorch" if self.kernel is None else self.kernel.isa
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype.name}, bias={self.bias is not None}, kernel={path}, "
                f"interleaved={self.interleaved}, float_rows={self.float_rows}")


def as_float_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x as the kernel reads it: float32 [rows, in_features] with unit column stride."""
    x2 = x if x.dim() == 2 else x.reshape(-1, in_features)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class StackedQuantLinear(nn.Module):
    """Several QuantLinear layers over the same input, their outputs side by side: a fused
    projection (q/k/v, gate/up) whose parts a GGUF file stores in different block formats
    (llama.cpp's *_K_M mixes give some layers' v or down rows more bits). Each part writes its
    own columns of the one output, so nothing is concatenated per call."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("stacked projections must share their input width")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = as_float_rows(x, self.in_features)
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        start = 0
        for part in self.parts:
            part.forward_into(x2, y[:, start:start + part.out_features])
            start += part.out_features
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)


class QuantEmbedding(nn.Module):
    """An embedding table kept in its GGUF block format: a lookup dequantizes only the rows it
    reads. `table` is a QuantLinear (a tied output layer can share its weight)."""

    def __init__(self, table: QuantLinear) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.dequantize_rows(ids).view(*ids.shape, self.embedding_dim)


def quant_linear(qtype, raw, shape: tuple[int, int], bias: torch.Tensor | None = None,
                 **options) -> QuantLinear:
    """A QuantLinear from a GGUF tensor's type, bytes and [out_features, in_features] shape.
    (A gguf.ReaderTensor lists its shape the other way round: in_features first.)"""
    return QuantLinear(qtype, raw, shape, bias, **options)


def _as_uint8_flat(raw) -> torch.Tensor | np.ndarray:
    """raw's bytes, flat: a torch tensor's uint8 view, or a uint8 array (a view of raw where
    it is contiguous: a gguf.ReaderTensor's memory map of the file, bytes)."""
    if isinstance(raw, torch.Tensor):
        return raw.detach().contiguous().view(torch.uint8).reshape(-1)
    return np.ascontiguousarray(np.frombuffer(raw, np.uint8) if isinstance(raw, bytes)
                                else np.asarray(raw)).view(np.uint8).reshape(-1)


def _as_uint8_tensor(source: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A torch tensor is used as it is (it may be a view into the caller's arena of weights);
    an array (the file's read-only map) is copied into its own mapping advised for huge pages:
    a decode step streams every weight, and with 4 KiB pages the hardware prefetcher stops at
    every page (worker/hugepages.py)."""
    if isinstance(source, torch.Tensor):
        return source
    tensor = hugepages.empty_tensor((source.size,), torch.uint8)
    tensor.numpy()[:] = source
    return tensor


# -- the PyTorch path: dequantization of whole blocks ------------------------------------------


def dequantize_torch(qtype, raw: torch.Tensor, in_features: int) -> torch.Tensor:
    """float32 [rows, in_features] from raw block bytes [rows, row bytes]."""
    qtype = quant_type(qtype)
    elements, nbytes = BLOCK_LAYOUT[qtype]
    blocks = raw.reshape(-1, nbytes)
    values = _DEQUANTIZE[qtype](blocks)
    return values.reshape(-1, in_features)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at `offset` of every block, as a float32 column."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32]: the 16 low nibbles, then the 16 high ones."""
    return torch.cat([q & 0x0F, q >> 4], dim=1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] little-endian bytes -> [n, 32]: bit i of the 32-bit word."""
    word = qh.to(torch.int64)
    word = word[:, 0] | word[:, 1] << 8 | word[:, 2] << 16 | word[:, 3] << 24
    return (word[:, None] >> torch.arange(32)) & 1


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:18]).float() - 8)


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:20]).float() + _f16(b, 2)


def _q5_0(b):
    q = _nibbles(b[:, 6:22]).to(torch.int64) | _bits32(b[:, 2:6]) << 4
    return _f16(b, 0) * (q.float() - 16)


def _q5_1(b):
    q = _nibbles(b[:, 8:24]).to(torch.int64) | _bits32(b[:, 4:8]) << 4
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q8_0(b):
    return _f16(b, 0) * b[:, 2:34].contiguous().view(torch.int8).float()


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of Q4_K / Q5_K from their 12 packed bytes."""
    s = s.to(torch.int64)
    lo_sc, lo_m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([lo_sc & 63, (hi & 0x0F) | (lo_sc >> 6) << 4], dim=1)
    mins = torch.cat([lo_m & 63, (hi >> 4) | (lo_m >> 6) << 4], dim=1)
    return scales.float(), mins.float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] -> [n, 8, 32]: sub-block 2j the low nibbles of bytes 32j.., 2j+1 the high."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32).to(torch.int64)


def _q4_k(b):
    scales, mins = _k_scales_mins(b[:, 4:16])
    q = _k_nibbles(b[:, 16:144]).float()
    return (_f16(b, 0) * scales)[..., None] * q - (_f16(b, 2) * mins)[..., None]


def _q5_k(b):
    scales, mins = _k_scales_mins(b[:, 4:16])
    high = (b[:, 16:48].to(torch.int64)[:, None, :] >> torch.arange(8)[None, :, None]) & 1
    q = (_k_nibbles(b[:, 48:176]) | high << 4).float()
    return (_f16(b, 0) * scales)[..., None] * q - (_f16(b, 2) * mins)[..., None]


def _q6_k(b):
    ql = b[:, :128].to(torch.int64).reshape(-1, 2, 2, 32)  # [half, low/high 32 bytes]
    qh = b[:, 128:192].to(torch.int64).reshape(-1, 2, 1, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # [half, part 0..3, 32]
    high = (qh >> (2 * torch.arange(4))[None, None, :, None]) & 3
    q = (low | high << 4).reshape(-1, 16, 16).float() - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    return (_f16(b, 208) * scales)[..., None] * q


_DEQUANTIZE = {
    QuantType.Q4_0: _q4_0, QuantType.Q4_1: _q4_1, QuantType.Q5_0: _q5_0,
    QuantType.Q5_1: _q5_1, QuantType.Q8_0: _q8_0, QuantType.Q4_K: _q4_k,
    QuantType.Q5_K: _q5_k, QuantType.Q6_K: _q6_k,
}
