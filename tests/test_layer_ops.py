"""The fused float32 layer ops against the PyTorch expressions Hugging Face Llama uses."""

import pytest
import torch
import torch.nn.functional as F

from worker import layer_ops
from worker.models.llama import apply_rotary

pytestmark = pytest.mark.skipif(not layer_ops.applies(torch.zeros(1)),
                                reason="no native kernel here: PyTorch's ops are used")

EPS = 1e-5


def hf_rms_norm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 crosses the threads threshold
def test_rms_norm_and_fused_residual_add(rows):
    torch.manual_seed(rows)
    x, delta, w = torch.randn(rows, 576), torch.randn(rows, 576), torch.randn(576)
    torch.testing.assert_close(layer_ops.rms_norm(x, w, EPS), hf_rms_norm(x, w))
    wide = torch.randn(rows, 700)
    torch.testing.assert_close(layer_ops.rms_norm(wide[:, :576], w, EPS),
                               hf_rms_norm(wide[:, :576], w))
    residual = x.clone()
    out = layer_ops.add_rms_norm(residual, delta, w, EPS)
    torch.testing.assert_close(residual, x + delta)
    torch.testing.assert_close(out, hf_rms_norm(x + delta, w))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_rope_store_kv_matches_rotary_and_index_copy(rows, cache_dtype):
    torch.manual_seed(rows)
    heads, kv_heads, dim, max_pos = 9, 3, 64, 512
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    positions = torch.randint(0, max_pos, (rows,))
    slots = torch.randperm(1000)[:rows]
    k_cache = torch.zeros(1000, kv_heads, dim, dtype=cache_dtype)
    v_cache = torch.zeros(1000, kv_heads, dim, dtype=cache_dtype)

    q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    want_q = apply_rotary(q.view(rows, heads, dim), cos[positions], sin[positions])
    want_k = apply_rotary(k.reshape(rows, kv_heads, dim), cos[positions], sin[positions])

    layer_ops.rope_store_kv(qkv, heads, kv_heads, dim, positions, cos, sin, k_cache, v_cache,
                            slots)
    got_q, got_k, got_v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    torch.testing.assert_close(got_q.view(rows, heads, dim), want_q)
    torch.testing.assert_close(got_k.view(rows, kv_heads, dim), want_k)
    torch.testing.assert_close(got_v, v)  # v is not rotated
    # a bfloat16 cache holds the values rounded as PyTorch rounds them (to nearest even)
    torch.testing.assert_close(k_cache[slots], want_k.to(cache_dtype))
    assert torch.equal(v_cache[slots], v.view(rows, kv_heads, dim).to(cache_dtype))
    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("rows", [1, 64])
def test_silu_mul(rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536) * 4
    gate, up = gate_up.split(1536, -1)
    torch.testing.assert_close(layer_ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("rows", [1, 64])
def test_gelu_tanh_mul(rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 2048) * 4
    gate, up = gate_up.split(2048, -1)
    torch.testing.assert_close(layer_ops.gelu_tanh_mul(gate_up),
                               F.gelu(gate, approximate="tanh") * up)
