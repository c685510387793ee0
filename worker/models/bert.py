"""A BERT encoder (all-MiniLM, BGE, E5 and other sentence-transformers models) for embeddings.

A batch is padded to its longest input and run in one forward; the attention mask keeps
padding out of every sequence, and pooling (mean, CLS or max, as the checkpoint's
sentence-transformers config says) happens here too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipelines.checkpoint.bert_config import BertConfig
from worker.weights import empty_embedding


class BertLayer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.intermediate = nn.Linear(h, c.intermediate_size)
        self.output = nn.Linear(c.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attended = attended.transpose(1, 2).reshape(batch, length, hidden)
        x = self.attn_norm(x + self.attn_out(attended))
        return self.out_norm(x + self.output(F.gelu(self.intermediate(x))))


class BertEncoder(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        if c.hidden_act != "gelu":
            raise ValueError(f"unsupported activation {c.hidden_act!r}")
        self.config = c
        self.word = empty_embedding(c.vocab_size, c.hidden_size)
        self.position = empty_embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type = empty_embedding(c.type_vocab_size, c.hidden_size)
        self.embed_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L] (padded), lengths [B]; returns pooled embeddings [B, hidden]."""
        batch, length = input_ids.shape
        valid = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)  # [B, L]
        positions = torch.arange(length).unsqueeze(0)
        x = self.word(input_ids) + self.position(positions) + self.token_type.weight[0]
        x = self.embed_norm(x)
        mask = valid[:, None, None, :]  # keys that exist
        for layer in self.layers:
            x = layer(x, mask)
        return self._pool(x, valid)

    def _pool(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.pooling == "cls":
            pooled = x[:, 0]
        elif c.pooling == "max":
            pooled = x.masked_fill(~valid.unsqueeze(-1), -math.inf).amax(dim=1)
        else:
            weights = valid.unsqueeze(-1).to(x.dtype)
            pooled = (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=-1) if c.normalize else pooled

    def load_hf_weights(self, w: dict[str, torch.Tensor]) -> None:
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in w else ""

        def take(name: str) -> torch.Tensor:
            return w[prefix + name]

        with torch.no_grad():
            self.word.weight.copy_(take("embeddings.word_embeddings.weight"))
            self.position.weight.copy_(take("embeddings.position_embeddings.weight"))
            self.token_type.weight.copy_(take("embeddings.token_type_embeddings.weight"))
            self.embed_norm.weight.copy_(take("embeddings.LayerNorm.weight"))
            self.embed_norm.bias.copy_(take("embeddings.LayerNorm.bias"))
            for i, layer in enumerate(self.layers):
                p = f"encoder.layer.{i}."
                for part in ("weight", "bias"):
                    layer.qkv.__getattr__(part).copy_(torch.cat(
                        [take(f"{p}attention.self.{n}.{part}") for n in ("query", "key", "value")]))
                    layer.attn_out.__getattr__(part).copy_(take(f"{p}attention.output.dense.{part}"))
                    layer.attn_norm.__getattr__(part).copy_(
                        take(f"{p}attention.output.LayerNorm.{part}"))
                    layer.intermediate.__getattr__(part).copy_(take(f"{p}intermediate.dense.{part}"))
                    layer.output.__getattr__(part).copy_(take(f"{p}output.dense.{part}"))
                    layer.out_norm.__getattr__(part).copy_(take(f"{p}output.LayerNorm.{part}"))
