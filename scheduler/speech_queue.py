"""Speech requests waiting for their next segment.

Requests that have produced no audio yet go first (their first segment is short, so the first
audio comes quickly); the others take turns, one segment each, so a long text doesn't hold
back shorter ones.
"""

from __future__ import annotations

from collections import deque

from pipelines.tts_context import TTSContext


class SpeechQueue:
    def __init__(self) -> None:
        self.fresh: deque[TTSContext] = deque()
        self.started: deque[TTSContext] = deque()
        self.cancelled: set[str] = set()  # aborted while a segment of theirs was running

    @property
    def has_work(self) -> bool:
        return bool(self.fresh or self.started)

    def __len__(self) -> int:
        return len(self.fresh) + len(self.started)

    def add(self, ctx: TTSContext) -> None:
        self.fresh.append(ctx)

    def abort(self, request_id: str) -> None:
        before = len(self)
        self.fresh = deque(c for c in self.fresh if c.request_id != request_id)
        self.started = deque(c for c in self.started if c.request_id != request_id)
        if len(self) == before:
            self.cancelled.add(request_id)

    def take(self) -> TTSContext:
        """The request whose next segment runs now (put it back with `put_back`)."""
        return self.fresh.popleft() if self.fresh else self.started.popleft()

    def put_back(self, ctx: TTSContext) -> None:
        if ctx.request_id in self.cancelled:
            self.cancelled.discard(ctx.request_id)
        elif not ctx.is_done:
            self.started.append(ctx)
