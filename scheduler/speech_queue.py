"""Speech as a step source (step_source.py): requests waiting for their next audio chunk.

Requests that have produced no audio yet go first (their first segment is short, so the first
audio comes quickly); the others take turns, one segment each, so a long text doesn't hold
back shorter ones.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pipelines.speech_context import TTSContext
from serialization.messages import AudioChunk, AudioResult, AudioStep, ResponseBatch


class SpeechQueue:
    kind = "speech"
    context_type = TTSContext
    result_type = AudioResult

    def __init__(self) -> None:
        self._step_id = 0
        self.fresh: deque[TTSContext] = deque()
        self.started: deque[TTSContext] = deque()
        self.running: str | None = None  # the request whose segment the worker runs now
        self.cancelled = False  # ...and it was aborted meanwhile: don't put it back

    @property
    def has_work(self) -> bool:
        return bool(self.fresh or self.started)

    def __len__(self) -> int:
        return len(self.fresh) + len(self.started)

    def add(self, ctx: TTSContext) -> None:
        self.fresh.append(ctx)

    def abort(self, request_ids: set[str]) -> None:
        """Drop these requests (any id that is not a speech request is ignored: the
        cancellation channel carries every kind)."""
        if self.running in request_ids:
            self.cancelled = True
        if self:
            self.fresh = deque(c for c in self.fresh if c.request_id not in request_ids)
            self.started = deque(c for c in self.started if c.request_id not in request_ids)

    def take(self) -> TTSContext:
        """The request whose next segment runs now (put it back with `put_back`)."""
        ctx = self.fresh.popleft() if self.fresh else self.started.popleft()
        self.running, self.cancelled = ctx.request_id, False
        return ctx

    def put_back(self, ctx: TTSContext, failed: bool = False) -> None:
        """Its segment is done: back in line unless it finished, failed or was aborted."""
        cancelled = self.cancelled and self.running == ctx.request_id
        self.running, self.cancelled = None, False
        if not (cancelled or failed or ctx.is_done):
            self.started.append(ctx)

    def next_step(self) -> tuple[AudioStep, tuple[TTSContext, int]] | None:
        """The next chunk of the request whose turn it is."""
        if not self.has_work:
            return None
        ctx = self.take()
        step = AudioStep(step_id=self._step_id, contexts=[ctx])
        self._step_id += 1
        return step, (ctx, ctx._audio_chunks)

    def after_step(self, sent: tuple[TTSContext, int], result: AudioResult) -> ResponseBatch:
        ctx, index = sent
        failed = result.error is not None
        audio = result.audio[0] if result.audio else np.zeros(0, np.int16)
        if not failed:
            ctx.decoded_index = result.decoded_index[0]
            ctx._audio_chunks += 1
            if ctx.status.is_done and not ctx.has_undecoded_speech_tokens():
                ctx.update_audio_generation_status(ctx.status)
        chunk = AudioChunk(request_id=ctx.request_id, audio=audio, index=index,
                           is_last=ctx.is_done or failed,
                           synthesis_seconds=result.finished_at - result.started_at,
                           error=result.error)
        self.put_back(ctx, failed)
        return ResponseBatch(outputs=[], audio=[chunk])
