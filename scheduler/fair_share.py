"""How text and speech share the one worker when both have work: each gets half its time."""

from __future__ import annotations


class FairShare:
    """The kind of work that has used less of the worker's time while both waited goes next;
    either kind alone runs back to back (and the account starts again)."""

    def __init__(self) -> None:
        self.busy = {"text": 0.0, "speech": 0.0}

    def record(self, kind: str, seconds: float) -> None:
        if kind in self.busy:  # (embeddings run alone)
            self.busy[kind] += seconds

    def speech_next(self, text_waiting: bool, speech_waiting: bool) -> bool:
        if not (text_waiting and speech_waiting):
            self.busy = {"text": 0.0, "speech": 0.0}
            return speech_waiting
        return self.busy["speech"] <= self.busy["text"]
