"""POST /v1/embeddings, as OpenAI defines it, served by an embeddings worker.

Each input becomes one EmbeddingsContext; the scheduler batches inputs (of this and other
requests) into padded forwards on the worker.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Literal, Union

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from api_server.engine_client import EngineClient, EngineDeadError, GenerationFailed
from api_server.off_loop import parse_body
from api_server.protocol import RequestError
from api_server.serving_context import ServingContext, error_response, json_response
from api_server.tokenizer import INLINE_TOKENIZE_CHARS
from pipelines.embeddings import EmbeddingsContext

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of lists of token ids.
    input: Union[str, list[Union[str, int, list[int]]]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingsRoute:
    def __init__(self, serving: ServingContext, engine: EngineClient, serves_embeddings: bool):
        self.serving = serving
        self.engine = engine
        self.tokenizer = serving.tokenizer
        self.serves_embeddings = serves_embeddings

    async def create(self, request: Request) -> Response:
        try:
            req = await parse_body(await request.body(), EmbeddingRequest)
            self.serving.check_model(req.model)
            if not self.serves_embeddings:
                raise RequestError(f"the model `{self.serving.model_name}` generates text; serve "
                                   f"an embeddings model for /v1/embeddings", param="model")
            self.serving.check_available()
            if req.dimensions is not None and req.dimensions != self.serving.embedding_dim:
                raise RequestError(f"this model's embeddings have {self.serving.embedding_dim} "
                                   f"dimensions", param="dimensions")
            items = self._inputs(req.input)
            # One HTTP request, however many inputs (OpenAI takes up to 2048 per request).
            self.serving.state.check_queue_room(1)
            if sum(len(i) for i in items if isinstance(i, str)) > INLINE_TOKENIZE_CHARS:
                token_ids = await asyncio.to_thread(self._tokenize, items)
            else:
                token_ids = self._tokenize(items)
            contexts = [EmbeddingsContext(tokens=ids, model_name=self.serving.model_name,
                                          request_id=uuid.uuid4().hex) for ids in token_ids]
            self.serving.state.admit(contexts, num_requests=1)
        except RequestError as exc:
            return error_response(exc)
        work = asyncio.ensure_future(self.engine.embed(contexts))
        try:
            vectors = await work
        except (EngineDeadError, GenerationFailed) as exc:
            status = 503 if isinstance(exc, EngineDeadError) else 500
            return json_response({"error": {"message": str(exc), "type": "server_error",
                                            "param": None, "code": None}}, status=status)
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        tokens = sum(len(c.tokens) for c in contexts)
        return json_response({"object": "list", "data": data, "model": self.serving.model_name,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _inputs(self, value) -> list:
        if isinstance(value, str):
            items = [value]
        elif value and all(isinstance(v, int) for v in value):
            items = [value]
        else:
            items = list(value)
        if not items:
            raise RequestError("input must not be empty", param="input")
        if len(items) > MAX_INPUTS:
            raise RequestError(f"at most {MAX_INPUTS} inputs per request", param="input")
        for i, item in enumerate(items):
            if isinstance(item, str):
                param = "input" if len(items) == 1 else f"input[{i}]"
                self.tokenizer.check_prompt_chars(len(item), param)
        return items

    def _tokenize(self, items: list) -> list[np.ndarray]:
        out = []
        limit = self.serving.max_model_len
        for i, item in enumerate(items):
            param = "input" if len(items) == 1 else f"input[{i}]"
            if isinstance(item, str):
                if not item:
                    raise RequestError("input strings must not be empty", param=param)
                ids = self.tokenizer.delegate.encode(item, add_special_tokens=True)
            elif isinstance(item, list) and item and all(isinstance(t, int) for t in item):
                if min(item) < 0 or max(item) >= self.tokenizer.vocab_size:
                    raise RequestError("token ids outside the vocabulary", param=param)
                ids = item
            else:
                raise RequestError("each input must be a non-empty string or list of token ids",
                                   param=param)
            if len(ids) > limit:
                raise RequestError(f"input is {len(ids)} tokens long; this model takes at most "
                                   f"{limit}", param=param, code="context_length_exceeded")
            out.append(np.asarray(ids, dtype=np.int32))
        return out


def _encode(vector: np.ndarray, encoding_format: str):
    vector = np.asarray(vector, dtype=np.float32)
    if encoding_format == "base64":  # OpenAI's: little-endian float32 bytes, base64
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
