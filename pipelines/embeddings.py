"""Embeddings: the context of one input to embed as the API process sends it, and the
EmbeddingsGenerator interface the embeddings worker runs over TextContexts (MAX's)."""

from __future__ import annotations

import uuid
from typing import Protocol, runtime_checkable

import msgspec
import numpy as np

from pipelines.context import TextContext


class EmbeddingsContext(msgspec.Struct, tag=True, kw_only=True, eq=False):
    """One tokenized input of an embeddings request (a request with N inputs has N)."""

    tokens: np.ndarray
    request_id: str = msgspec.field(default_factory=lambda: uuid.uuid4().hex)
    model_name: str = ""

    @property
    def prompt_length(self) -> int:
        return len(self.tokens)


class EmbeddingsResponse(msgspec.Struct):
    embeddings: np.ndarray  # float32 [dim]


@runtime_checkable
class EmbeddingsGenerator(Protocol):
    """What the embeddings worker runs (worker/embedding_runner.py)."""

    def encode(self, batch: dict[str, TextContext]) -> dict[str, EmbeddingsResponse]: ...
