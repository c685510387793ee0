"""Embeddings as a step source (step_source.py): first come, first served, as many inputs per
forward as the padded token budget allows (a batch costs about count x longest input)."""

from __future__ import annotations

from collections import deque

import numpy as np

from pipelines.embeddings import EmbeddingsContext
from serialization.messages import EmbeddingOutput, EmbedResult, EmbedStep, ResponseBatch


class EmbeddingBatcher:
    kind = "embed"
    context_type = EmbeddingsContext
    result_type = EmbedResult

    def __init__(self, max_batch_tokens: int, max_batch_size: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[EmbeddingsContext] = deque()
        self._step_id = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    def add(self, ctx: EmbeddingsContext) -> None:
        self.waiting.append(ctx)

    def abort(self, request_ids: set[str]) -> None:
        self.waiting = deque(c for c in self.waiting if c.request_id not in request_ids)

    def next_batch(self) -> list[EmbeddingsContext]:
        batch: list[EmbeddingsContext] = []
        longest = 0
        while self.waiting and len(batch) < self.max_batch_size:
            longest_with = max(longest, len(self.waiting[0].tokens))
            if batch and longest_with * (len(batch) + 1) > self.max_batch_tokens:
                break
            batch.append(self.waiting.popleft())
            longest = longest_with
        return batch

    def next_step(self) -> tuple[EmbedStep, list[str]] | None:
        batch = self.next_batch()
        if not batch:
            return None
        step = EmbedStep(
            step_id=self._step_id,
            request_ids=[c.request_id for c in batch],
            input_ids=np.concatenate([c.tokens for c in batch]).astype(np.int32),
            lengths=np.array([len(c.tokens) for c in batch], dtype=np.int32),
        )
        self._step_id += 1
        return step, step.request_ids

    def after_step(self, request_ids: list[str], result: EmbedResult) -> ResponseBatch:
        if result.error is not None:
            empty = np.zeros(0, np.float32)
            outputs = [EmbeddingOutput(rid, empty, result.error) for rid in request_ids]
        else:
            outputs = [EmbeddingOutput(rid, result.embeddings[i])
                       for i, rid in enumerate(request_ids)]
        return ResponseBatch(outputs=[], embeddings=outputs)
