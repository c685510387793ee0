"""PixelGenerationTokenizer: builds the PixelContext of an image request in the API process.

A diffusers-format FLUX directory (model_index.json) has two tokenizers: tokenizer/ (CLIP-like,
whose encoder gives the pooled embedding) and tokenizer_2/ (T5-like, the sequence the
transformer attends to). Both are padded to their fixed lengths as FluxPipeline pads them. The
schedule and the seeded initial noise are computed here too (pipelines/flow_match.py), so the
worker gets nothing but numbers and runs the text encoders once per request.
"""

from __future__ import annotations

import json
import os

import msgspec
import numpy as np

from api_server.protocol import RequestError
from api_server.tokenizer import load_hf_tokenizer
from pipelines.flow_match import (
    check_scheduler_config,
    flow_match_schedule,
    latent_grid,
    latent_image_ids,
    pack_latents,
)
from pipelines.pixel_context import PixelContext

MAX_STEPS = 100
T5_MAX_LENGTH = 512  # FluxPipeline's max_sequence_length (and its upper bound)
MAX_IMAGES = 4
# Sizes are multiples of this: the VAE's 8x downsampling times FLUX's 2x2 patches.
SIZE_MULTIPLE = 16


class PixelGenerationRequest(msgspec.Struct, kw_only=True):
    prompt: str
    negative_prompt: str | None = None
    height: int = 1024
    width: int = 1024
    num_inference_steps: int = 28
    guidance_scale: float = 3.5
    true_cfg_scale: float = 1.0
    num_images_per_prompt: int = 1
    seed: int | None = None
    request_id: str | None = None
    model_name: str = ""


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


class PixelGenerationTokenizer:
    def __init__(self, model_dir: str, max_sequence_length: int = T5_MAX_LENGTH,
                 max_image_size: int = 2048) -> None:
        self.tokenizer = load_hf_tokenizer(os.path.join(model_dir, "tokenizer"))
        self.tokenizer_2 = load_hf_tokenizer(os.path.join(model_dir, "tokenizer_2"))
        # FluxPipeline's lengths: CLIP's model_max_length (77), T5's max_sequence_length.
        self.max_length = int(self.tokenizer.model_max_length)
        self.max_length_2 = max_sequence_length
        self.pad_id_2 = self.tokenizer_2.pad_token_id
        self.scheduler_config = _read_json(os.path.join(model_dir, "scheduler",
                                                        "scheduler_config.json"))
        check_scheduler_config(self.scheduler_config)
        transformer = _read_json(os.path.join(model_dir, "transformer", "config.json"))
        vae = _read_json(os.path.join(model_dir, "vae", "config.json"))
        self.latent_channels = int(transformer["in_channels"]) // 4
        self.guidance_embeds = bool(transformer.get("guidance_embeds", False))
        self.vae_scale_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        self.max_image_size = max_image_size

    def _ids(self, tokenizer, text: str, max_length: int, param: str) -> np.ndarray:
        ids = tokenizer(text, padding="max_length", max_length=max_length, truncation=False,
                        return_attention_mask=False)["input_ids"]
        if len(ids) > max_length:  # FluxPipeline truncates with a warning; a client should know
            raise RequestError(f"{param} is {len(ids)} tokens, over the text encoder's "
                               f"{max_length}", param=param, code="prompt_too_long")
        return np.asarray(ids, dtype=np.int64)

    def _clip_ids(self, text: str) -> np.ndarray:
        # CLIP gives only the pooled embedding and holds 77 tokens; the T5 sequence carries
        # the whole prompt, so CLIP's ids are truncated as FluxPipeline truncates them.
        ids = self.tokenizer(text, padding="max_length", max_length=self.max_length,
                             truncation=True, return_attention_mask=False)["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    def check(self, request: PixelGenerationRequest) -> None:
        for name in ("height", "width"):
            value = getattr(request, name)
            if value > self.max_image_size:  # (the server's --max-image-size)
                raise RequestError(f"{name} {value} is over this model's largest, "
                                   f"{self.max_image_size}", param="size",
                                   code="image_too_large")
            if value < SIZE_MULTIPLE or value % SIZE_MULTIPLE:
                raise RequestError(f"{name} must be a multiple of {SIZE_MULTIPLE} from "
                                   f"{SIZE_MULTIPLE} to {self.max_image_size}, not {value}",
                                   param="size")
        if not 1 <= request.num_inference_steps <= MAX_STEPS:
            raise RequestError(f"steps must be from 1 to {MAX_STEPS}", param="steps")
        if not 1 <= request.num_images_per_prompt <= MAX_IMAGES:
            raise RequestError(f"n must be from 1 to {MAX_IMAGES}", param="n")

    def new_context(self, request: PixelGenerationRequest) -> PixelContext:
        self.check(request)
        negative = request.negative_prompt
        lh, lw = latent_grid(request.height, request.width, self.vae_scale_factor)
        # FluxPipeline's randn shape, unpacked, then packed as it packs it. numpy's generator:
        # the API process loads no PyTorch, so a seed gives the same image on every host.
        rng = np.random.default_rng(request.seed)
        noise = rng.standard_normal(
            (request.num_images_per_prompt, self.latent_channels, lh, lw), dtype=np.float32)
        latents = pack_latents(noise)
        timesteps, sigmas = flow_match_schedule(request.num_inference_steps, latents.shape[1],
                                                self.scheduler_config)
        fields = {} if request.request_id is None else {"request_id": request.request_id}
        return PixelContext(
            tokens=self._clip_ids(request.prompt),
            tokens_2=self._ids(self.tokenizer_2, request.prompt, self.max_length_2, "prompt"),
            negative_tokens=None if negative is None else self._clip_ids(negative),
            negative_tokens_2=None if negative is None else self._ids(
                self.tokenizer_2, negative, self.max_length_2, "negative_prompt"),
            timesteps=timesteps, sigmas=sigmas, latents=latents,
            latent_image_ids=latent_image_ids(lh, lw),
            height=request.height, width=request.width,
            num_inference_steps=request.num_inference_steps,
            guidance_scale=request.guidance_scale,
            guidance=np.full(1, request.guidance_scale, dtype=np.float32)
            if self.guidance_embeds else None,
            true_cfg_scale=request.true_cfg_scale,
            num_images_per_prompt=request.num_images_per_prompt,
            model_name=request.model_name, **fields)
