"""Gemma 3's text model (Hugging Face `Gemma3ForCausalLM`, model_type gemma3_text) over the
paged KV cache: the same step as the Llama family (`worker/models/llama.py`), with what sets
Gemma 3 apart, as transformers' `models/gemma3/modeling_gemma3.py` computes it:

- token embeddings scaled by sqrt(hidden_size), that factor rounded to the table's dtype;
- RMSNorm computing x * (1 + weight) in float32; q and k normed per head before the rotary;
- four norms per layer: the attention and MLP outputs are normed (post_attention_layernorm,
  post_feedforward_layernorm) before their residual adds, and the MLP input by its own
  pre_feedforward_layernorm;
- a gelu(tanh) gated MLP; attention scaled by query_pre_attn_scalar**-0.5;
- sliding (local) layers attending to the last `sliding_window` positions, rotary base
  rope_local_theta, and full (global) ones with rope_theta and the rope scaling;
- tanh soft-capping of the final logits where the config sets final_logit_softcapping. (Its
  attn_logit_softcapping is not applied: transformers' Gemma 3 keeps the field but never passes
  it to the attention, qk-norm having replaced Gemma 2's capping; Gemma 3 sets neither.)

Linear layers are plain nn.Linear (fused q/k/v and gate/up, under the Llama model's names), so
the model runner's packing and `--quantization` loaders treat them alike, and decode-only steps
take the Llama family's one-call native step (`worker/fused_decode.py`), told of the norms,
rotary tables and windows above by `fused_decode_layers`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from pipelines.checkpoint.model_config import ModelConfig
from pipelines.config import PipelineConfig
from pipelines.pipeline import PagedCausalLM, checkpoint_config, selected_rows
from worker import layer_ops
from worker.attention import AttentionMetadata, paged_attention, sliding_window_metadata, store_kv
from worker.models.llama import (
    LlamaForCausalLM,
    RotaryEmbedding,
    apply_rotary,
    load_fused_hf_weights,
)
from worker.tensor_parallel import ShardPlan, all_reduce
from worker.weights import empty_embedding

SLIDING = "sliding_attention"


class GemmaRMSNorm(nn.Module):
    """rmsnorm(x) * (1 + weight), in float32, rounded to x's dtype. `weight` is the checkpoint's
    (zero-centred); the (1 + weight) factor is formed in float32 at each call, as Hugging Face
    does, so a bfloat16 weight loses nothing to the addition."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps
        self._scale: tuple[object, torch.Tensor] | None = None

    @property
    def scale(self) -> torch.Tensor:
        """1 + weight in float32, formed again only when the weight changes (a decode step
        of Gemma 3 270M has 108 norms: one op each less)."""
        key = (id(self.weight), self.weight._version, self.weight.dtype)
        if self._scale is None or self._scale[0] != key:
            self._scale = (key, 1.0 + self.weight.detach().float())
        return self._scale[1]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rmsnorm(x); with `residual`: (rmsnorm(residual + x), residual + x)."""
        scale = self.scale
        if layer_ops.applies(x) and x.dim() == 2:
            if residual is None:
                return layer_ops.rms_norm(x, scale, self.eps)
            return layer_ops.add_rms_norm(residual, x, scale, self.eps), residual
        if residual is None:
            return self._norm(x, scale)
        residual = residual + x
        return self._norm(residual, scale), residual

    def _norm(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * scale).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, sliding: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.sliding = sliding

    def forward(self, x, rotary, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if layer_ops.applies(qkv) and qkv.is_contiguous():
            q, k, v = self._norm_rotate_store_fused(qkv, rotary, k_cache, v_cache, meta)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(tokens * self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(tokens * self.num_kv_heads, self.head_dim))
            q = q.view(tokens, self.num_heads, self.head_dim)
            k = k.view(tokens, self.num_kv_heads, self.head_dim)
            v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
            cos, sin = rotary(meta.positions, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return all_reduce(self.o_proj(out.view(tokens, self.q_size)))  # (row-parallel)

    def _norm_rotate_store_fused(self, qkv, rotary, k_cache, v_cache, meta):
        """The float32 path: q and k normed per head back into qkv, then one native pass
        rotates them in place and writes k and v to the cache (about 20 PyTorch ops fewer a
        layer). Returns q, k, v as [T, heads, D] views of qkv."""
        tokens, d = qkv.shape[0], self.head_dim
        for start, heads, norm in ((0, self.num_heads, self.q_norm),
                                   (self.q_size, self.num_kv_heads, self.k_norm)):
            part = qkv[:, start:start + heads * d]
            normed = layer_ops.rms_norm(part.reshape(tokens * heads, d), norm.scale, norm.eps)
            part.copy_(normed.view(tokens, heads * d))
        rotary.rotate_and_store(qkv, self.num_heads, self.num_kv_heads, d, meta, k_cache,
                                v_cache)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(tokens, self.num_heads, d), k.view(tokens, self.num_kv_heads, d),
                v.view(tokens, self.num_kv_heads, d))


class Gemma3MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported activation {config.hidden_act!r}")
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if layer_ops.applies(gate_up) and gate_up.dim() == 2 \
                and gate_up.is_contiguous():
            return all_reduce(self.down_proj(layer_ops.gelu_tanh_mul(gate_up)))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return all_reduce(self.down_proj(F.gelu(gate, approximate="tanh") * up))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, sliding: bool) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config, sliding)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, hidden, residual, rotary, k_cache, v_cache, meta):
        """(hidden, residual) in and out, as the Llama layers: `hidden` is the last sub-layer's
        normed output, not yet added; the norm after it does the residual add."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, k_cache, v_cache, meta)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(nn.Module, PagedCausalLM):
    supports_tensor_parallel = True

    def __init__(self, pipeline_config: PipelineConfig, session: torch.device,
                 shard: ShardPlan | None = None) -> None:
        super().__init__()
        PagedCausalLM.__init__(self, pipeline_config, session)
        config, max_positions = checkpoint_config(pipeline_config, shard)
        if config.layer_types is None or config.query_pre_attn_scalar is None:
            raise ValueError("a Gemma 3 model needs a Gemma 3 config (layer_types, "
                             "query_pre_attn_scalar)")
        self.config = config
        self.embed_tokens = empty_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, kind == SLIDING)
                                    for kind in config.layer_types)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary_global = RotaryEmbedding(config, max_positions)
        self.rotary_local = RotaryEmbedding(
            dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None),
            max_positions)
        self.sliding_window = config.sliding_window
        self.final_softcap = config.final_logit_softcapping
        # All layers in one native call for decode-only steps (worker/fused_decode.py), set
        # by the model runner once the weights are packed.
        self.fused_decode = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [layers, 2, num_blocks, block_size, KVH, D]
        logits_rows: torch.Tensor,  # rows of T whose next-token logits are wanted
    ) -> torch.Tensor:
        hidden = self._embed(input_ids)
        if self.fused_decode is not None and self.fused_decode.applies(meta, kv_cache):
            x = selected_rows(self.fused_decode(hidden, meta, kv_cache, self.norm.scale),
                              logits_rows)
        else:
            hidden, residual = self._layers_forward(hidden, meta, kv_cache)
            x, _ = self.norm(hidden[logits_rows], residual[logits_rows])
        logits = self.lm_head(x).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _layers_forward(self, hidden, meta: AttentionMetadata, kv_cache: torch.Tensor):
        residual, local_meta = None, None
        if self._local(None) and any(layer.self_attn.sliding for layer in self.layers):
            local_meta = sliding_window_metadata(meta, self.sliding_window, kv_cache.shape[3])
        for i, layer in enumerate(self.layers):
            if self._local(layer):
                rotary, layer_meta = self.rotary_local, local_meta
            else:
                rotary, layer_meta = self.rotary_global, meta
            hidden, residual = layer(hidden, residual, rotary, kv_cache[i, 0], kv_cache[i, 1],
                                     layer_meta)
        return hidden, residual

    def _local(self, layer: Gemma3DecoderLayer | None) -> bool:
        """Whether `layer` (None: any layer) attends through the sliding window, with the
        local rotary base: a sliding layer of a config that sets a window."""
        return bool(self.sliding_window) and (layer is None or layer.self_attn.sliding)

    def fused_decode_layers(self) -> list:
        """The layers as the native decode step reads them (worker/fused_decode.py)."""
        from worker.fused_decode import DecodeLayer

        layers = []
        for layer in self.layers:
            attn, local = layer.self_attn, self._local(layer)
            layers.append(DecodeLayer(
                layer.input_layernorm.scale, layer.pre_feedforward_layernorm.scale,
                self.rotary_local if local else self.rotary_global,
                attn_out_norm=layer.post_attention_layernorm.scale,
                mlp_out_norm=layer.post_feedforward_layernorm.scale,
                q_norm=attn.q_norm.scale, k_norm=attn.k_norm.scale,
                window=self.sliding_window if local else 0))
        return layers

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the table times sqrt(hidden_size), that factor rounded to the table's dtype
        (55.4256 becomes 55.5 in bfloat16, as in Hugging Face's and Google's code); the product
        is taken in the table's dtype, then widened to the compute dtype."""
        rows = self.embed_tokens(input_ids)
        scale = torch.tensor(math.sqrt(self.config.hidden_size), dtype=torch.float32)
        return (rows * scale.to(rows.dtype)).to(self.compute_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype: the weights' dtype, or float32 after `compute_in_float32`."""
        return self.norm.weight.dtype

    # ---- weights ---------------------------------------------------------------------------
    def compute_in_float32(self) -> None:
        """Run a bfloat16 model's activations in float32 once its linear layers are packed (as
        LlamaForCausalLM.compute_in_float32): only the norms' weights are widened."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, GemmaRMSNorm):
                    module.weight = nn.Parameter(module.weight.detach().float(),
                                                 requires_grad=False)

    # Float32 projections stored column-major, a tied lm_head given its own copy: the same
    # layout step as Llama's (its docstring says why).
    use_fast_weight_layout = LlamaForCausalLM.use_fast_weight_layout

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face state dict in, fusing q/k/v and gate/up. The norms keep the
        checkpoint's zero-centred weights (a GGUF file's, which llama.cpp stores as 1 + w,
        must be given back as w)."""
        load_fused_hf_weights(self, weights, (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"))
