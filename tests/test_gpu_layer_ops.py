"""The GPU's fused element-wise ops (worker/gpu_layer_ops.py), run on the CPU by Triton's
interpreter, against the PyTorch ops they replace (the Llama model's unfused path, Hugging
Face's arithmetic): add + RMSNorm, rotary + KV store, SiLU-and-mul, in float32 and bfloat16,
on strided rows and scattered cache slots."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # (read when the kernels are defined: before the import)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed (the test extra has it)")
from worker import gpu_layer_ops  # noqa: E402
from worker.attention import store_kv  # noqa: E402
from worker.models.llama import RMSNorm, apply_rotary  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def _close(got, want, dtype):
    """float32: equal but for the sum's order. bfloat16: the kernels round where PyTorch's ops
    do, but Triton's interpreter rounds float32 to bfloat16 toward zero (a GPU rounds to
    nearest), so each rounding may land one bfloat16 step (2^-8 relative) off: a few steps."""
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=3e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_add_rms_norm_match_the_pytorch_norm(dtype):
    gen = torch.Generator().manual_seed(0)
    dim = 96  # (not a power of two: masked)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen))
    wide = torch.randn(5, 2 * dim, generator=gen).to(dtype)
    x = wide[:, :dim]  # strided rows
    with torch.no_grad():
        _close(gpu_layer_ops.rms_norm(x, norm.weight, 1e-5), norm._norm(x), dtype)
        residual = torch.randn(5, dim, generator=gen).to(dtype)
        want_residual = residual + x
        want = norm._norm(want_residual)
        got = gpu_layer_ops.add_rms_norm(residual, x, norm.weight, 1e-5)
    _close(residual, want_residual, dtype)  # (in place)
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kv_matches_apply_rotary_and_store_kv(dtype):
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, head_dim, blocks, block_size = 6, 6, 2, 10, 8, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 3, 17, 5, 29, 1])
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    angles = torch.randn(32, head_dim // 2, generator=gen)
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    cache_shape = (blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
    k_want, v_want = k_cache.clone(), v_cache.clone()

    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    c, s = cos[positions].to(dtype), sin[positions].to(dtype)
    q_want = apply_rotary(q.reshape(tokens, heads, head_dim), c, s)
    k_rot = apply_rotary(k.reshape(tokens, kv_heads, head_dim), c, s)
    store_kv(k_rot, v.reshape(tokens, kv_heads, head_dim), k_want, v_want, slots)

    fused = qkv.clone()
    gpu_layer_ops.rope_store_kv(fused, heads, kv_heads, head_dim, positions, cos, sin,
                                k_cache, v_cache, slots)
    fq, fk, fv = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    for got, want in ((fq.reshape(q_want.shape), q_want), (fk.reshape(k_rot.shape), k_rot),
                      (k_cache, k_want), (v_cache, v_want)):
        _close(got, want, dtype)
    assert torch.equal(fv, v)  # (v itself untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_pytorch(dtype):
    gen = torch.Generator().manual_seed(2)
    width = 1500  # (two programs per row, the second masked)
    gate_up = torch.randn(3, 2 * width, generator=gen).to(dtype)
    gate, up = gate_up.split(width, -1)
    _close(gpu_layer_ops.silu_mul(gate_up), F.silu(gate) * up, dtype)
