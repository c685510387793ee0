"""A Llama-style model served by `loom serve --custom-architectures` (docs/architecture.md,
"Writing a model"): the whole of a model Loom serves, written against the documented
`PipelineModel` contract only.

    loom serve --model DIR --custom-architectures docs/examples/tiny_llama_model.py:TinyLlama

serves the checkpoints in DIR whose config.json says `"architectures": ["TinyLlamaForCausalLM"]`
(a Llama checkpoint renamed so: the weights have Llama's names and shapes). The server brings
batching, the paged KV cache with prefix caching, chunked prefill, sampling, log probabilities
and streaming; the model brings one forward pass over a batch of contexts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from pipelines.pipeline import (
    KVCacheInputs,
    ModelInputs,
    ModelOutputs,
    PipelineModel,
    load_weights,
)


@dataclass
class TinyLlamaInputs(ModelInputs):
    tokens: torch.Tensor  # [T] the tokens every context feeds this step, one after another
    last_rows: torch.Tensor  # [contexts] each context's last row of T: what it samples from
    return_n_logits: int  # 1: those rows' logits; -1: every row's too (echo); 0: none
    kv_cache_inputs: KVCacheInputs | None = None  # where they go in the paged cache


class TinyLlama(PipelineModel):
    architecture = "TinyLlamaForCausalLM"  # config.json's architectures[0] it serves

    def __init__(self, pipeline_config, session: torch.device) -> None:
        super().__init__(pipeline_config, session)
        path = pipeline_config.model_config.model_path
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        self.num_layers = config["num_hidden_layers"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or config["hidden_size"] // self.num_heads
        self.eps = config.get("rms_norm_eps", 1e-6)
        # The weights and the KV cache share a dtype: --dtype, else float32 on the CPU and
        # bfloat16 on a GPU (the server's defaults).
        dtype_name = pipeline_config.model_config.dtype
        dtype = getattr(torch, dtype_name) if dtype_name else (
            torch.float32 if session.type == "cpu" else torch.bfloat16)
        self.weights = {name: w.to(session, dtype) for name, w in load_weights(path).items()}
        self.lm_head = self.weights.get("lm_head.weight",
                                        self.weights["model.embed_tokens.weight"])  # (tied)
        theta = config.get("rope_theta", 10000.0)
        self.inv_freq = 1.0 / theta ** (
            torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=session)
            / self.head_dim)

    # ---- the contract ----------------------------------------------------------------------
    def prepare_initial_token_inputs(self, context_batch, kv_cache_inputs=None,
                                     return_n_logits=1) -> TinyLlamaInputs:
        if kv_cache_inputs is None:
            raise ValueError("TinyLlama attends over the paged KV cache: kv_cache_inputs needed")
        # Each context feeds its next tokens: a prompt (or a chunk of one), or its last token.
        tokens = np.concatenate([ctx.next_tokens for ctx in context_batch])
        return self._inputs(torch.from_numpy(tokens), kv_cache_inputs, return_n_logits)

    def prepare_next_token_inputs(self, next_tokens, prev_model_inputs) -> TinyLlamaInputs:
        # The same contexts one token further: each feeds the token it just sampled.
        kv = prev_model_inputs.kv_cache_inputs.next_step()
        return self._inputs(next_tokens.reshape(-1), kv, prev_model_inputs.return_n_logits)

    def execute(self, model_inputs: TinyLlamaInputs) -> ModelOutputs:
        m = model_inputs
        if m.return_n_logits == 0:  # (nothing to sample from)
            self.forward(m.tokens, m.kv_cache_inputs)
            return ModelOutputs()
        hidden = self.forward(m.tokens, m.kv_cache_inputs)
        if m.return_n_logits == -1:  # every row (echo log probabilities), and the last ones
            logits = (hidden @ self.lm_head.T).float()
            return ModelOutputs(next_token_logits=logits[m.last_rows], logits=logits)
        return ModelOutputs(next_token_logits=(hidden[m.last_rows] @ self.lm_head.T).float())

    # (compute_log_probabilities: the base class's, from the logits above.)

    def _inputs(self, tokens, kv: KVCacheInputs, return_n_logits: int) -> TinyLlamaInputs:
        last_rows = torch.from_numpy(np.cumsum(kv.query_lens) - 1)
        return TinyLlamaInputs(tokens=tokens.to(self.session, torch.long),
                               last_rows=last_rows.to(self.session),
                               return_n_logits=return_n_logits, kv_cache_inputs=kv)

    # ---- the forward pass ------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, kv: KVCacheInputs) -> torch.Tensor:
        """The final hidden state [T, hidden] of the fed tokens."""
        w = self.weights
        h = w["model.embed_tokens.weight"][tokens]
        cos, sin = self.rotary(kv.positions)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            h = h + self.attention(i, rms_norm(h, w[p + "input_layernorm.weight"], self.eps),
                                   cos, sin, kv)
            h = h + self.mlp(i, rms_norm(h, w[p + "post_attention_layernorm.weight"], self.eps))
        return rms_norm(h, w["model.norm.weight"], self.eps)

    def attention(self, i: int, x, cos, sin, kv: KVCacheInputs) -> torch.Tensor:
        w, p, t = self.weights, f"model.layers.{i}.self_attn.", len(x)
        q = (x @ w[p + "q_proj.weight"].T).view(t, self.num_heads, self.head_dim)
        k = (x @ w[p + "k_proj.weight"].T).view(t, self.num_kv_heads, self.head_dim)
        v = (x @ w[p + "v_proj.weight"].T).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Stores k and v in the paged cache; each token attends over its own sequence's
        # cached and new tokens, causally (grouped-query: several q heads per kv head).
        out = kv.attend(i, q, k, v)
        return out.reshape(t, -1) @ w[p + "o_proj.weight"].T

    def mlp(self, i: int, x) -> torch.Tensor:  # SwiGLU
        w, p = self.weights, f"model.layers.{i}.mlp."
        gate = torch.nn.functional.silu(x @ w[p + "gate_proj.weight"].T)
        return (gate * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] of each token's position (Llama's rotary embedding)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        dtype = self.lm_head.dtype
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] turned by its tokens' angles (the halves-rotated form Llama uses)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
