"""A decoder layer's element-wise ops on a GPU, one Triton kernel each (the CPU has them in C,
`worker/layer_ops.py`, with the same contracts): add + RMSNorm, rotary + KV store, SiLU-and-mul.

Why: on a GPU a small model's decode step is a long chain of tiny kernels. PyTorch's RMSNorm
is seven (cast, square, mean, rsqrt, two multiplies, cast), the rotary a dozen per layer; on an
H100 each costs 3-4 us even replayed from a CUDA graph, so a 16-layer 1B model spent ~3 ms a
step on ~800 launches against 0.7 ms of reading its weights. Fused, a layer is ~10 kernels.

Rounding follows PyTorch's ops in the model's dtype (Hugging Face's Llama in bfloat16):
each op computes in float32 and rounds where PyTorch's separate kernel would store, so a
bfloat16 model's outputs stay those of the unfused path but for the order of the norm's sum.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # (a CPU-only install: the GPU path is never taken there)
    triton = None


def applies(x: torch.Tensor) -> bool:
    """Whether the fused kernels run on `x`: a CUDA tensor, with Triton there."""
    return triton is not None and x.is_cuda


if triton is not None:

    @triton.jit
    def _rnd(x, dtype: tl.constexpr):
        """x (float32) rounded to `dtype` and widened back: a PyTorch op's stored result."""
        return x.to(dtype).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(x_ptr, stride_x, res_ptr, w_ptr, out_ptr, n_cols, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        dtype = x.dtype
        xf = x.to(tl.float32)
        if HAS_RESIDUAL:  # residual += x, rounded as PyTorch's add, then normed
            r = tl.load(res_ptr + row * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
            xf = _rnd(r + xf, dtype)
            tl.store(res_ptr + row * n_cols + cols, xf.to(dtype), mask=ok)
        var = tl.sum(xf * xf, axis=0) / n_cols
        normed = _rnd(xf * tl.rsqrt(var + eps), dtype)  # (Hugging Face: float32, then cast)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (w * normed).to(dtype), mask=ok)

    @triton.jit
    def _rope_store_kernel(qkv_ptr, stride_t, pos_ptr, cos_ptr, sin_ptr, stride_cos,
                           k_cache_ptr, v_cache_ptr, slot_ptr, heads, kv_heads,
                           HALF: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        head_dim = 2 * HALF
        base = qkv_ptr + t * stride_t + h * head_dim
        i = tl.arange(0, BLOCK)
        ok = i < HALF
        x1 = tl.load(base + i, mask=ok, other=0.0)
        x2 = tl.load(base + HALF + i, mask=ok, other=0.0)
        dtype = x1.dtype
        slot = tl.load(slot_ptr + t)
        if h < heads + kv_heads:  # q or k: x * cos + rotate_half(x) * sin, in place
            pos = tl.load(pos_ptr + t)
            c1 = _rnd(tl.load(cos_ptr + pos * stride_cos + i, mask=ok, other=0.0), dtype)
            c2 = _rnd(tl.load(cos_ptr + pos * stride_cos + HALF + i, mask=ok, other=0.0), dtype)
            s1 = _rnd(tl.load(sin_ptr + pos * stride_cos + i, mask=ok, other=0.0), dtype)
            s2 = _rnd(tl.load(sin_ptr + pos * stride_cos + HALF + i, mask=ok, other=0.0), dtype)
            a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
            o1 = _rnd(_rnd(a1 * c1, dtype) + _rnd(-a2 * s1, dtype), dtype)
            o2 = _rnd(_rnd(a2 * c2, dtype) + _rnd(a1 * s2, dtype), dtype)
            tl.store(base + i, o1.to(dtype), mask=ok)
            tl.store(base + HALF + i, o2.to(dtype), mask=ok)
            if h >= heads:
                dst = k_cache_ptr + (slot * kv_heads + (h - heads)) * head_dim
                tl.store(dst + i, o1.to(k_cache_ptr.dtype.element_ty), mask=ok)
                tl.store(dst + HALF + i, o2.to(k_cache_ptr.dtype.element_ty), mask=ok)
        else:  # v: to the cache as it is
            dst = v_cache_ptr + (slot * kv_heads + (h - heads - kv_heads)) * head_dim
            tl.store(dst + i, x1.to(v_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + HALF + i, x2.to(v_cache_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        g = tl.load(gate_up_ptr + row * 2 * width + cols, mask=ok, other=0.0)
        u = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=ok, other=0.0)
        dtype = g.dtype
        gf = g.to(tl.float32)
        silu = _rnd(gf / (1.0 + tl.exp(-gf)), dtype)
        tl.store(out_ptr + row * width + cols, (silu * u.to(tl.float32)).to(dtype), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight over the rows of x ([T, dim], rows may be strided)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(rows,)](x, x.stride(0), x, weight, out, cols, eps, HAS_RESIDUAL=False,
                              BLOCK=triton.next_power_of_2(cols))
    return out


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual += delta (in place); returns rmsnorm(residual) * weight."""
    delta = delta.contiguous()
    rows, cols = residual.shape
    out = torch.empty((rows, cols), dtype=residual.dtype, device=residual.device)
    _rms_norm_kernel[(rows,)](delta, cols, residual, weight, out, cols, eps,
                              HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(cols))
    return out


def rope_store_kv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                  positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Rotates the q and k heads of qkv ([T, (H + 2 KVH) * D], contiguous) in place and
    writes k and v into the caches ([blocks, block_size, KVH, D], contiguous) at `slots`.
    cos/sin: float32 [positions, D] tables."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and qkv.stride(-1) == 1
    tokens = qkv.shape[0]
    half = head_dim // 2
    _rope_store_kernel[(tokens, heads + 2 * kv_heads)](
        qkv, qkv.stride(0), positions, cos, sin, cos.stride(0), k_cache, v_cache, slots,
        heads, kv_heads, HALF=half, BLOCK=triton.next_power_of_2(half))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up rows [gate | up] (contiguous)."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block)
    return out
