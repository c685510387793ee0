"""A BERT checkpoint's config and sentence-transformers head (pooling, normalisation), read
without importing torch: the API process needs it too."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pooling: str  # "mean", "cls" or "max"
    normalize: bool
    max_seq_length: int  # longest input the model was trained for

    @classmethod
    def from_dir(cls, model_dir: str) -> "BertConfig":
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
        pooling, normalize = _sentence_transformers_head(model_dir)
        max_len = raw.get("max_position_embeddings", 512)
        st_path = os.path.join(model_dir, "sentence_bert_config.json")
        if os.path.isfile(st_path):
            with open(st_path) as f:
                max_len = min(max_len, json.load(f).get("max_seq_length", max_len))
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw.get("max_position_embeddings", 512),
            type_vocab_size=raw.get("type_vocab_size", 2),
            layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
            hidden_act=raw.get("hidden_act", "gelu"), pooling=pooling, normalize=normalize,
            max_seq_length=max_len,
        )


def _sentence_transformers_head(model_dir: str) -> tuple[str, bool]:
    """Pooling mode and whether vectors are L2-normalised, from modules.json (default: mean,
    normalised, the common sentence-embedding recipe)."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return "mean", True
    with open(modules_path) as f:
        modules = json.load(f)
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    pooling = "mean"
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            with open(os.path.join(model_dir, m["path"], "config.json")) as f:
                cfg = json.load(f)
            if cfg.get("pooling_mode_cls_token"):
                pooling = "cls"
            elif cfg.get("pooling_mode_max_tokens"):
                pooling = "max"
    return pooling, normalize
