"""Whether the server takes new work: readiness, death, drain, stalls and the queue bound.

Health and admission are one decision seen from two sides: `/health` reports it, and the
generation routes refuse work (503 or 429, with Retry-After) for the same reasons.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from api_server.engine_client import EngineClient
from api_server.protocol import RequestError


@dataclass
class AdmissionLimits:
    max_queued_requests: int = 512  # requests sent but not yet producing their first token
    max_queued_tokens: int = 1_000_000  # their prompt tokens
    step_timeout: float = 120.0  # work in flight but no step finished for this long: stalled


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

    def admit(self, contexts) -> None:
        """Raise a 503 or 429 RequestError unless these contexts can be accepted; if they
        can, they count as queued from now on."""
        self.check_available()
        self.engine.expire_reservations()
        num_requests = len(contexts)
        prompt_tokens = sum(c.prompt_length for c in contexts)
        self._check_queue(num_requests, prompt_tokens)
        self.engine.reserve(contexts)

    def check_available(self) -> None:
        reason = self.unhealthy_reason()
        if reason is not None:
            raise RequestError(f"the server is not accepting requests: {reason}", status=503,
                               code="service_unavailable")

    def _check_queue(self, num_requests: int, prompt_tokens: int) -> None:
        queued, queued_tokens = self.engine.queued_requests, self.engine.queued_tokens
        if queued and queued + num_requests > self.limits.max_queued_requests:
            raise RequestError(
                f"too many requests queued ({queued}); retry later", status=429,
                code="queue_full")
        if queued and queued_tokens + prompt_tokens > self.limits.max_queued_tokens:
            raise RequestError(
                f"too many prompt tokens queued ({queued_tokens}); retry later", status=429,
                code="queue_full")
