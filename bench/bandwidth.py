"""The machine's memory bandwidth, measured as STREAM does, which a batch-1 decode step is
held to: it reads every weight once, so its time can be no less than the weights' bytes over
the read bandwidth.

    .venv/bin/python -m bench.bandwidth [--mib 512] [--repeats 11] [--threads 1 2]

Each kernel (bench/bandwidth.c, built here with the worker kernels' compiler flags) runs on a
buffer far beyond the last-level cache, with 1 and 2 threads, the rounds taken in turns so
that the machine's drift (it is shared) falls on all alike:
Buffers are in huge pages where the kernel gives them (as the model's weights are).
- read: every float of the buffer summed once (the weights' traffic of a GEMV);
- copy: memcpy of the buffer (STREAM's copy: bytes read + bytes written), and numpy's copyto
  as a cross-check of the C one;
- OpenMP barrier and fork/join of a 2-thread team, and a ctypes call of 12 arguments: the
  per-step overheads bench.decode_breakdown multiplies by their counts.
Medians and bests (STREAM reports the best) of the rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import tempfile
import time

import numpy as np
import torch

from bench.stats import median
from worker import hugepages

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bandwidth.c")


@functools.cache
def library() -> ctypes.CDLL:
    from worker.kernels import _compile

    target = os.path.join(tempfile.mkdtemp(prefix="loom-bandwidth-"), "bandwidth.so")
    _compile(_SOURCE, target)
    lib = ctypes.CDLL(target)
    lib.bw_read.restype = ctypes.c_double
    lib.bw_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.bw_copy.restype = None
    lib.bw_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    for fn in (lib.bw_barrier, lib.bw_fork_join):
        fn.restype = ctypes.c_double
        fn.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.bw_noop12.restype = ctypes.c_int
    lib.bw_noop12.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return lib


def measure(mib: int = 512, repeats: int = 11, threads: tuple[int, ...] = (1, 2),
            clock=time.perf_counter) -> dict:
    """GB/s (1e9 bytes) of read and copy per thread count, and the overheads' microseconds.
    `clock`: time.thread_time for one thread's CPU time (what other processes' use of the
    cores does not inflate; then measure one thread only)."""
    lib = library()
    n = mib * (1 << 20) // 4
    # In huge pages where the kernel gives them, as the weights are (worker/hugepages.py).
    src = hugepages.empty_tensor((n,), torch.float32).numpy()
    dst = hugepages.empty_tensor((n,), torch.float32).numpy()
    src.fill(1.0)
    dst.fill(0.0)  # (both written once: their pages are mapped now)
    bytes_ = n * 4
    units = {}
    for t in threads:
        units[f"read_{t}t"] = (bytes_, functools.partial(lib.bw_read, src.ctypes.data, n, t))
        units[f"copy_{t}t"] = (2 * bytes_, functools.partial(
            lib.bw_copy, dst.ctypes.data, src.ctypes.data, n, t))
    units["numpy_copy"] = (2 * bytes_, functools.partial(np.copyto, dst, src))
    times: dict[str, list[float]] = {name: [] for name in units}
    for _ in range(repeats):
        for name, (_, fn) in units.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    result = {"buffer_mib": mib, "repeats": repeats}
    for name, (moved, _) in units.items():
        result[name] = {"gb_s_median": moved / median(times[name]) / 1e9,
                        "gb_s_best": moved / min(times[name]) / 1e9}
    result["overheads_us"] = overheads(lib, repeats)
    return result


def overheads(lib: ctypes.CDLL, repeats: int) -> dict:
    """Microseconds: a 2-thread barrier, a 2-thread fork/join, a 12-argument ctypes call."""
    barrier = [lib.bw_barrier(2000, 2) for _ in range(repeats)]
    fork = [lib.bw_fork_join(2000, 2) for _ in range(repeats)]
    args = (None, None, 0, None, None, None, 0, None, None, None, None, 0)
    calls = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(2000):
            lib.bw_noop12(*args)
        calls.append((time.perf_counter() - start) / 2000)
    return {"barrier_2t": median(barrier) * 1e6, "fork_join_2t": median(fork) * 1e6,
            "ctypes_call_12_args": median(calls) * 1e6}


def report(result: dict) -> str:
    lines = [f"buffer {result['buffer_mib']} MiB, {result['repeats']} rounds "
             f"(GB/s = 1e9 bytes/s; copy counts bytes read + written)"]
    for name, value in result.items():
        if isinstance(value, dict) and "gb_s_median" in value:
            lines.append(f"  {name:<11} median {value['gb_s_median']:6.1f} GB/s, "
                         f"best {value['gb_s_best']:6.1f}")
    over = result["overheads_us"]
    lines.append(f"  barrier (2 threads) {over['barrier_2t']:.2f} us, fork/join "
                 f"{over['fork_join_2t']:.2f} us, ctypes call (12 args) "
                 f"{over['ctypes_call_12_args']:.2f} us")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="buffer size (>> the LLC)")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print(report(measure(args.mib, args.repeats, tuple(args.threads))))


if __name__ == "__main__":
    main()
