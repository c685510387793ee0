"""Qwen2-VL: a vision transformer with 2D rotary and a patch merger, and a Qwen2 text model with
multimodal rotary positions (M-RoPE).

An image arrives as the processor made it: flattened patches (C x T x P x P values each, in
merge-window order) and its grid (t, h, w) in patches. The ViT embeds the patches, rotates
each head's halves by the patch's row and column (2D rotary), attends within each frame, and
the merger folds every merge x merge window into one embedding of the text model's width:
t * h * w / merge^2 embeddings, which replace the image's `<|image_pad|>` tokens.

The text model is the Llama family's (Qwen2: attention with bias) over the paged cache; only
the positions fed to its rotary change (worker/mrope.py): image tokens take their place in
the image's grid and the text after them continues from there. `VisionLanguageModel` keeps the
embeddings across the steps of a chunked prefill.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipelines.checkpoint.model_config import Qwen2VisionConfig
from pipelines.config import PipelineConfig
from pipelines.pipeline import PagedModelInputs
from serialization.messages import StepImage
from worker.attention import AttentionMetadata
from worker.models.llama import apply_rotary, load_fused_hf_weights
from worker.models.vision_language import (
    VISION_ACTIVATIONS,
    VisionLanguageModel,
    VisionModelInputs,
    layer_norm,
)
from worker.mrope import MRopePositions, TokenRotary, mrope_tables, uniform


class PatchEmbed(nn.Module):
    def __init__(self, v: Qwen2VisionConfig) -> None:
        super().__init__()
        # The checkpoint's Conv3d (kernel = stride = patch) as the matmul it is.
        self.proj = nn.Linear(v.patch_dim, v.embed_dim, bias=False)


class VisionAttention(nn.Module):
    def __init__(self, v: Qwen2VisionConfig) -> None:
        super().__init__()
        self.heads = v.num_heads
        self.head_dim = v.embed_dim // v.num_heads
        self.qkv = nn.Linear(v.embed_dim, 3 * v.embed_dim)
        self.proj = nn.Linear(v.embed_dim, v.embed_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                frames: list[int]) -> torch.Tensor:
        """x [N, E]; cos/sin float32 [N, head_dim]; `frames`: patches per frame (attention
        stays within a frame: each image's own patches)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        # The rotary in float32, as transformers' apply_rotary_pos_emb_vision.
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        out = [F.scaled_dot_product_attention(qf.transpose(0, 1), kf.transpose(0, 1),
                                              vf.transpose(0, 1), scale=self.head_dim**-0.5)
               .transpose(0, 1)
               for qf, kf, vf in zip(q.split(frames), k.split(frames), v.split(frames))]
        return self.proj(torch.cat(out).reshape(n, -1))


class VisionMlp(nn.Module):
    def __init__(self, v: Qwen2VisionConfig) -> None:
        super().__init__()
        if v.hidden_act not in VISION_ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {v.hidden_act!r}")
        hidden = int(v.embed_dim * v.mlp_ratio)
        self.fc1 = nn.Linear(v.embed_dim, hidden)
        self.fc2 = nn.Linear(hidden, v.embed_dim)
        self.act = VISION_ACTIVATIONS[v.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, v: Qwen2VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(v.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(v.embed_dim, eps=1e-6)
        self.attn = VisionAttention(v)
        self.mlp = VisionMlp(v)

    def forward(self, x, cos, sin, frames):
        x = x + self.attn(layer_norm(self.norm1, x), cos, sin, frames)
        return x + self.mlp(layer_norm(self.norm2, x))


class PatchMerger(nn.Module):
    """Each merge x merge window of patches (consecutive in the processor's order) into one
    embedding of the text model's width."""

    def __init__(self, v: Qwen2VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.width = v.embed_dim * v.spatial_merge_size**2
        self.ln_q = nn.LayerNorm(v.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, text_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(layer_norm(self.ln_q, x).view(-1, self.width))


class VisionTransformer(nn.Module):
    """transformers' Qwen2VisionTransformerPretrainedModel, its parameters named as there."""

    def __init__(self, v: Qwen2VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = v
        self.patch_embed = PatchEmbed(v)
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v.depth))
        self.merger = PatchMerger(v, text_hidden)
        spatial = v.embed_dim // v.num_heads // 2  # head dims per axis (rows, columns)
        # On the CPU even while the model is built on the meta device (no checkpoint tensor).
        self.inv_freq = 1.0 / (v.rope_theta ** (
            torch.arange(0, spatial, 2, dtype=torch.float32, device="cpu") / spatial))

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [N, patch_dim] of images with these grids -> [N / merge^2, text hidden]."""
        x = self.patch_embed.proj(patches)
        cos, sin = self.rotary(grids)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        return self.merger(x)

    def rotary(self, grids) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin float32 [N, head_dim]: the first half of each head turned by the patch's
        row, then its column (and both again for the second half), as transformers'
        Qwen2VLVisionRotaryEmbedding."""
        rows = torch.from_numpy(np.concatenate(
            [patch_rows_cols(t, h, w, self.config.spatial_merge_size) for t, h, w in grids],
            axis=1))  # [2, N]
        freqs = rows.T[..., None].float() * self.inv_freq  # [N, 2, head_dim / 4]
        half = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([half, half], dim=-1)
        return emb.cos(), emb.sin()


def patch_rows_cols(t: int, h: int, w: int, merge: int) -> np.ndarray:
    """[2, t*h*w]: each patch's row and column, in the processor's order (merge windows
    contiguous, frame after frame)."""
    rows, cols = np.indices((h, w))
    def windowed(a: np.ndarray) -> np.ndarray:
        return a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)
    return np.tile(np.stack([windowed(rows), windowed(cols)]), (1, t))


@dataclass
class MRopeModelInputs(VisionModelInputs):
    rotary: TokenRotary | None = None  # the step's per-token tables, when images are fed


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    def __init__(self, pipeline_config: PipelineConfig, session: torch.device) -> None:
        super().__init__(pipeline_config, session)
        config = self.config
        self.visual = VisionTransformer(config.vision, config.hidden_size)
        self.mrope = MRopePositions()
        dim = config.head_dim
        self.inv_freq = 1.0 / (config.rope_theta ** (
            torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))

    # ---- M-RoPE ----------------------------------------------------------------------------
    def prepare_initial_token_inputs(self, context_batch, kv_cache_inputs=None,
                                     return_n_logits=1, step=None):
        for new in step.new_requests if step is not None else ():
            if new.rope_positions is not None:
                self.mrope.add(new.request_id, new.rope_positions, new.prompt_len)
        inputs = super().prepare_initial_token_inputs(context_batch, kv_cache_inputs,
                                                      return_n_logits, step)
        return self._with_positions(inputs)

    def prepare_next_token_inputs(self, next_tokens, prev_model_inputs):
        base = super().prepare_next_token_inputs(next_tokens, prev_model_inputs)
        return self._with_positions(VisionModelInputs(
            **vars(base), request_ids=prev_model_inputs.request_ids))

    def _with_positions(self, m: VisionModelInputs) -> MRopeModelInputs:
        """The step's metadata with its tokens' rotary positions: shifted (text only: the
        model's own tables, fused paths included), or 0..T-1 into per-token tables."""
        out = MRopeModelInputs(**vars(m))
        positions = self.mrope.step(m.request_ids, m.query_lens, m.seq_lens)
        if positions is None:
            return out
        meta = m.attention
        if uniform(positions):
            shifted = torch.from_numpy(positions[0].copy())
        else:
            out.rotary = mrope_tables(positions, self.inv_freq, self.config.mrope_section)
            shifted = torch.arange(positions.shape[1])
        out.kv_cache_inputs = dataclasses.replace(
            m.kv_cache_inputs,
            attention=AttentionMetadata(shifted, meta.slot_mapping, meta.groups))
        return out

    def decode(self, hidden: torch.Tensor, m: PagedModelInputs) -> torch.Tensor:
        rotary = m.rotary if isinstance(m, MRopeModelInputs) else None
        return self.forward_embeddings(hidden, m.attention, m.kv_cache, m.logits_rows, rotary)

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.mrope.release(request_id)

    # ---- images ----------------------------------------------------------------------------
    def image_embeddings(self, images: list[StepImage]) -> list[torch.Tensor]:
        """Every image of the step through the ViT at once; each image's merged rows."""
        patches = np.concatenate([img.pixel_values for img in images])
        grids = [tuple(int(g) for g in img.grid_thw) for img in images]
        x = self.visual(torch.from_numpy(np.ascontiguousarray(patches)).to(self.compute_dtype),
                        grids)
        merge = self.config.vision.spatial_merge_size
        return list(x.split([t * h * w // merge**2 for t, h, w in grids]))

    def check_image(self, img: StepImage) -> None:
        v = self.config.vision
        shape, grid = tuple(img.pixel_values.shape), img.grid_thw
        if (len(shape) != 2 or shape[1] != v.patch_dim or img.pixel_values.dtype != np.float32
                or grid is None or len(grid) != 3):
            raise ValueError(f"request {img.request_id}: image pixel values of shape {shape} "
                             f"({img.pixel_values.dtype}), grid {grid}; expected float32 "
                             f"[patches, {v.patch_dim}] and a (t, h, w) grid")
        t, h, w = (int(g) for g in grid)
        merge = v.spatial_merge_size
        if (min(t, h, w) < 1 or h % merge or w % merge or t * h * w != shape[0]
                or int(np.count_nonzero(img.token_mask)) != t * h * w // merge**2):
            raise ValueError(f"request {img.request_id}: an image's grid {grid}, its "
                             f"{shape[0]} patches and its tokens disagree")

    # ---- weights ---------------------------------------------------------------------------
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The Hub's names (model.*, visual.*, lm_head) or transformers >= 5's own
        (model.language_model.*, model.visual.*)."""
        text, visual = {}, {}
        for name, value in weights.items():
            if name.startswith(("visual.", "model.visual.")):
                visual[name.split("visual.", 1)[1]] = value
            elif name.startswith("model.language_model."):
                text["model." + name[len("model.language_model."):]] = value
            elif name.startswith("model.") or name == "lm_head.weight":
                text[name] = value
        load_fused_hf_weights(self, text, ("input_layernorm", "post_attention_layernorm"),
                              loaded_elsewhere=("visual.",))
        conv = visual.get("patch_embed.proj.weight")
        if conv is not None:
            visual["patch_embed.proj.weight"] = conv.reshape(conv.shape[0], -1)
        with torch.no_grad():
            missing, unexpected = self.visual.load_state_dict(visual, strict=False)
        if missing or unexpected:
            raise ValueError(f"vision weights: missing {sorted(missing)[:5]}, unexpected "
                             f"{sorted(unexpected)[:5]}")
