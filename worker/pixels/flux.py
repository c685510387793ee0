"""FluxRunner: FLUX denoising steps batched across requests, each at its own step.

The model is diffusers' (FluxTransformer2DModel, AutoencoderKL, and transformers' CLIP and T5
encoders) loaded from a diffusers-format directory; what is Loom's is the batching. A request
is added once (its text encoders run then, and its latents move to the device), then every
`step` call runs one transformer forward over all the requests named, whatever step each is
at: each sample carries its own timestep and guidance, and a request with real CFG
(`true_cfg_scale` > 1 and a negative prompt) adds its negative half to the same call. The
Euler update is FlowMatchEulerDiscreteScheduler's, with each request's own sigmas. Requests
share a call only when their images have the same size (one set of image position ids);
`step` groups them. The transformer's forward is flux_forward.FluxForward: the same function
on the same weights, computed with less work per step (on a CPU a step is compute-bound).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from pipelines.pixel_context import PixelContext
from worker.pixels.flux_forward import FluxForward, rope_table


@dataclass
class _Request:
    ctx: PixelContext
    latents: torch.Tensor  # [n, seq, 4C], the model's dtype
    embeds: torch.Tensor  # T5 sequence [n, L, D]
    pooled: torch.Tensor  # CLIP pooled [n, P]
    neg_embeds: torch.Tensor | None
    neg_pooled: torch.Tensor | None
    rope: torch.Tensor  # the image rows' rotations (flux_forward.rope_table)
    sigmas: torch.Tensor  # float32 [steps + 1]
    timesteps: torch.Tensor  # float32 [steps]
    step: int = 0
    # The image the last step predicted (flow matching: x0 = x_t - sigma_t * v), what a
    # preview shows: the noisy x_t of an early step decodes to mostly noise.
    predicted: torch.Tensor | None = None


def _keep_position_bias(t5) -> None:
    """T5 rebuilds its relative position bias (buckets, embedding lookup, a permuted copy) on
    every call, two thirds of a 512-token encode on a CPU; it depends only on the lengths, so
    the first layer's is kept (the same values, contiguous) for the lengths last seen."""
    attn = t5.encoder.block[0].layer[0].SelfAttention
    compute = attn.compute_bias

    @functools.lru_cache(maxsize=2)
    def bias(query_length, key_length, device=None, past_seen_tokens=0):
        return compute(query_length, key_length, device=device,
                       past_seen_tokens=past_seen_tokens).contiguous()

    attn.compute_bias = bias


class FluxRunner:
    def __init__(self, model_dir: str, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        from diffusers import AutoencoderKL, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5EncoderModel

        def load(cls, sub):
            return cls.from_pretrained(os.path.join(model_dir, sub), dtype=dtype) \
                .to(device).eval()

        self.device, self.dtype = torch.device(device), dtype
        self.transformer = load(FluxTransformer2DModel, "transformer")
        self.forward = FluxForward(self.transformer)
        # Channels-last convolutions: a quarter less decode time on a CPU (oneDNN), same images.
        self.vae = load(AutoencoderKL, "vae").to(memory_format=torch.channels_last)
        self.text_encoder = load(CLIPTextModel, "text_encoder")
        self.text_encoder_2 = load(T5EncoderModel, "text_encoder_2")
        _keep_position_bias(self.text_encoder_2)
        with open(os.path.join(model_dir, "vae", "config.json")) as f:
            self.vae_scale_factor = 2 ** (len(json.load(f)["block_out_channels"]) - 1)
        self.requests: dict[str, _Request] = {}

    # ---- requests ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _encode(self, tokens: np.ndarray, tokens_2: np.ndarray,
                n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.from_numpy(np.array(tokens, dtype=np.int64)).to(self.device)[None]
        pooled = self.text_encoder(ids, output_hidden_states=False).pooler_output
        ids_2 = torch.from_numpy(np.array(tokens_2, dtype=np.int64)).to(self.device)[None]
        embeds = self.text_encoder_2(ids_2, output_hidden_states=False)[0]
        return (embeds.to(self.dtype).repeat(n, 1, 1), pooled.to(self.dtype).repeat(n, 1))

    def add(self, ctx: PixelContext) -> None:
        """Run the text encoders (once per request) and move its state to the device."""
        n = ctx.num_images_per_prompt
        embeds, pooled = self._encode(ctx.tokens, ctx.tokens_2, n)
        neg_embeds = neg_pooled = None
        if ctx.do_true_cfg:
            neg_embeds, neg_pooled = self._encode(ctx.negative_tokens, ctx.negative_tokens_2, n)

        def tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.array(a)).to(self.device, dtype)

        self.requests[ctx.request_id] = _Request(
            ctx=ctx, latents=tensor(ctx.latents, self.dtype), embeds=embeds, pooled=pooled,
            neg_embeds=neg_embeds, neg_pooled=neg_pooled,
            rope=rope_table(self.transformer, tensor(ctx.latent_image_ids, self.dtype)),
            sigmas=tensor(ctx.sigmas, torch.float32),
            timesteps=tensor(ctx.timesteps, torch.float32), step=ctx.step)

    def release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def steps_done(self, request_id: str) -> int:
        return self.requests[request_id].step

    # ---- steps ------------------------------------------------------------------------------
    def step(self, request_ids: list[str]) -> None:
        """One denoising step for each request named (each at its own step)."""
        groups: dict[tuple[int, int], list[_Request]] = {}
        for rid in request_ids:
            r = self.requests[rid]
            if r.step >= r.ctx.num_inference_steps:
                raise ValueError(f"request {rid} has no step left")
            groups.setdefault((r.ctx.height, r.ctx.width), []).append(r)
        for group in groups.values():
            self._step_group(group)

    @torch.inference_mode()
    def _step_group(self, group: list[_Request]) -> None:
        # Rows: every request's images, then the negative halves of those with real CFG.
        cfg = [r for r in group if r.neg_embeds is not None]
        rows = group + cfg
        latents = torch.cat([r.latents for r in rows])
        embeds = torch.cat([r.embeds for r in group] + [r.neg_embeds for r in cfg])
        pooled = torch.cat([r.pooled for r in group] + [r.neg_pooled for r in cfg])

        def per_row(value) -> torch.Tensor:
            return torch.cat([value(r).expand(len(r.latents)) for r in rows])

        # FluxPipeline casts t to the latents' dtype before dividing it by 1000.
        timestep = per_row(lambda r: r.timesteps[r.step].to(self.dtype)) / 1000
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = per_row(lambda r: torch.tensor(
                r.ctx.guidance if r.ctx.guidance is not None else [r.ctx.guidance_scale],
                dtype=torch.float32, device=self.device))
        noise = self.forward(latents, timestep, guidance, pooled, embeds, group[0].rope)

        offset = sum(len(r.latents) for r in group)
        start = 0
        for r in group:
            n = len(r.latents)
            pred = noise[start:start + n]
            if r.neg_embeds is not None:
                neg = noise[offset:offset + n]
                offset += n
                pred = neg + r.ctx.true_cfg_scale * (pred - neg)
            start += n
            dt = r.sigmas[r.step + 1] - r.sigmas[r.step]
            latents = r.latents.to(torch.float32)
            r.predicted = (latents - r.sigmas[r.step] * pred).to(pred.dtype)
            r.latents = (latents + dt * pred).to(pred.dtype)
            r.step += 1

    # ---- pixels -----------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, request_id: str, predicted: bool = False) -> np.ndarray:
        """The request's images as float32 [n, H, W, 3] in [0, 1]: its latents at any step,
        or (`predicted`) the clean image its last step predicted."""
        r = self.requests[request_id]
        latents = r.predicted if predicted else r.latents
        h, w = r.ctx.height, r.ctx.width
        lh = 2 * (h // (self.vae_scale_factor * 2))
        lw = 2 * (w // (self.vae_scale_factor * 2))
        n, _, c = latents.shape
        x = latents.view(n, lh // 2, lw // 2, c // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        x = x.reshape(n, c // 4, lh, lw)
        cfg = self.vae.config
        x = x / cfg.scaling_factor + cfg.shift_factor
        image = self.vae.decode(x, return_dict=False)[0]
        image = (image * 0.5 + 0.5).clamp(0, 1)
        return image.permute(0, 2, 3, 1).float().cpu().numpy()


def to_uint8(images: np.ndarray) -> np.ndarray:
    """[0, 1] floats to 8-bit pixels, rounded as diffusers' numpy_to_pil rounds them."""
    return (images * 255).round().astype(np.uint8)
