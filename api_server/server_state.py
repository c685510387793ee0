"""Whether the server takes new work: readiness, death, drain, stalls and the queue bound.

Health and admission are one decision seen from two sides: `/health` reports it, and the
generation routes refuse work (503 or 429, with Retry-After) for the same reasons.
"""

from __future__ import annotations

import time

from api_server.engine_client import EngineClient
from api_server.protocol import RequestError
from pipelines.config import AdmissionLimits


class ServerState:
    def __init__(self, engine: EngineClient, limits: AdmissionLimits) -> None:
        self.engine = engine
        self.limits = limits
        self.draining = False

    def stalled_for(self) -> float:
        """Seconds the engine has had work in flight without finishing a step (0 if fine)."""
        engine = self.engine
        if not engine.num_in_flight:
            return 0.0
        return max(0.0, time.monotonic() - max(engine.last_progress_at, engine.busy_since))

    def unhealthy_reason(self) -> str | None:
        if self.engine.dead_reason is not None:
            return self.engine.dead_reason
        if self.engine.ready is None:
            return "starting"
        if self.draining:
            return "shutting down"
        stalled = self.stalled_for()
        if stalled > self.limits.step_timeout:
            return f"no step completed for {stalled:.0f}s with work queued"
        return None

    def admit(self, contexts, num_requests: int | None = None) -> None:
        """Raise a 503 or 429 RequestError unless these contexts can be accepted; if they
        can, they count as queued from now on. `num_requests`: what the request counts as
        against the queue's request bound (default: one per context)."""
        self.check_available()
        self.engine.expire_reservations()
        num_requests = len(contexts) if num_requests is None else num_requests
        prompt_tokens = sum(c.prompt_length for c in contexts)
        self.check_queue_room(num_requests, prompt_tokens)
        self.engine.reserve(contexts)

    def check_available(self) -> None:
        reason = self.unhealthy_reason()
        if reason is not None:
            raise RequestError(f"the server is not accepting requests: {reason}", status=503,
                               code="service_unavailable")

    def check_queue_room(self, num_requests: int, prompt_tokens: int = 0) -> None:
        """Raise unless `num_requests` more requests (with `prompt_tokens` prompt tokens) fit
        the queue bounds. Called before tokenizing with the count alone, and at admission.

        A request that could not fit even an empty queue is a 400 (retrying can't help); one
        that does not fit the queue as it is now, a 429."""
        limits = self.limits
        if num_requests > limits.max_queued_requests:
            raise RequestError(
                f"this request holds {num_requests} sequences; the server queues at most "
                f"{limits.max_queued_requests} (--max-queued-requests)", code="too_many_sequences")
        if prompt_tokens > limits.max_queued_tokens:
            raise RequestError(
                f"this request holds {prompt_tokens} prompt tokens; the server queues at most "
                f"{limits.max_queued_tokens} (--max-queued-tokens)", code="too_many_tokens")
        queued, queued_tokens = self.engine.queued_requests, self.engine.queued_tokens
        if queued + num_requests > limits.max_queued_requests:
            raise RequestError(
                f"too many requests queued ({queued}); retry later", status=429,
                code="queue_full")
        if queued_tokens + prompt_tokens > limits.max_queued_tokens:
            raise RequestError(
                f"too many prompt tokens queued ({queued_tokens}); retry later", status=429,
                code="queue_full")
