"""EmbeddingRunner: MAX's EmbeddingsGenerator (max.pipelines' EmbeddingsPipeline), running the
embedding model through its `PipelineModel` contract (worker/models/bert.py).

`encode(batch)` takes a batch of contexts (tokenized inputs) by request id and returns an
EmbeddingsResponse per request id, computed in one padded forward: the model's
`prepare_initial_token_inputs(contexts)`, then `execute`, whose `logits` are the embeddings.
The embeddings worker runs it on each EmbedStep.
"""

from __future__ import annotations

import torch

from pipelines.config import PipelineConfig
from pipelines.context import TextContext
from pipelines.embeddings import EmbeddingsResponse
from worker.models.bert import BertPipelineModel


class EmbeddingRunner:
    def __init__(self, pipeline_config: PipelineConfig,
                 session: torch.device = torch.device("cpu")) -> None:
        self.model = BertPipelineModel(pipeline_config, session)
        self.dim = self.model.config.hidden_size

    @property
    def max_model_len(self) -> int:
        return self.model.config.max_seq_length

    def encode(self, batch: dict[str, TextContext]) -> dict[str, EmbeddingsResponse]:
        """A float32 [dim] vector per request id; one forward for the whole batch."""
        inputs = self.model.prepare_initial_token_inputs(list(batch.values()))
        vectors = self.model.execute(inputs).logits.cpu().numpy()
        return {rid: EmbeddingsResponse(v) for rid, v in zip(batch, vectors)}
