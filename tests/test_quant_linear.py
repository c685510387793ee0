"""QuantLinear (worker/quant_linear.py, worker/kernels/quant_linear.c) against the gguf package's
own dequantization. The integer path's y must be x @ dequantize(W)^T within the error that
quantizing x to 8 bits per 32-element block allows, and exactly x^ @ W^T (x^ the 8-bit round
trip of x) up to float32 rounding; the float32 path's y must be x @ dequantize(W)^T up to
float32 rounding.

The error bound: the kernel multiplies x^ = d * round(x / d), d = max|x in block| / 127, so
each |x_i - x^_i| <= d / 2 and |y - x @ W^T| <= sum_i |W_i| d_i / 2, computed per output here.

Weights: the legacy formats are quantized from random floats by gguf.quants.quantize; the
K-quants, which that package cannot quantize, are random bytes with small float16 scales
(every bit pattern of their scale, min and value fields is a valid block).
"""

import gguf
import numpy as np
import pytest
import torch

from worker import quant_linear
from worker.quant_linear import (
    BLOCK_LAYOUT,
    QuantKernel,
    QuantLinear,
    QuantType,
    dequantize_torch,
)

KERNEL = quant_linear.default_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: PyTorch path only")

LEGACY = [QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q8_0]
K_QUANTS = [QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K]
# Input widths: 96 is an odd number of 32-blocks (the AVX2 path's unpaired last block).
IN_FEATURES = {q: (96, 576) for q in LEGACY} | {q: (256, 768) for q in K_QUANTS}
# Where each format keeps its float16 scales (the rest of a block is any bytes).
SCALE_OFFSETS = {QuantType.Q4_K: (0, 2), QuantType.Q5_K: (0, 2), QuantType.Q6_K: (208,)}


def random_weight(qtype: QuantType, out_f: int, in_f: int, seed: int = 0) -> np.ndarray:
    """Raw blocks [out_f, row bytes] of a valid `qtype` weight."""
    rng = np.random.default_rng(seed)
    ggml_type = gguf.GGMLQuantizationType(int(qtype))
    if qtype in LEGACY:
        return gguf.quants.quantize(rng.standard_normal((out_f, in_f)).astype(np.float32),
                                    ggml_type)
    elements, nbytes = BLOCK_LAYOUT[qtype]
    raw = rng.integers(0, 256, (out_f, in_f // elements, nbytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scale = (rng.random((out_f, in_f // elements)) * 0.01 + 1e-4).astype(np.float16)
        raw[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(out_f, -1, 2)
    return raw.reshape(out_f, -1)


def reference_weight(qtype: QuantType, raw: np.ndarray, out_f: int) -> np.ndarray:
    ggml_type = gguf.GGMLQuantizationType(int(qtype))
    return gguf.quants.dequantize(raw, ggml_type).reshape(out_f, -1).astype(np.float64)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x^, d): the 8-bit round trip of x per 32-element block and each element's block d."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.rint(blocks * inv)  # round half to even, as the kernel does
    x_hat = (q * d).reshape(x.shape).astype(np.float64)
    return x_hat, np.broadcast_to(d, blocks.shape).reshape(x.shape)


def check_against_reference(layer: QuantLinear, raw: np.ndarray, x: np.ndarray) -> None:
    """The integer path (or the PyTorch one, which is exact) against the reference."""
    w = reference_weight(layer.qtype, raw, layer.out_features)
    got = layer(torch.from_numpy(x)).numpy().astype(np.float64)
    if layer.kernel is None:
        x_hat, d = x.astype(np.float64), np.zeros_like(x)
    else:
        assert layer.float_rows is None or len(x) < layer.float_rows
        x_hat, d = quantize_activations(x)
    # float32 accumulation over in_features terms: a relative error well under 1e-5 of
    # sum |w x|, allowed on top of each bound.
    rounding = 1e-5 * (np.abs(x_hat) @ np.abs(w).T) + 1e-6
    np.testing.assert_array_less(np.abs(got - x_hat @ w.T), rounding)
    bound = (d / 2) @ np.abs(w).T
    np.testing.assert_array_less(np.abs(got - x.astype(np.float64) @ w.T), bound + rounding)


def check_float_path(layer: QuantLinear, raw: np.ndarray, x: np.ndarray) -> None:
    assert layer.float_rows is not None and len(x) >= layer.float_rows
    w = reference_weight(layer.qtype, raw, layer.out_features)
    got = layer(torch.from_numpy(x)).numpy().astype(np.float64)
    rounding = 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-6
    np.testing.assert_array_less(np.abs(got - x.astype(np.float64) @ w.T), rounding)


@needs_kernel
@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 513])
@pytest.mark.parametrize("out_f", [37, 96])
def test_kernel_matches_dequantized_reference(qtype, rows, out_f):
    for in_f in IN_FEATURES[qtype]:
        raw = random_weight(qtype, out_f, in_f, seed=rows)
        x = np.random.default_rng(rows + out_f).standard_normal((rows, in_f)).astype(np.float32)
        check_against_reference(QuantLinear(qtype, raw, (out_f, in_f), float_rows=None), raw, x)
        check_float_path(QuantLinear(qtype, raw, (out_f, in_f), float_rows=1), raw, x)


@needs_kernel
@pytest.mark.parametrize("qtype", [QuantType.Q4_1, QuantType.Q8_0, QuantType.Q6_K],
                         ids=lambda q: q.name)
def test_a_rows_result_does_not_depend_on_its_batch(qtype):
    # The server batches sequences freely: one sequence's numbers must be the same alone and
    # in any batch, bit for bit, on each path (a one-row call against one row of 17 / 300).
    in_f = IN_FEATURES[qtype][1]
    raw = random_weight(qtype, 96, in_f)
    x = torch.randn(300, in_f)
    integer = QuantLinear(qtype, raw, (96, in_f), float_rows=None)
    batch = integer(x[:17])
    for i in (0, 5, 16):
        assert torch.equal(integer(x[i:i + 1])[0], batch[i])
    floats = QuantLinear(qtype, raw, (96, in_f), float_rows=1)
    batch = floats(x)
    for i in (0, 5, 299):
        assert torch.equal(floats(x[i:i + 1])[0], batch[i])
    # the default: with VNNI the integer path at every row count; without, the float path
    # from FLOAT_ROWS rows on
    default = QuantLinear(qtype, raw, (96, in_f))
    if default.kernel.isa == "AVX2+VNNI":
        assert default.float_rows is None
        assert torch.equal(default(x), integer(x))
    else:
        assert default.float_rows == QuantLinear.FLOAT_ROWS
        assert not torch.equal(default(x[:17]), batch[:17])
        assert torch.equal(default(x), batch)


@needs_kernel
def test_error_is_what_8_bit_activations_explain():
    # The worst-case bound above adds every rounding error with the same sign; the typical
    # one is sharper. Rounding errors are uniform in [-d/2, d/2] (variance d^2 / 12) and
    # independent, so over many outputs the RMS error must match sqrt(sum w^2 d^2 / 12), and
    # that is about 1% of the outputs' size: a kernel getting any block wrong would be far off.
    raw = random_weight(QuantType.Q4_1, 256, 576)
    x = np.random.default_rng(1).standard_normal((32, 576)).astype(np.float32)
    w = reference_weight(QuantType.Q4_1, raw, 256)
    _, d = quantize_activations(x)
    err = QuantLinear(QuantType.Q4_1, raw, (256, 576))(torch.from_numpy(x)).numpy() - x @ w.T
    sigma = np.sqrt((d.astype(np.float64) ** 2 / 12) @ (w ** 2).T)
    assert 0.8 < np.sqrt(np.mean(err ** 2) / np.mean(sigma ** 2)) < 1.2
    assert np.mean(sigma) < 0.02 * np.mean(np.abs(x @ w.T))


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.name)
def test_pytorch_path_matches_dequantized_reference(qtype):
    in_f = IN_FEATURES[qtype][0]
    raw = random_weight(qtype, 37, in_f)
    layer = QuantLinear(qtype, raw, (37, in_f), kernel=False)
    x = np.random.default_rng(2).standard_normal((5, in_f)).astype(np.float32)
    w = reference_weight(qtype, raw, 37)
    np.testing.assert_allclose(layer(torch.from_numpy(x)).numpy(), x @ w.T, rtol=1e-4,
                               atol=1e-4 * np.abs(x @ w.T).max())


def test_without_a_compiler_the_pytorch_path_is_used(monkeypatch):
    monkeypatch.setattr(quant_linear, "_KERNEL", [None])
    raw = random_weight(QuantType.Q4_1, 2100, 64)  # more rows than one dequantized tile
    layer = QuantLinear(QuantType.Q4_1, raw, (2100, 64), bias=torch.randn(2100))
    assert layer.kernel is None and "PyTorch" in repr(layer)
    x = torch.randn(3, 64)
    w = torch.from_numpy(reference_weight(QuantType.Q4_1, raw, 2100)).float()
    torch.testing.assert_close(layer(x), x @ w.T + layer.bias, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda q: q.name)
def test_dequantize_rows_matches_gguf(qtype):
    in_f = IN_FEATURES[qtype][1]
    raw = random_weight(qtype, 50, in_f)
    w = reference_weight(qtype, raw, 50)
    ids = torch.tensor([7, 0, 49, 7])
    scale = np.abs(w).max()
    for kernel in ([None, False] if KERNEL is not None else [False]):
        layer = QuantLinear(qtype, raw, (50, in_f), kernel=kernel)
        rows = layer.dequantize_rows(ids)
        assert rows.shape == (4, in_f) and rows.dtype == torch.float32
        # (d * q + m here, d * (q - 8) there: the same value, rounded differently)
        np.testing.assert_allclose(rows.numpy(), w[ids.numpy()], rtol=0, atol=1e-6 * scale)
    np.testing.assert_allclose(dequantize_torch(qtype, torch.from_numpy(raw), in_f).numpy(), w,
                               rtol=0, atol=1e-6 * scale)


def test_dequantize_rows_rejects_ids_outside_the_table():
    layer = QuantLinear(QuantType.Q8_0, random_weight(QuantType.Q8_0, 4, 32), (4, 32))
    with pytest.raises(IndexError):
        layer.dequantize_rows(torch.tensor([4]))
    assert layer.dequantize_rows(torch.tensor([], dtype=torch.int64)).shape == (0, 32)


# The code paths of other machines, built here: the portable C of a CPU without AVX2 or NEON,
# the VNNI dot products of AVX-512 / AVX-VNNI CPUs (dpbusd computed in C), AVX2 without VNNI,
# and the 4 x 4 tiles that AVX-512 and aarch64 builds use. 37 weight rows keep the GGUF
# layout, 40 are interleaved by 8 where the build has that layout.
@needs_kernel
@pytest.mark.parametrize("defines", [("LOOM_QUANT_GENERIC",),
                                     ("LOOM_QUANT_EMULATE_VNNI", "LOOM_QUANT_R=2",
                                      "LOOM_QUANT_C=2", "LOOM_QUANT_X8_R=2"),
                                     ("LOOM_QUANT_NO_VNNI",),
                                     ("LOOM_QUANT_R=4", "LOOM_QUANT_C=4")],
                         ids=["portable", "vnni", "avx2", "tile4x4"])
def test_other_machines_code_paths(defines):
    kernel = QuantKernel.load(defines)
    assert kernel is not None
    for qtype in QuantType:
        in_f = IN_FEATURES[qtype][0]
        for out_f in (37, 40):
            raw = random_weight(qtype, out_f, in_f)
            x = np.random.default_rng(3).standard_normal((9, in_f)).astype(np.float32)
            check_against_reference(QuantLinear(qtype, raw, (out_f, in_f), kernel=kernel,
                                                float_rows=None), raw, x)
            check_float_path(QuantLinear(qtype, raw, (out_f, in_f), kernel=kernel,
                                         float_rows=1), raw, x)


@needs_kernel
@pytest.mark.parametrize("qtype", [QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0,
                                   QuantType.Q8_0, QuantType.Q4_K, QuantType.Q5_K,
                                   QuantType.Q6_K],
                         ids=lambda q: q.name)
def test_rows_interleaved_by_8_give_the_gguf_layouts_numbers(qtype):
    # On AVX2 these formats are stored 8 rows interleaved (quant_linear.c's QL_X8) when the
    # rows are a multiple of 8: the same products, summed in another order.
    in_f = IN_FEATURES[qtype][1]
    raw = random_weight(qtype, 48, in_f)
    interleaved = QuantLinear(qtype, raw, (48, in_f), float_rows=None)
    plain = QuantLinear(qtype, raw, (48, in_f), float_rows=None, interleave=False)
    assert not plain.interleaved
    assert interleaved.interleaved == KERNEL.isa.startswith("AVX2")
    assert not QuantLinear(qtype, random_weight(qtype, 44, in_f), (44, in_f)).interleaved
    x = torch.randn(600, in_f)
    # float32 rounding of sums in another order, against outputs up to ~1000 (Q6_K's scales)
    atol = max(1e-4, 1e-6 * float(plain(x[:64]).abs().max()))
    for rows in (1, 3, 17, 64):
        torch.testing.assert_close(interleaved(x[:rows]), plain(x[:rows]), rtol=1e-5, atol=atol)
    interleaved.float_rows = plain.float_rows = 1  # the float32 path: its panels too
    for rows in (1, 130, 600):
        torch.testing.assert_close(interleaved(x[:rows]), plain(x[:rows]), rtol=1e-5, atol=atol)
    ids = torch.tensor([0, 7, 8, 47, 13])
    assert torch.equal(interleaved.dequantize_rows(ids), plain.dequantize_rows(ids))
    w = reference_weight(qtype, raw, 48)
    np.testing.assert_allclose(interleaved.dequantize().numpy(), w, rtol=0,
                               atol=1e-6 * np.abs(w).max())


@needs_kernel
def test_bias_leading_dims_strided_and_bfloat16_inputs():
    raw = random_weight(QuantType.Q4_1, 40, 64)
    bias = torch.randn(40)
    layer = QuantLinear(QuantType.Q4_1, raw, (40, 64), bias=bias)
    plain = QuantLinear(QuantType.Q4_1, raw, (40, 64))
    floats = QuantLinear(QuantType.Q4_1, raw, (40, 64), bias=bias, float_rows=1)
    wide = torch.randn(2, 3, 100)
    x = wide[..., 10:74]  # rows not contiguous with each other
    y = layer(x)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, plain(x.reshape(6, 64)).view(2, 3, 40) + bias)
    w = torch.from_numpy(reference_weight(QuantType.Q4_1, raw, 40)).float()
    torch.testing.assert_close(floats(x), x @ w.T + bias, rtol=1e-5, atol=1e-5)
    yb = layer(x.to(torch.bfloat16))
    assert yb.dtype == torch.bfloat16
    assert layer(torch.empty(0, 64)).shape == (0, 40)


def test_shape_and_size_mismatches_are_refused():
    raw = random_weight(QuantType.Q4_K, 4, 256)
    with pytest.raises(ValueError, match="whole blocks"):
        QuantLinear(QuantType.Q4_K, raw, (8, 128))
    with pytest.raises(ValueError, match="bytes"):
        QuantLinear(QuantType.Q4_K, raw, (8, 256))
    assert quant_linear.quant_type("q6_k") is QuantType.Q6_K
    assert quant_linear.quant_type(gguf.GGMLQuantizationType.Q8_0) is QuantType.Q8_0


# -- the default model's own tensors -----------------------------------------------------------


def _smollm2_gguf() -> str | None:
    from pipelines.checkpoint.default_model import find_gguf
    try:
        return find_gguf()
    except (ImportError, FileNotFoundError):
        return None


@needs_kernel
@pytest.mark.skipif(_smollm2_gguf() is None, reason="the SmolLM2 GGUF file is not installed")
def test_smollm2_gguf_tensors():
    reader = gguf.GGUFReader(_smollm2_gguf())
    tensors = {t.name: t for t in reader.tensors}
    rng = np.random.default_rng(4)
    for name in ("blk.0.ffn_down.weight", "blk.0.attn_k.weight"):
        t = tensors[name]
        in_f, out_f = (int(n) for n in t.shape)  # GGUF lists the input width first
        layer = quant_linear.quant_linear(t.tensor_type, t.data, (out_f, in_f))
        assert layer.qtype is QuantType.Q4_1
        x = rng.standard_normal((5, in_f)).astype(np.float32)
        check_against_reference(layer, np.asarray(t.data), x)
    # The tied embedding / lm_head table (Q8_0): rows looked up, and a slice used as a head.
    t = tensors["token_embd.weight"]
    hidden, vocab = (int(n) for n in t.shape)
    table = QuantLinear(t.tensor_type, t.data, (vocab, hidden))
    ids = torch.tensor([0, 1, 12345, vocab - 1])
    expected = reference_weight(table.qtype, np.asarray(t.data[ids.numpy()]), len(ids))
    np.testing.assert_allclose(table.dequantize_rows(ids).numpy(), expected, rtol=0, atol=1e-6)
    head = np.asarray(t.data[:1000])
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    check_against_reference(QuantLinear(t.tensor_type, head, (1000, hidden)), head, x)
