"""How text and the work beside it (speech, image denoising) share the one worker when they
wait together: each kind beside text gets a fixed share of the worker's time."""

from __future__ import annotations

# Speech is interactive too: half the worker. A denoising step costs several text steps
# (bench/images.py measures both), so image requests get a quarter: text decode steps go on
# back to back between them, and its inter-token latency's median stays a text step's.
SHARES = {"speech": 0.5, "pixels": 0.25}


class FairShare:
    """A kind that has used less than its share of the worker's time while it and text both
    waited goes next; any kind alone runs back to back (and the account starts again)."""

    def __init__(self, shares: dict[str, float] | None = None) -> None:
        self.shares = SHARES if shares is None else shares
        self._reset()

    def _reset(self) -> None:
        self.busy = dict.fromkeys(["text", *self.shares], 0.0)

    def record(self, kind: str, seconds: float) -> None:
        if kind in self.busy:  # (embeddings run alone)
            self.busy[kind] += seconds

    def next_kind(self, text_waiting: bool, waiting: list[str]) -> str | None:
        """Which of the kinds beside text that have work (`waiting`, first first when
        several are due) goes next; None: text."""
        if not (text_waiting and waiting):
            self._reset()
            return waiting[0] if waiting else None
        return next((kind for kind in waiting
                     if self.busy[kind] * (1 - self.shares[kind])
                     <= self.busy["text"] * self.shares[kind]), None)
