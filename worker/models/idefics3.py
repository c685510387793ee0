"""Idefics3 (SmolVLM): a SigLIP vision encoder, a pixel-shuffle connector and a Llama text model.

An image arrives as tiles (the processor's crops plus the whole image, each `image_size`
pixels square). Each tile is cut into patches, encoded by the vision transformer, and every
`scale_factor` x `scale_factor` neighbourhood of patch outputs is folded into one vector
(pixel shuffle) and projected to the text model's width: `tokens_per_tile` embeddings per
tile, which replace the prompt's `<image>` tokens in order before the decoder layers.

The text model is `LlamaForCausalLM` itself (its layers, paged attention, packed kernels and
fused decode); this class adds the encoder, and `VisionLanguageModel`
(worker/models/vision_language.py) the merge: images are encoded in the step that feeds their
first token and kept until their last token is fed, so chunked prefill may cut an image
anywhere. Matches transformers' Idefics3 for tiles without
padding, which is what its processor makes (every tile is resized to the full tile size).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipelines.checkpoint.model_config import VisionConfig
from pipelines.config import PipelineConfig
from serialization.messages import StepImage
from worker.models.llama import load_fused_hf_weights
from worker.models.vision_language import (
    VISION_ACTIVATIONS,
    VisionLanguageModel,
    layer_norm,
)
from worker.weights import empty_embedding


class VisionAttention(nn.Module):
    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.heads = v.num_attention_heads
        self.head_dim = v.hidden_size // v.num_attention_heads
        self.qkv_proj = nn.Linear(v.hidden_size, 3 * v.hidden_size)  # q, k, v fused at load
        self.out_proj = nn.Linear(v.hidden_size, v.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles, patches, width = x.shape
        qkv = self.qkv_proj(x).view(tiles, patches, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [tiles, heads, patches, D]
        # Bidirectional over a tile's patches (no padding patches: tiles are full).
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(tiles, patches, width))


class VisionLayer(nn.Module):
    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        if v.hidden_act not in VISION_ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {v.hidden_act!r}")
        self.layer_norm1 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.self_attn = VisionAttention(v)
        self.layer_norm2 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.fc1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.fc2 = nn.Linear(v.intermediate_size, v.hidden_size)
        self.act = VISION_ACTIVATIONS[v.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(layer_norm(self.layer_norm1, x))
        return x + self.fc2(self.act(self.fc1(layer_norm(self.layer_norm2, x))))


class VisionEncoder(nn.Module):
    """SigLIP as Idefics3 runs it: patch embedding, learned positions, encoder layers, norm."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.config = v
        self.side = v.image_size // v.patch_size  # patches per side of a full tile
        # The checkpoint's Conv2d (kernel = stride = patch) as the matmul it is.
        self.patch_embedding = nn.Linear(v.num_channels * v.patch_size**2, v.hidden_size)
        self.position_embedding = empty_embedding(self.side**2, v.hidden_size)
        self.layers = nn.ModuleList(VisionLayer(v) for _ in range(v.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, C, H, W] -> [tiles, patches, hidden]."""
        tiles, channels, height, width = pixel_values.shape
        p = self.config.patch_size
        nh, nw = height // p, width // p
        patches = (pixel_values.view(tiles, channels, nh, p, nw, p)
                   .permute(0, 2, 4, 1, 3, 5).reshape(tiles, nh * nw, channels * p * p))
        x = self.patch_embedding(patches)
        positions = self.position_ids(nh, nw)
        x = x + self.position_embedding.weight[positions].to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return layer_norm(self.post_layernorm, x)

    def position_ids(self, nh: int, nw: int) -> torch.Tensor:
        """Idefics3's positions for an nh x nw patch grid: each patch's fractional coordinates
        bucketed onto the full tile's grid (the identity for a full tile). The same float32
        arithmetic as transformers, so the buckets agree at their edges."""
        side = self.side
        boundaries = torch.arange(1 / side, 1.0, 1 / side)
        def buckets(n: int) -> torch.Tensor:
            coords = torch.arange(n, dtype=torch.float32) * (1.0 / torch.tensor(n))
            return torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)
        return (buckets(nh)[:, None] * side + buckets(nw)[None, :]).reshape(-1)

    def load_hf_weights(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        def take(name: str) -> torch.Tensor:
            if prefix + name not in weights:
                raise ValueError(f"checkpoint is missing {prefix}{name}")
            return weights[prefix + name]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if param.shape != value.shape:
                raise ValueError(f"{prefix}{name}: checkpoint shape {tuple(value.shape)} != "
                                 f"{tuple(param.shape)}")
            param.copy_(value)

        emb = "embeddings."
        conv = take(emb + "patch_embedding.weight")
        put(self.patch_embedding.weight, conv.reshape(conv.shape[0], -1),
            emb + "patch_embedding.weight")
        put(self.patch_embedding.bias, take(emb + "patch_embedding.bias"), emb + "bias")
        put(self.position_embedding.weight, take(emb + "position_embedding.weight"),
            emb + "position_embedding.weight")
        for i, layer in enumerate(self.layers):
            src = f"encoder.layers.{i}."
            attn = src + "self_attn."
            for part in ("weight", "bias"):
                qkv = torch.cat([take(f"{attn}{p}_proj.{part}") for p in "qkv"], dim=0)
                put(getattr(layer.self_attn.qkv_proj, part), qkv, f"{attn}qkv.{part}")
                put(getattr(layer.self_attn.out_proj, part), take(f"{attn}out_proj.{part}"),
                    f"{attn}out_proj.{part}")
                for norm in ("layer_norm1", "layer_norm2"):
                    put(getattr(getattr(layer, norm), part), take(f"{src}{norm}.{part}"),
                        f"{src}{norm}.{part}")
                for fc in ("fc1", "fc2"):
                    put(getattr(getattr(layer, fc), part), take(f"{src}mlp.{fc}.{part}"),
                        f"{src}mlp.{fc}.{part}")
        for part in ("weight", "bias"):
            put(getattr(self.post_layernorm, part), take(f"post_layernorm.{part}"),
                f"post_layernorm.{part}")


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[tiles, seq, D] -> [tiles, seq / scale^2, D * scale^2], transformers' exact layout."""
    tiles, seq, dim = x.shape
    side = int(seq**0.5)
    x = x.view(tiles, side, side // scale, dim * scale)
    x = x.permute(0, 2, 1, 3)
    x = x.reshape(tiles, side // scale, side // scale, dim * scale * scale)
    x = x.permute(0, 2, 1, 3)
    return x.reshape(tiles, seq // scale**2, dim * scale**2)


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    def __init__(self, pipeline_config: PipelineConfig, session: torch.device) -> None:
        super().__init__(pipeline_config, session)
        config = self.config
        v = config.vision
        self.vision_model = VisionEncoder(v)
        self.connector = nn.Linear(v.hidden_size * v.scale_factor**2, config.hidden_size,
                                   bias=False)

    # ---- images ----------------------------------------------------------------------------
    def image_embeddings(self, images: list[StepImage]) -> list[torch.Tensor]:
        """Every image's tiles encoded in one batch; each image's rows, tile after tile."""
        pixels = np.concatenate([img.pixel_values for img in images])
        features = self.image_features(torch.from_numpy(np.ascontiguousarray(pixels)))
        per_tile = features.shape[1]
        out, offset = [], 0
        for img in images:
            tiles = img.pixel_values.shape[0]
            out.append(features[offset:offset + tiles].reshape(tiles * per_tile, -1))
            offset += tiles
        return out

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, C, H, W] float32 -> [tiles, tokens_per_tile, text hidden]."""
        x = self.vision_model(pixel_values.to(self.compute_dtype))
        return self.connector(pixel_shuffle(x, self.config.vision.scale_factor))

    def check_image(self, img: StepImage) -> None:
        v = self.config.vision
        shape = tuple(img.pixel_values.shape)
        if (len(shape) != 4 or shape[1] != v.num_channels or shape[2:] != (v.image_size,) * 2
                or img.pixel_values.dtype != np.float32):
            raise ValueError(f"request {img.request_id}: image pixel values of shape {shape} "
                             f"({img.pixel_values.dtype}); expected float32 [tiles, "
                             f"{v.num_channels}, {v.image_size}, {v.image_size}]")

    # ---- weights ---------------------------------------------------------------------------
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """transformers' names: model.text_model.* (a Llama's model.*), lm_head,
        model.vision_model.*, model.connector.modality_projection.proj."""
        text = {}
        for name, value in weights.items():
            if name.startswith("model.text_model."):
                text["model." + name[len("model.text_model."):]] = value
            elif name == "lm_head.weight":
                text[name] = value
        load_fused_hf_weights(self, text, ("input_layernorm", "post_attention_layernorm"),
                              loaded_elsewhere=("vision_model.", "connector."))
        with torch.no_grad():
            self.vision_model.load_hf_weights(weights, "model.vision_model.")
            name = "model.connector.modality_projection.proj.weight"
            if name not in weights:
                raise ValueError(f"checkpoint is missing {name}")
            if weights[name].shape != self.connector.weight.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(weights[name].shape)} != "
                                 f"{tuple(self.connector.weight.shape)}")
            self.connector.weight.copy_(weights[name])
