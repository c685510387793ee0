"""Reading a Hugging Face checkpoint directory's weights (safetensors, or torch .bin)."""

from __future__ import annotations

import glob
import os

import torch

from pipelines.progress import Progress


def load_checkpoint_weights(model_dir: str) -> dict[str, torch.Tensor]:
    # (Tensor by tensor, as safetensors' load_file reads them, so a large checkpoint's
    # minutes show progress.)
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        from safetensors import safe_open

        total = 0
        for path in files:
            with safe_open(path, framework="pt") as f:
                total += len(f.keys())
        weights: dict[str, torch.Tensor] = {}
        with Progress(f"loading the weights of {model_dir}", total=total,
                      unit="tensors") as progress:
            for path in files:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():
                        weights[name] = f.get_tensor(name)
                        progress.advance()
        return weights
    files = sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")))
    if files:
        weights = {}
        with Progress(f"loading the weights of {model_dir}", total=len(files),
                      unit="files") as progress:
            for path in files:
                weights.update(torch.load(path, map_location="cpu", weights_only=True))
                progress.advance()
        return weights
    raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {model_dir}")


def empty_embedding(num: int, dim: int) -> torch.nn.Embedding:
    """An embedding without its random init: built on the meta device, that init (normal_)
    goes through torch._refs, whose first use imports torch._dynamo (~2 s of start-up)."""
    return torch.nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def materialize_on_cpu(model: torch.nn.Module) -> None:
    """Give the meta-device parameters uninitialised CPU memory, keeping tied ones tied; those
    already loaded (a GGUF file's float tensors) are kept.
    (`Module.to_empty` does this through torch._refs, whose first use imports sympy: ~0.6 s.)"""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            if id(param) not in done:
                done[id(param)] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype), requires_grad=False)
            setattr(module, name, done[id(param)])
    left = [name for name, buf in model.named_buffers() if buf.is_meta]
    if left:
        raise RuntimeError(f"buffers left on the meta device: {left}")
