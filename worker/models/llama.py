"""The Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM) over the paged KV cache.

Every step runs one forward over a flat array of tokens from many sequences; linear layers see
all of them at once, attention goes through `paged_attention`. Q/K/V and gate/up projections are
fused into one matmul each at load time. The residual stream travels beside the hidden state
(as in vLLM and nano-vllm) so each residual add fuses with the norm after it; in float32 the
norms, rotary + KV store and SiLU-and-mul run as single native passes (`worker/layer_ops.py`),
and on a GPU as single Triton kernels in any dtype (`worker/gpu_layer_ops.py`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipelines.checkpoint.model_config import EVERY_LAYER_SLIDING, ModelConfig
from pipelines.config import PipelineConfig
from pipelines.pipeline import PagedCausalLM, checkpoint_config, selected_rows
from worker import layer_ops
from worker.attention import (
    AttentionMetadata,
    paged_attention,
    sliding_window_metadata,
    store_kv,
)
from worker.tensor_parallel import ShardPlan, all_reduce
from worker.weights import empty_embedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rmsnorm(x); with `residual`: (rmsnorm(residual + x), residual + x)."""
        ops = _fused_ops(x)
        if ops is not None and x.dim() == 2:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            return ops.add_rms_norm(residual, x, self.weight, self.eps), residual
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # As Hugging Face does: normalise in float32, scale in the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; `forward` looks them up by position."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        dim = config.head_dim
        # Computed on the CPU even while the model is built on the meta device: there arange
        # goes through torch._refs, whose first use imports torch._dynamo (~2 s of start-up).
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (config.rope_theta ** (
            torch.arange(0, dim, 2, dtype=torch.float32, device=cpu) / dim))
        inv_freq = _scale_inv_freq(inv_freq, config.rope_scaling)
        t = torch.arange(max_positions, dtype=torch.float32, device=cpu)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # Plain float32 tensors, not buffers, so that `model.to(torch.bfloat16)` leaves them
        # alone: the native float32 paths read them as float32 (a bfloat16 model computing in
        # float32 included); `forward` casts the rows it looks up, as Hugging Face does.
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)

    def rotate_and_store(self, qkv, heads, kv_heads, head_dim, meta, k_cache, v_cache) -> None:
        """The fused path: rotary on q and k inside qkv, then k and v to the cache."""
        _fused_ops(qkv).rope_store_kv(qkv, heads, kv_heads, head_dim, meta.positions,
                                      self.cos, self.sin, k_cache, v_cache, meta.slot_mapping)


def _fused_ops(x: torch.Tensor):
    """The fused element-wise ops for x: C on the CPU in float32 (layer_ops), Triton on a
    GPU in any dtype (gpu_layer_ops), else None (PyTorch's ops)."""
    if layer_ops.applies(x):
        return layer_ops
    if x.is_cuda:
        # (Imported here: its kernels are defined when imported, and on a CPU the tests
        # define them under Triton's interpreter, which it reads at that moment.)
        from worker import gpu_layer_ops

        if gpu_layer_ops.applies(x):
            return gpu_layer_ops
    return None


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos/sin: [T, D] (rotate-half convention of Hugging Face Llama)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(self, x, rotary, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        fused = self.q_norm is None and _fused_ops(qkv) is not None and qkv.is_contiguous()
        if fused:
            rotary.rotate_and_store(qkv, self.num_heads, self.num_kv_heads, self.head_dim, meta,
                                    k_cache, v_cache)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if not fused:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            cos, sin = rotary(meta.positions, x.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return all_reduce(self.o_proj(out.view(tokens, self.q_size)))  # (row-parallel)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r}")
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = _fused_ops(gate_up)
        if ops is not None and gate_up.dim() == 2:
            return all_reduce(self.down_proj(ops.silu_mul(gate_up)))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden, residual, rotary, k_cache, v_cache, meta):
        """(hidden, residual) in and out: the residual add of each sub-layer is done by the
        norm that follows it (the next layer's, or the final one)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, k_cache, v_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module, PagedCausalLM):
    supports_tensor_parallel = True  # (its row-parallel projections all-reduce)

    def __init__(self, pipeline_config: PipelineConfig, session: torch.device,
                 shard: ShardPlan | None = None) -> None:
        """`shard`: this tensor-parallel rank's part of the checkpoint (None: all of it)."""
        super().__init__()
        PagedCausalLM.__init__(self, pipeline_config, session)
        config, max_positions = checkpoint_config(pipeline_config, shard)
        self.config = config
        self.embed_tokens = empty_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, max_positions)
        # Mistral's window: every layer attends to the last `sliding_window` positions only.
        self.sliding_window = config.sliding_window \
            if config.architecture in EVERY_LAYER_SLIDING else None
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
        fused = self.fused_decode
        if fused is not None and fused.applies(meta, kv_cache) and fused.embeds(input_ids):
            x = fused(None, meta, kv_cache, self.norm.weight, input_ids)
            return _float(self.lm_head(selected_rows(x, logits_rows)))
        hidden = self.embed_tokens(input_ids).to(self.compute_dtype)
        return self.forward_embeddings(hidden, meta, kv_cache, logits_rows)

    def forward_embeddings(self, hidden: torch.Tensor, meta: AttentionMetadata,
                           kv_cache: torch.Tensor, logits_rows: torch.Tensor,
                           rotary: RotaryEmbedding | None = None) -> torch.Tensor:
        """The decoder over input embeddings [T, hidden] (a vision model's images merged in).
        `rotary`: the step's own tables, looked up at meta.positions (Qwen2-VL's M-RoPE);
        the fused decode step reads only the model's."""
        if rotary is None and self.fused_decode is not None and self.fused_decode.applies(meta, kv_cache):
            x = self.fused_decode(hidden, meta, kv_cache, self.norm.weight)
            return _float(self.lm_head(selected_rows(x, logits_rows)))
        residual = None
        rotary = self.rotary if rotary is None else rotary
        if self.sliding_window:
            meta = sliding_window_metadata(meta, self.sliding_window, kv_cache.shape[3])
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, rotary, kv_cache[i, 0],
                                     kv_cache[i, 1], meta)
        x, _ = self.norm(hidden[logits_rows], residual[logits_rows])
        return self.lm_head(x).float()

    def fused_decode_layers(self) -> list:
        """The layers as the native decode step reads them (worker/fused_decode.py)."""
        from worker.fused_decode import DecodeLayer

        layers = []
        for layer in self.layers:
            attn = layer.self_attn
            qk = {} if attn.q_norm is None else dict(q_norm=attn.q_norm.weight,
                                                     k_norm=attn.k_norm.weight)
            layers.append(DecodeLayer(layer.input_layernorm.weight,
                                      layer.post_attention_layernorm.weight, self.rotary,
                                      window=self.sliding_window or 0, **qk))
        return layers

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype: the weights' dtype, or float32 after `compute_in_float32`."""
        return self.norm.weight.dtype

    # ---- weights ---------------------------------------------------------------------------
    def compute_in_float32(self) -> None:
        """Run a bfloat16 model's activations in float32, once its linear layers are packed.

        The packed kernel widens bfloat16 weights and accumulates in float32 anyway; rounding
        every activation back to bfloat16 between operations only adds PyTorch's slow bf16
        element-wise ops and conversions (the fused float32 paths, `layer_ops` and the one-call
        decode step, do not apply to them) and loses precision. The projections, the embedding
        table and the KV cache stay bfloat16, so memory and memory traffic are bfloat16's: 1.4x
        the decode tokens/s of bf16 activations at batch 16 here. Only the norms' weights (a
        few KB) are widened; outputs differ from a bfloat16-activation model (Hugging Face's
        bf16) by its rounding, and equal a float32 model on bf16-rounded weights but for the
        cache's rounding (tests/test_model_oracle.py).
        """
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight = nn.Parameter(module.weight.detach().float(),
                                                 requires_grad=False)

    def use_fast_weight_layout(self) -> None:
        """Store every float32 projection column-major (W^T contiguous, same logical shape).

        PyTorch's CPU float32 GEMM runs x @ W^T 2-8x faster at 4-48 rows (the decode batches a
        server runs) when W^T is contiguous, and no slower at prefill sizes (bfloat16 gains
        nothing, so it is left alone). A tied lm_head gets its own copy: the embedding lookup wants rows contiguous.
        """
        if self.embed_tokens.weight.dtype != torch.float32:
            return
        with torch.no_grad():
            if self.lm_head.weight is self.embed_tokens.weight:
                self.lm_head.weight = nn.Parameter(self.lm_head.weight.detach().clone())
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    column_major = module.weight.detach().t().contiguous().t()
                    module.weight = nn.Parameter(column_major, requires_grad=False)

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face state dict in, fusing q/k/v and gate/up."""
        norms = ("input_layernorm", "post_attention_layernorm")
        if self.config.qk_norm:
            norms += ("self_attn.q_norm", "self_attn.k_norm")
        load_fused_hf_weights(self, weights, norms)


def load_fused_hf_weights(model: nn.Module, weights: dict[str, torch.Tensor],
                          layer_norms: tuple[str, ...], loaded_elsewhere: tuple[str, ...] = (),
                          ) -> None:
    """Copy a Hugging Face state dict into a model laid out as LlamaForCausalLM is (q/k/v and
    gate/up fused into one projection each; Gemma 3 too), `layer_norms` naming each layer's
    norms. Every parameter must be loaded (the tied lm_head aside, and the parameters under
    the `loaded_elsewhere` prefixes: a vision model's encoder)."""
    config = model.config
    own = dict(model.named_parameters())
    loaded: set[str] = set()

    def put(name: str, value: torch.Tensor) -> None:
        param = own[name]
        if param.shape != value.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != "
                             f"{tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value)
        loaded.add(name)

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise ValueError(f"checkpoint is missing {name}")
        return weights[name]

    put("embed_tokens.weight", take("model.embed_tokens.weight"))
    put("norm.weight", take("model.norm.weight"))
    if not config.tie_word_embeddings:
        put("lm_head.weight", take("lm_head.weight"))
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for norm in layer_norms:
            put(f"{dst}{norm}.weight", take(f"{src}{norm}.weight"))
        attn = src + "self_attn."
        qkv = [take(f"{attn}{p}_proj.weight") for p in "qkv"]
        put(f"{dst}self_attn.qkv_proj.weight", torch.cat(qkv, dim=0))
        if config.attention_bias:
            bias = [take(f"{attn}{p}_proj.bias") for p in "qkv"]
            put(f"{dst}self_attn.qkv_proj.bias", torch.cat(bias, dim=0))
        put(f"{dst}self_attn.o_proj.weight", take(f"{attn}o_proj.weight"))
        if f"{dst}self_attn.o_proj.bias" in own:  # (Gemma's, with attention_bias)
            put(f"{dst}self_attn.o_proj.bias", take(f"{attn}o_proj.bias"))
        mlp = src + "mlp."
        gate_up = torch.cat([take(f"{mlp}gate_proj.weight"), take(f"{mlp}up_proj.weight")], 0)
        put(f"{dst}mlp.gate_up_proj.weight", gate_up)
        put(f"{dst}mlp.down_proj.weight", take(f"{mlp}down_proj.weight"))
    missing = set(own) - loaded - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    missing = {name for name in missing if not name.startswith(loaded_elsewhere)}
    if missing:
        raise ValueError(f"weights not loaded: {sorted(missing)[:5]}")


def _float(logits: torch.Tensor) -> torch.Tensor:
    """The logits in float32 (a call less where they are: every quantized or float32 model)."""
    return logits if logits.dtype == torch.float32 else logits.float()
