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
