"""Micro-benchmark: the quantized linear kernels (worker/quant_linear.py) against the packed
float32 GEMM (worker/packed_linear.py) on SmolLM2-135M's shapes, and the memory bandwidth
that bounds a one-row decode.

    .venv/bin/python -m bench.quant_linear [--rows 1 16 64 512] [--formats Q4_1 Q8_0 Q4_K]
    .venv/bin/python -m bench.quant_linear --layouts 1 16 64 [--repeats N]

A "token" at one row is the model's linear layers in order: 30 layers x (q, k, v, o, gate, up,
down), each with its own weights as in the real model (so they come from memory, not from a
cache that a loop over one layer would keep them in), then the 49152 x 576 lm_head. Timings
are medians of repeats taken in turns (quantized, float32, quantized, ...), since the cores
are shared with other work. The whole-model rows print bytes of weights read per token and
the GB/s that makes, beside a STREAM-like read bandwidth (a multi-threaded sum over 400 MB).

QuantLinear takes its integer path below 128 rows and its float32 path from 128 rows on (its
FLOAT_ROWS), so the 512-row lines are the float32 path; the per-shape table shows both paths.
Q4_K needs rows of 256 values: SmolLM2's 576-wide inputs are not, so its Q4_K rows use a
256-multiple stand-in (512 and 1536 inputs; the lm_head 49152 x 512), stated in the table.
Weights are random valid blocks: the kernels' speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

from worker.packed_linear import PackedLinear, packed_linear_available
from worker.quant_linear import BLOCK_LAYOUT, QuantLinear, QuantType, default_kernel

HIDDEN, INTERMEDIATE, VOCAB, LAYERS, KV_WIDTH = 576, 1536, 49152, 30, 192
DIRECT = "the mix, kernel calls only (ctypes)"
# (name, out_features, in_features) of one decoder layer, in the order a forward pass runs them.
LAYER_SHAPES = [("q", HIDDEN, HIDDEN), ("k", KV_WIDTH, HIDDEN), ("v", KV_WIDTH, HIDDEN),
                ("o", HIDDEN, HIDDEN), ("gate", INTERMEDIATE, HIDDEN),
                ("up", INTERMEDIATE, HIDDEN), ("down", HIDDEN, INTERMEDIATE)]


def random_blocks(qtype: QuantType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with small, finite float16 scales where each format keeps them."""
    elements, nbytes = BLOCK_LAYOUT[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // elements, nbytes), dtype=np.uint8)
    scale_offsets = {QuantType.Q6_K: [208], QuantType.Q4_1: [0, 2], QuantType.Q5_1: [0, 2],
                     QuantType.Q4_K: [0, 2], QuantType.Q5_K: [0, 2]}.get(qtype, [0])
    for offset in scale_offsets:
        scales = (rng.random((rows, cols // elements)) * 1e-3).astype(np.float16)
        raw[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def stand_in(qtype: QuantType, features: int) -> int:
    """`features` rounded down to whole blocks of the format (Q4_K: 576 -> 512)."""
    elements = BLOCK_LAYOUT[qtype][0]
    return max(elements, features // elements * elements)


def model_layers(qtype: QuantType | None, rng: np.random.Generator, interleave: bool = True):
    """[[q, k, v, o, gate, up, down] x 30], lm_head: QuantLinear, or PackedLinear for None."""
    def make(out_f: int, in_f: int):
        if qtype is None:
            return PackedLinear(nn.Linear(in_f, out_f, bias=False))
        in_f = stand_in(qtype, in_f)
        return QuantLinear(qtype, random_blocks(qtype, out_f, in_f, rng), (out_f, in_f),
                           interleave=interleave)
    layers = [[make(o, i) for _, o, i in LAYER_SHAPES] for _ in range(LAYERS)]
    return layers, make(VOCAB, HIDDEN)


def weight_bytes(module) -> int:
    if isinstance(module, QuantLinear):
        return module.weight.numel()
    return module.packed.numel() * module.packed.element_size()


def in_features(module) -> int:
    return module.in_features


def token_pass(layers, head, rows: int):
    """A callable running every linear layer once on `rows` rows (fresh inputs per width)."""
    inputs = {}
    for module in [m for layer in layers for m in layer] + [head]:
        inputs.setdefault(in_features(module), torch.randn(rows, in_features(module)))

    def run():
        for layer in layers:
            for module in layer:
                module(inputs[module.in_features])
        head(inputs[head.in_features])
    return run


def direct_pass(layers, head, rows: int):
    """token_pass with the kernel called straight through ctypes (arguments prepared once, no
    nn.Module): what a decode loop driving the kernel from C would pay, near enough. (head:
    None for the layers alone.)"""
    calls = []
    for module in [m for layer in layers for m in layer] + ([head] if head else []):
        x = torch.randn(rows, module.in_features)
        y = torch.empty(rows, module.out_features)
        qtype, weight, row_bytes, bias = module._fixed
        calls.append((module.kernel.linear, x, y, (
            qtype, x.data_ptr(), module.in_features, weight, row_bytes, bias, y.data_ptr(),
            module.out_features, rows, module.out_features, module.in_features)))

    def run():
        for fn, _, _, args in calls:
            fn(*args)
    return run


def medians(callables: dict, repeats: int) -> dict:
    """Median seconds of each callable, timed in turns."""
    times = {name: [] for name in callables}
    for fn in callables.values():  # warm-up: first-touch, lazy builds
        fn()
    for _ in range(repeats):
        for name, fn in callables.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def read_bandwidth() -> float:
    """GB/s of a multi-threaded sum over 400 MB (far beyond the caches): what a one-row decode
    can at best stream its weights at."""
    data = torch.ones(100_000_000, dtype=torch.float32)
    best = []
    for _ in range(7):
        start = time.perf_counter()
        data.sum()
        best.append(time.perf_counter() - start)
    return data.numel() * 4 / float(np.median(best)) / 1e9


def _call_on_random_rows(module, rows: int):
    x = torch.randn(rows, module.in_features)
    return lambda: module(x)


def per_shape_table(formats: list[QuantType], rows_list: list[int], repeats: int,
                    rng: np.random.Generator) -> None:
    print("\nOne layer at a time (its weights stay in cache between repeats), ms per call; "
          "formats take QuantLinear's default path, 'int8' / 'deq' force Q4_1's integer / "
          "float32 path:")
    shapes = [("q/o", HIDDEN, HIDDEN), ("k/v", KV_WIDTH, HIDDEN),
              ("gate/up", INTERMEDIATE, HIDDEN), ("down", HIDDEN, INTERMEDIATE),
              ("lm_head", VOCAB, HIDDEN)]
    names = [q.name for q in formats] + ["int8", "deq", "f32"]
    print(f"{'shape':>8} {'out x in':>12} {'rows':>5} " + " ".join(f"{n:>8}" for n in names))
    for name, out_f, in_f in shapes:
        modules = {q.name: QuantLinear(q, random_blocks(q, out_f, stand_in(q, in_f), rng),
                                       (out_f, stand_in(q, in_f))) for q in formats}
        q4_1 = random_blocks(QuantType.Q4_1, out_f, in_f, rng)
        modules["int8"] = QuantLinear(QuantType.Q4_1, q4_1, (out_f, in_f), float_rows=None)
        modules["deq"] = QuantLinear(QuantType.Q4_1, q4_1, (out_f, in_f), float_rows=1)
        modules["f32"] = PackedLinear(nn.Linear(in_f, out_f, bias=False))
        for rows in rows_list:
            calls = {key: _call_on_random_rows(module, rows) for key, module in modules.items()}
            reps = max(3, repeats * 4 // max(1, rows // 16))
            t = medians(calls, reps)
            print(f"{name:>8} {out_f:>5} x {in_f:<5} {rows:>5} " + " ".join(
                f"{t[k] * 1e3:8.3f}" for k in list(modules)))


def call_overhead(repeats: int) -> float:
    """Seconds per call of a 1 x 32 -> 32 layer: the fixed cost (Python, ctypes, the OpenMP
    fork and join) that each of a token's 211 calls pays beside its arithmetic."""
    layer = QuantLinear(QuantType.Q8_0, random_blocks(QuantType.Q8_0, 32, 32,
                                                      np.random.default_rng(0)), (32, 32))
    x = torch.randn(1, 32)
    t = medians({"call": lambda: [layer(x) for _ in range(211)]}, repeats)
    return t["call"] / 211


def prefill_paths(rows_list: list[int], repeats: int, rng: np.random.Generator) -> None:
    """Q4_1's 30 layers (no lm_head) at prefill row counts: QuantLinear's integer path against
    its dequantized float32 panels, beside packed float32, timed in turns."""
    layers, _ = model_layers(QuantType.Q4_1, rng)
    f32_layers, _ = model_layers(None, rng)
    modules = [m for layer in layers for m in layer]
    no_head = nn.Identity()
    no_head.in_features = HIDDEN

    def with_float_rows(run, float_rows):
        def timed():
            for m in modules:
                m.float_rows = float_rows
            run()
        return timed
    print("\nQ4_1 layers at prefill rows, ms per pass (integer path / dequantized panels):")
    print(f"{'rows':>5} {'int8':>8} {'panels':>8} {'f32':>8} {'int8/panels':>12}")
    for rows in rows_list:
        run = token_pass(layers, no_head, rows)
        t = medians({"int8": with_float_rows(run, None), "panels": with_float_rows(run, 1),
                     "f32": token_pass(f32_layers, no_head, rows)}, repeats)
        print(f"{rows:>5} {t['int8'] * 1e3:8.1f} {t['panels'] * 1e3:8.1f} {t['f32'] * 1e3:8.1f} "
              f"{t['int8'] / t['panels']:12.3f}")
    for m in modules:
        m.float_rows = QuantLinear.FLOAT_ROWS


def layouts(rows_list: list[int], repeats: int, rng: np.random.Generator) -> None:
    """The GGUF file's mix (Q4_1 layers, Q8_0 lm_head) with rows interleaved by 8 (the
    default where the kernel has that layout) against the GGUF layout, kernel calls only."""
    mixes = {}
    for interleave in (True, False):
        layers, _ = model_layers(QuantType.Q4_1, rng, interleave)
        head = QuantLinear(QuantType.Q8_0, random_blocks(QuantType.Q8_0, VOCAB, HIDDEN, rng),
                           (VOCAB, HIDDEN), interleave=interleave, float_rows=None)
        mixes[interleave] = (layers, head)
    no_layers: list = []
    print("\nQ4_1 layers + Q8_0 lm_head, ms per step (interleaved by 8 / GGUF layout):")
    print(f"{'rows':>5} {'layers x8':>10} {'layers':>8} {'ratio':>6} {'head x8':>8} "
          f"{'head':>7} {'ratio':>6}")
    for rows in rows_list:
        t = medians({
            "layers x8": direct_pass(mixes[True][0], None, rows),
            "layers": direct_pass(mixes[False][0], None, rows),
            "head x8": direct_pass(no_layers, mixes[True][1], rows),
            "head": direct_pass(no_layers, mixes[False][1], rows)}, repeats)
        print(f"{rows:>5} {t['layers x8'] * 1e3:10.2f} {t['layers'] * 1e3:8.2f} "
              f"{t['layers x8'] / t['layers']:6.2f} {t['head x8'] * 1e3:8.2f} "
              f"{t['head'] * 1e3:7.2f} {t['head x8'] / t['head']:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512])
    parser.add_argument("--formats", nargs="+", default=["Q4_1", "Q8_0", "Q4_K"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-shapes", action="store_true", help="only the whole-model rows")
    parser.add_argument("--prefill-paths", type=int, nargs="+", metavar="ROWS",
                        help="only compare Q4_1's two paths at these row counts")
    parser.add_argument("--layouts", type=int, nargs="+", metavar="ROWS",
                        help="only compare rows interleaved by 8 with the GGUF layout")
    args = parser.parse_args()
    formats = [QuantType[f.upper()] for f in args.formats]
    kernel = default_kernel()
    rng = np.random.default_rng(0)
    print(f"quantized kernel: {kernel.isa if kernel else 'none (PyTorch path)'}; packed float32: "
          f"{'yes' if packed_linear_available(torch.float32) else 'no'}; "
          f"threads: {torch.get_num_threads()}")
    bandwidth = read_bandwidth()
    print(f"read bandwidth (torch sum over 400 MB): {bandwidth:.1f} GB/s")
    if args.prefill_paths:
        prefill_paths(args.prefill_paths, args.repeats, rng)
        return
    if args.layouts:
        layouts(args.layouts, args.repeats, rng)
        return
    overhead = call_overhead(args.repeats)
    print(f"fixed cost per QuantLinear call: {overhead * 1e6:.1f} us "
          f"(x 211 calls = {overhead * 211e3:.2f} ms of each one-row token below)")

    models = {q.name: model_layers(q, rng) for q in formats}
    models["f32"] = model_layers(None, rng)
    smol = "Q4_1+Q8_0 head (the GGUF file's mix)"
    models[smol] = (models["Q4_1"][0], models["Q8_0"][1]) if {"Q4_1", "Q8_0"} <= set(models) \
        else None
    models = {k: v for k, v in models.items() if v is not None}
    print("\nWhole model's linear layers (30 x 7 + lm_head), per step:")
    print(f"{'weights':>38} {'rows':>5} {'MB/step':>8} {'ms/step':>8} {'ms/token':>9} "
          f"{'GB/s':>6}")
    for rows in args.rows:
        calls = {name: token_pass(layers, head, rows) for name, (layers, head) in models.items()}
        if rows == 1 and smol in models:
            calls[DIRECT] = direct_pass(*models[smol], rows)
        reps = args.repeats if rows <= 64 else max(3, args.repeats // 2)
        t = medians(calls, reps)
        for name in calls:
            layers, head = models[smol if name == DIRECT else name]
            nbytes = sum(weight_bytes(m) for layer in layers for m in layer) + weight_bytes(head)
            note = " (256-multiple inputs)" if name == "Q4_K" else ""
            print(f"{name + note:>38} {rows:>5} {nbytes / 1e6:8.1f} {t[name] * 1e3:8.2f} "
                  f"{t[name] * 1e3 / rows:9.3f} {nbytes / t[name] / 1e9:6.1f}")
    if not args.skip_shapes:
        per_shape_table(formats, args.rows, args.repeats, rng)


if __name__ == "__main__":
    main()
