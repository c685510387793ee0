"""The all-reduce of CPU ranks through shared memory (`worker/kernels/shm_allreduce.c`).

A file in the server's private IPC directory, mapped by every rank: rank 0 creates it at
its size, the others map it once a barrier says it exists. Float32 tensors of at most the
largest step's [tokens, hidden] go through it; anything else (and every call where the kernel
could not be built) takes gloo's all-reduce.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

from worker.kernels import load_kernel

_lib = load_kernel("shm_allreduce")
if _lib is not None:
    _lib.loom_shm_allreduce_f32.restype = None
    _lib.loom_shm_allreduce_f32.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_int64]
    _lib.loom_shm_allreduce_bytes.restype = ctypes.c_int64
    _lib.loom_shm_allreduce_bytes.argtypes = [ctypes.c_int, ctypes.c_int64]

MAX_RANKS = 64  # (the kernel's flag header)


def available(size: int) -> bool:
    return _lib is not None and 1 < size <= MAX_RANKS


class SharedMemoryAllReduce:
    """Sums float32 tensors over `size` ranks on one machine; `barrier` is the process
    group's, used once so that the file exists before the other ranks open it."""

    def __init__(self, path: str, rank: int, size: int, max_floats: int, barrier) -> None:
        self.rank, self.size, self.max_floats = rank, size, max_floats
        nbytes = _lib.loom_shm_allreduce_bytes(size, max_floats)
        if rank == 0:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, nbytes)  # (zero-filled: every rank's flag starts at 0)
            barrier()
        else:
            barrier()
            fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._seq = 0

    def __call__(self, x: torch.Tensor) -> bool:
        """Sum `x` over the ranks in place; False (nothing done) if it does not fit."""
        if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() > self.max_floats \
                or x.device.type != "cpu":
            return False
        self._seq += 1
        _lib.loom_shm_allreduce_f32(self._base, self.rank, self.size, self._seq, x.data_ptr(),
                                    x.numel(), self.max_floats)
        return True
