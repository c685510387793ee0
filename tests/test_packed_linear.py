"""The native packed GEMM (PackedLinear) against PyTorch's F.linear on the same weights."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker.packed_linear import (
    LinearKernel,
    PackedLinear,
    pack_linear_layers,
    packed_linear_available,
)

pytestmark = pytest.mark.skipif(not packed_linear_available(torch.float32),
                                reason="no native kernel here: PyTorch's GEMM is used")


# Row counts cover every tile remainder of 6- and 12-row tiles and more than one row block;
# output widths cover a partial last panel and a single panel.
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 12, 13, 31, 100, 131])
@pytest.mark.parametrize("in_features,out_features", [(64, 40), (96, 16), (200, 333)])
def test_float32_matches_torch(rows, in_features, out_features):
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features, bias=False)
    x = torch.randn(rows, in_features)
    expected = F.linear(x, linear.weight)
    got = PackedLinear(linear)(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# The tile shapes of other machines, built here: AVX-512 (16 lanes, 12-row tiles) and SSE/NEON
# (4 lanes). GCC emulates a vector wider than the machine's, so the tile logic of a wider CPU
# is checked even where it cannot run natively.
@pytest.mark.parametrize("lanes,tile_rows", [(16, 12), (4, 6), (4, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_machines_tile_shapes(lanes, tile_rows, dtype):
    kernel = LinearKernel.load((f"LOOM_VLEN={lanes}", f"LOOM_MR={tile_rows}"))
    assert kernel is not None and kernel.panel == 2 * lanes
    torch.manual_seed(lanes + tile_rows)
    linear = nn.Linear(200, 333, bias=True).to(dtype)
    for rows in (1, tile_rows - 1, tile_rows + 1, 8 * tile_rows + 3):
        x = torch.randn(rows, 200).to(dtype)
        got = PackedLinear(linear, kernel)(x).float()
        exact = x.float() @ linear.weight.float().t() + linear.bias.float()
        tol = 1e-4 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got, exact, rtol=tol, atol=tol)


def test_bias_strided_input_and_leading_dims():
    torch.manual_seed(1)
    linear = nn.Linear(48, 70, bias=True)
    wide = torch.randn(3, 5, 100)
    x = wide[..., 10:58]  # rows are not contiguous with each other
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not packed_linear_available(torch.bfloat16), reason="no bf16 kernel")
def test_bfloat16_matches_torch():
    # PyTorch's bf16 linear accumulates in float32 and rounds the output once: so does ours,
    # so results differ by at most one bf16 rounding step.
    torch.manual_seed(2)
    linear = nn.Linear(256, 300, bias=False).to(torch.bfloat16)
    x = torch.randn(9, 256).to(torch.bfloat16)
    got = PackedLinear(linear)(x)
    assert got.dtype == torch.bfloat16
    exact = x.float() @ linear.weight.float().t()
    torch.testing.assert_close(got.float(), exact, rtol=8e-3, atol=8e-3)


def test_pack_linear_layers_swaps_every_linear_and_unties_weights():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 10))
    model[3].weight = model[0].weight  # tied, as an lm_head often is
    x = torch.randn(4, 8)
    expected = model[3](model[2](model[1](x)))
    assert pack_linear_layers(model) == 2
    assert isinstance(model[1], PackedLinear) and isinstance(model[3], PackedLinear)
    torch.testing.assert_close(model[3](model[2](model[1](x))), expected, rtol=1e-5, atol=1e-5)
    assert model[0].weight.shape == (10, 8)  # the embedding keeps its own weight
