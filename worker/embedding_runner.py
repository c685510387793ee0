"""EmbeddingRunner: MAX's EmbeddingsGenerator (max.pipelines), on Loom's own BERT encoder.

`encode(batch)` takes a batch of contexts (tokenized inputs) by request id and returns an
EmbeddingsResponse per request id, computed in a single padded forward pass (inputs are sorted
by length first so little is padding). The embeddings worker runs it on each EmbedStep.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pipelines.checkpoint.bert_config import BertConfig
from pipelines.embeddings import EmbeddingsContext, EmbeddingsResponse
from worker.models.bert import BertEncoder
from worker.weights import load_checkpoint_weights, materialize_on_cpu

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class EmbeddingRunner:
    def __init__(self, model_dir: str, dtype: str = "float32") -> None:
        started = time.monotonic()
        self.config = BertConfig.from_dir(model_dir)
        with torch.device("meta"):
            model = BertEncoder(self.config)
        materialize_on_cpu(model)
        model.load_hf_weights(load_checkpoint_weights(model_dir))
        self.model = model.to(DTYPES[dtype]).eval()
        self.dim = self.config.hidden_size
        logger.info("embedding model %s (%d dims, %s pooling) loaded in %.1fs", model_dir,
                    self.dim, self.config.pooling, time.monotonic() - started)

    @property
    def max_model_len(self) -> int:
        return self.config.max_seq_length

    def encode(self, batch: dict[str, EmbeddingsContext]) -> dict[str, EmbeddingsResponse]:
        """A float32 [dim] vector per request id; one forward for the whole batch."""
        ids = list(batch)
        vectors = self.embed([batch[i].tokens for i in ids])
        return {i: EmbeddingsResponse(v) for i, v in zip(ids, vectors)}

    def embed(self, inputs: list[np.ndarray]) -> np.ndarray:
        """float32 [len(inputs), dim]."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        longest = max(len(x) for x in inputs)
        ids = torch.zeros((len(inputs), longest), dtype=torch.long)
        lengths = torch.empty(len(inputs), dtype=torch.long)
        for row, i in enumerate(order):
            ids[row, : len(inputs[i])] = torch.from_numpy(inputs[i].astype(np.int64))
            lengths[row] = len(inputs[i])
        with torch.inference_mode():
            pooled = self.model(ids, lengths).float().numpy()
        out = np.empty_like(pooled)
        out[order] = pooled
        return out
