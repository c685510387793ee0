"""Large, long-lived tensors (packed weights, the KV cache) in their own anonymous mappings,
which the kernel may back with 2 MiB transparent huge pages.

Every decode step streams all the weights; with 4 KiB pages that is a TLB miss every 64 cache
lines. Where transparent huge pages are in `madvise` mode
(the common default) memory must ask for them, which plain torch allocations never do.
"""

from __future__ import annotations

import mmap

import torch


def empty_tensor(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """A tensor in its own anonymous mapping (zero-filled by the kernel on first touch),
    advised for huge pages if `huge`. The mapping lives as long as the tensor."""
    count = 1
    for dim in shape:
        count *= dim
    nbytes = max(1, count * torch.tensor([], dtype=dtype).element_size())
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # kernels without THP: ordinary pages
            pass
    tensor = torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)
    tensor._loom_buffer = buffer  # the tensor does not own the mapping: keep it alive with it
    return tensor
