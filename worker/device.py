"""Where the worker runs the model (`--device auto|cpu|cuda`), and what follows from it.

On the CPU the model runs Loom's native kernels (worker/kernels/) where they apply and
PyTorch's elsewhere. On a CUDA device it runs PyTorch's: the weights, the KV cache and every
step's inputs live on the device; the step's logits come back to the host in one copy, where
sampling, grammars and log probabilities run as on the CPU. The voice and the embeddings model
always run on the CPU.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`auto`: the first CUDA device when PyTorch sees one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is visible to PyTorch "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: not cpu, cuda or auto")
    return device


def rank_device(name: str, rank: int) -> torch.device:
    """The device of rank `rank` of a split model (`name` as in `resolve_device`): on GPUs,
    rank r takes GPU r counted from the one asked for; CPU ranks share the CPU."""
    device = resolve_device(name)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The weights' dtype: as asked, else bfloat16 on a GPU and float32 on the CPU."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def place_on(model: torch.nn.Module, device: torch.device) -> None:
    """Move a built model to `device`: its parameters and buffers, and the rotary tables,
    which are plain float32 tensors so that a dtype change leaves them alone."""
    model.to(device)
    for module in model.modules():
        for name in ("cos", "sin"):
            table = getattr(module, name, None)
            if isinstance(table, torch.Tensor):
                setattr(module, name, table.to(device))


def gpu_kv_cache_budget(device: torch.device, utilization: float, profile) -> int:
    """Bytes left for the KV cache on a GPU (vLLM's rule): `utilization` of its memory, less
    the weights and the peak of a profiling forward (`profile()`, the largest step), less what
    others hold on the device (the CUDA context, other processes)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * utilization) - peak - others
    if budget <= 0:
        raise MemoryError(
            f"no GPU memory left for the KV cache: {total * utilization / 2**30:.1f} GiB "
            f"(--gpu-memory-utilization {utilization}) minus the weights and activations "
            f"({peak / 2**30:.1f} GiB) and others' use ({others / 2**30:.1f} GiB)")
    return budget
