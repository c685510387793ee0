"""What generation produces: per-token responses and per-step outputs."""

from __future__ import annotations

import msgspec

from pipelines.status import GenerationStatus


class LogProbabilities(msgspec.Struct, array_like=True):
    """Log probabilities for output tokens: one entry per token."""

    token_log_probabilities: list[float]
    top_log_probabilities: list[dict[int, float]]


class TextResponse(msgspec.Struct, array_like=True):
    """One generated token (id, or text once detokenized) and its log probabilities."""

    next_token: int | str
    log_probabilities: LogProbabilities | None = None


class RequestTimings(msgspec.Struct, array_like=True):
    """When the scheduler saw a request through its life (host-wide monotonic seconds)."""

    arrival: float  # received by the scheduler
    first_scheduled: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    num_preemptions: int = 0


class TextGenerationOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """The tokens a request produced since its previous output, and where it stands.

    This is what the scheduler sends back to the API process each step (batched across
    requests), so it is kept flat: `array_like` encodes it as a msgpack array, not a map.
    """

    request_id: str
    tokens: list[int]
    final_status: GenerationStatus = GenerationStatus.ACTIVE
    log_probabilities: list[LogProbabilities] | None = None
    # Set when final_status is ERROR: what went wrong, for the client.
    error: str | None = None
    # Set on the final output: the scheduler's view of the request's life, for metrics.
    timings: RequestTimings | None = None
    # Echo: log probabilities of prompt tokens resolved since the previous output, one entry
    # per token from prompt position 1 on, in order.
    prompt_log_probabilities: list[LogProbabilities] | None = None
    # Set on the final output of a request that speculated: tokens proposed and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def is_done(self) -> bool:
        return self.final_status.is_done
