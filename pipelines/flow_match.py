"""FLUX's flow-matching schedule and latent packing, in numpy.

These are the numbers diffusers' FluxPipeline computes with FlowMatchEulerDiscreteScheduler and
its `_pack_latents` / `_prepare_latent_image_ids` (diffusers 0.42), computed the same way (the
same dtypes at each stage) so that a PixelContext built here runs the same steps; the API
process, which loads no PyTorch, builds them, and tests compare them with diffusers' own.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# The scheduler options that change sigmas in ways this module does not reproduce.
_UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                "invert_sigmas", "use_flow_sigmas", "stochastic_sampling")


def check_scheduler_config(config: dict[str, Any]) -> None:
    for key in _UNSUPPORTED:
        if config.get(key):
            raise ValueError(f"scheduler option {key} is not supported")


def calculate_shift(image_seq_len: int, config: dict[str, Any]) -> float:
    """mu, the resolution-dependent shift: linear in the number of latent patches."""
    base_seq_len = config.get("base_image_seq_len", 256)
    max_seq_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def flow_match_schedule(num_inference_steps: int, image_seq_len: int,
                        config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(timesteps [steps], sigmas [steps + 1] ending at 0), float32, as FluxPipeline sets them."""
    check_scheduler_config(config)
    n = num_inference_steps
    sigmas = np.linspace(1.0, 1 / n, n).astype(np.float32)
    if config.get("use_dynamic_shifting", False):
        mu = calculate_shift(image_seq_len, config)
        if config.get("time_shift_type", "exponential") == "linear":
            sigmas = mu / (mu + (1 / sigmas - 1) ** 1.0)
        else:
            sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)
    else:
        shift = config.get("shift", 1.0)
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    if config.get("shift_terminal"):
        one_minus = 1 - sigmas
        scale = one_minus[-1] / (1 - config["shift_terminal"])
        sigmas = 1 - (one_minus / scale)
    sigmas = np.asarray(sigmas, dtype=np.float32)
    timesteps = (sigmas * np.float32(config.get("num_train_timesteps", 1000))).astype(np.float32)
    return timesteps, np.concatenate([sigmas, np.zeros(1, dtype=np.float32)])


def latent_grid(height: int, width: int, vae_scale_factor: int) -> tuple[int, int]:
    """The unpacked latent's (height, width): the VAE's downsampling, rounded down to even so
    that 2x2 patches tile it."""
    return (2 * (height // (vae_scale_factor * 2)), 2 * (width // (vae_scale_factor * 2)))


def pack_latents(latents: np.ndarray) -> np.ndarray:
    """[B, C, H, W] -> [B, (H/2)*(W/2), 4C]: 2x2 patches as tokens."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(x.reshape(b, (h // 2) * (w // 2), c * 4))


def latent_image_ids(latent_height: int, latent_width: int) -> np.ndarray:
    """[(H/2)*(W/2), 3] float32: (0, row, column) of each patch, for the rotary embedding."""
    h, w = latent_height // 2, latent_width // 2
    ids = np.zeros((h, w, 3), dtype=np.float32)
    ids[..., 1] = np.arange(h, dtype=np.float32)[:, None]
    ids[..., 2] = np.arange(w, dtype=np.float32)[None, :]
    return ids.reshape(h * w, 3)
