"""A BERT encoder (all-MiniLM, BGE, E5 and other sentence-transformers models) for embeddings,
as MAX's BERT `PipelineModel`: `execute` returns each context's pooled (and, as the checkpoint
says, normalized) embedding in `ModelOutputs.logits`.

A batch is padded to its longest input and run in one forward; the attention mask keeps
padding out of every sequence, and pooling (mean, CLS or max, as the checkpoint's
sentence-transformers config says) happens here too. An encoder keeps no KV cache: its
KVCacheMixin methods size nothing (0 bytes, as MAX's encoders report) and it has no next
token to prepare inputs for.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipelines.checkpoint.bert_config import BertConfig
from pipelines.config import PipelineConfig
from pipelines.context import TextContext
from pipelines.pipeline import KVCacheInputs, ModelInputs, ModelOutputs, PipelineModel
from worker.device import DTYPES
from worker.weights import empty_embedding, load_checkpoint_weights, materialize_on_cpu

logger = logging.getLogger(__name__)


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
        positions = torch.arange(length, device=input_ids.device).unsqueeze(0)
        valid = positions < lengths.unsqueeze(1)  # [B, L]
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


@dataclass
class BertInputs(ModelInputs):
    input_ids: torch.Tensor  # [B, L] int64, each context's tokens, padded to the longest
    lengths: torch.Tensor  # [B] int64


class BertPipelineModel(PipelineModel):
    """The encoder behind /v1/embeddings, built as `cls(pipeline_config, session)` from the
    checkpoint at `pipeline_config.model_config.model_path`."""

    def __init__(self, pipeline_config: PipelineConfig, session: torch.device) -> None:
        super().__init__(pipeline_config, session)
        started = time.monotonic()
        path = pipeline_config.model_config.model_path
        self.config = BertConfig.from_dir(path)
        with torch.device("meta"):
            encoder = BertEncoder(self.config)
        materialize_on_cpu(encoder)
        encoder.load_hf_weights(load_checkpoint_weights(path))
        dtype = DTYPES[pipeline_config.model_config.dtype or "float32"]
        self.encoder = encoder.to(dtype).eval().to(session)
        logger.info("embedding model %s (%d dims, %s pooling) loaded in %.1fs", path,
                    self.config.hidden_size, self.config.pooling, time.monotonic() - started)

    def prepare_initial_token_inputs(self, context_batch: Sequence[TextContext],
                                     kv_cache_inputs: KVCacheInputs | None = None,
                                     return_n_logits: int = 1) -> BertInputs:
        """Each context's window (its whole input, for a new context), padded to the
        longest."""
        if kv_cache_inputs is not None:
            raise ValueError("an encoder keeps no KV cache: pass no kv_cache_inputs")
        windows = [ctx.next_tokens for ctx in context_batch]
        ids = torch.zeros((len(windows), max(len(w) for w in windows)), dtype=torch.long)
        for row, window in enumerate(windows):
            ids[row, : len(window)] = torch.from_numpy(window)
        lengths = torch.tensor([len(w) for w in windows], dtype=torch.long)
        return BertInputs(input_ids=ids.to(self.session), lengths=lengths.to(self.session))

    def prepare_next_token_inputs(self, next_tokens, prev_model_inputs):
        raise NotImplementedError("an encoder embeds its inputs in one forward: it has no "
                                  "next token")

    def execute(self, model_inputs: BertInputs) -> ModelOutputs:
        """`logits`: float32 [B, hidden], each context's embedding."""
        with torch.inference_mode():
            pooled = self.encoder(model_inputs.input_ids, model_inputs.lengths)
        return ModelOutputs(logits=pooled.float())

    # An encoder keeps no KV cache (MAX's encoders size theirs as 0 bytes).
    def estimate_memory_footprint(self) -> int:
        return 0

    def estimate_kv_cache_size(self, available_cache_memory: int) -> int:
        return 0

    def load_kv_manager(self, session, available_cache_memory):
        raise ValueError("an encoder keeps no KV cache: there is no KV manager to load")
