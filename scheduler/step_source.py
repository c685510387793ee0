"""What the arbiter (arbiter.py) asks of each kind of work the worker runs: text generation
(text_source.py), embeddings (embedding_batcher.py) and speech (speech_queue.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from serialization.messages import ResponseBatch


class StepSource(Protocol):
    kind: str  # "text", "embed" or "speech": its share of the worker's time is kept by kind
    context_type: type  # what it takes from the requests socket
    result_type: type  # what answers its steps on the results socket

    @property
    def has_work(self) -> bool: ...

    def add(self, ctx: Any) -> None: ...

    def abort(self, request_ids: set[str]) -> None:
        """Forget these requests (ids of other kinds of work are ignored: the cancellation
        channel carries every kind)."""

    def next_step(self) -> tuple[Any, Any] | None:
        """(the step message for the workers, what the source needs back with its result),
        or None when nothing can run now."""

    def after_step(self, sent: Any, result: Any) -> ResponseBatch:
        """A step's result, applied by the source that made it and turned into what goes
        back to the API process."""


@dataclass
class SentStep:
    """A step the workers have or will run next, and who made it."""

    source: StepSource
    step_id: int
    state: Any  # the source's own record of it (next_step's second item)
