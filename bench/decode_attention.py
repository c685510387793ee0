"""`python -m bench.decode_attention`: the native paged decode-attention kernel alone, as a
decode step meets it: one call per layer, each layer's K/V in its own blocks (scattered, as
the block manager hands them out), and a sweep over a layer's worth of weights between calls
so the K/V come from memory, not from the caches (in a step the weights have just streamed
through them).

Prints ms per step (all layers' attention; median over the rounds) for each thread count,
context length and batch size. The default shape is SmolLM2-135M's (30 layers, 9 query heads,
3 kv heads of 64, 16-token blocks) and its layers' 2.2 MB of weights.

    python -m bench.decode_attention --threads 1 2 --contexts 256 1024 --batches 1 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from worker.decode_attention import (
    native_decode_available,
    paged_decode_attention,
    set_kernel_threads,
)


def step_ms(context: int, batch: int, threads: int, rounds: int, layers: int = 30,
            heads: int = 9, kv_heads: int = 3, head_dim: int = 64, block_size: int = 16,
            layer_weights_mb: float = 2.2) -> float:
    rng = np.random.default_rng(0)
    per_seq = -(-context // block_size)
    num_blocks = per_seq * batch
    caches = [(torch.randn(num_blocks, block_size, kv_heads, head_dim),
               torch.randn(num_blocks, block_size, kv_heads, head_dim)) for _ in range(layers)]
    tables = torch.from_numpy(rng.permutation(num_blocks).reshape(batch, per_seq)
                              .astype(np.int32))
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim)
    weights = [np.ones(int(layer_weights_mb * (1 << 20)) // 4, np.float32)
               for _ in range(layers)]
    set_kernel_threads(threads)
    times = []
    for r in range(rounds + 2):  # (the first two warm up)
        total = 0.0
        for (k, v), w in zip(caches, weights):
            w.sum()  # (the layer's weights stream through the caches)
            started = time.perf_counter()
            paged_decode_attention(q, k, v, tables, seq_lens, head_dim ** -0.5)
            total += time.perf_counter() - started
        if r >= 2:
            times.append(total)
    set_kernel_threads(torch.get_num_threads())
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    if not native_decode_available(torch.float32):
        raise SystemExit("the native kernels could not be built here")
    print("threads context batch  ms/step")
    for threads in args.threads:
        for context in args.contexts:
            for batch in args.batches:
                ms = step_ms(context, batch, threads, args.rounds)
                print(f"{threads:7d} {context:7d} {batch:5d} {ms:8.3f}", flush=True)


if __name__ == "__main__":
    main()
