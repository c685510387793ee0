"""How text and one other kind of work (speech, or image denoising) share the one worker when
both have work: the other kind gets a fixed share of its time."""

from __future__ import annotations

# Speech is interactive too: half the worker. A denoising step costs several text steps
# (bench/images.py measures both), so image requests get a quarter: text decode steps go on
# back to back between them, and its inter-token latency's median stays a text step's.
SPEECH_SHARE = 0.5
PIXEL_SHARE = 0.25


class FairShare:
    """The kind of work that has used less than its share of the worker's time while both
    waited goes next; either kind alone runs back to back (and the account starts again)."""

    def __init__(self, other: str = "speech", share: float = SPEECH_SHARE) -> None:
        self.other, self.share = other, share
        self.busy = {"text": 0.0, other: 0.0}

    def record(self, kind: str, seconds: float) -> None:
        if kind in self.busy:  # (embeddings run alone)
            self.busy[kind] += seconds

    def other_next(self, text_waiting: bool, other_waiting: bool) -> bool:
        if not (text_waiting and other_waiting):
            self.busy = {"text": 0.0, self.other: 0.0}
            return other_waiting
        return self.busy[self.other] * (1 - self.share) <= self.busy["text"] * self.share
