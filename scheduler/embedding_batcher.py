"""Batching embeddings inputs: first come, first served, as many per forward as the padded
token budget allows (a batch costs about count x longest input)."""

from __future__ import annotations

from collections import deque

from pipelines.embeddings import EmbeddingsContext


class EmbeddingBatcher:
    def __init__(self, max_batch_tokens: int, max_batch_size: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[EmbeddingsContext] = deque()

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
