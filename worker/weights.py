"""Reading a Hugging Face checkpoint directory's weights (safetensors, or torch .bin)."""

from __future__ import annotations

import glob
import os

import torch


def load_checkpoint_weights(model_dir: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for path in files:
            weights.update(load_file(path))
        return weights
    files = sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")))
    if files:
        weights = {}
        for path in files:
            weights.update(torch.load(path, map_location="cpu", weights_only=True))
        return weights
    raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {model_dir}")


def empty_embedding(num: int, dim: int) -> torch.nn.Embedding:
    """An embedding without its random init: built on the meta device, that init (normal_)
    goes through torch._refs, whose first use imports torch._dynamo (~2 s of start-up)."""
    return torch.nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def materialize_on_cpu(model: torch.nn.Module) -> None:
    """Give the meta-device parameters uninitialised CPU memory, keeping tied ones tied.
    (`Module.to_empty` does this through torch._refs, whose first use imports sympy: ~0.6 s.)"""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in done:
                done[id(param)] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype), requires_grad=False)
            setattr(module, name, done[id(param)])
    left = [name for name, buf in model.named_buffers() if buf.is_meta]
    if left:
        raise RuntimeError(f"buffers left on the meta device: {left}")
