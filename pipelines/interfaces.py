"""The pipeline interfaces of max.pipelines.core, as typing Protocols."""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from pipelines.response import TextResponse

RequestT = TypeVar("RequestT", contravariant=True)
ContextT = TypeVar("ContextT")


@runtime_checkable
class PipelineTokenizer(Protocol, Generic[ContextT, RequestT]):
    """Turns requests into model-ready contexts (API process side)."""

    @property
    def eos(self) -> int: ...

    @property
    def expects_content_wrapping(self) -> bool: ...

    async def encode(self, prompt: str, add_special_tokens: bool = False) -> Any: ...

    async def decode(self, context: ContextT, encoded: Any, **kwargs: Any) -> str: ...

    async def new_context(self, request: RequestT) -> ContextT: ...


@runtime_checkable
class TokenGenerator(Protocol, Generic[ContextT]):
    """Runs a batch of contexts forward and returns the next tokens, each context updated
    with its token. `worker.pipeline.TextGenerationPipeline` is the one the worker runs."""

    def next_token(
        self, batch: dict[str, ContextT], num_steps: int = 1
    ) -> list[dict[str, TextResponse]]: ...

    def release(self, context: ContextT) -> None: ...
