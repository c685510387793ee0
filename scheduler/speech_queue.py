"""Speech as a step source (step_source.py): requests waiting for their next audio chunk.

Two kinds of request, one per worker: Piper's, whose speech tokens (phonemes) are all known
when it arrives, and a speech-token model's (Orpheus), whose language model writes them. The
latter also go to the text source: the language model runs them in the text batch, and before
each speech step the queue reads what it generated into the speech tokens. A request is ready
for a chunk when a whole chunk (and the frames the decoder holds back) is there, or its
language model is done.

Requests that have produced no audio yet go first (their first chunk comes quickly); the
others take turns, so a long text doesn't hold back shorter ones. A speech-token decoder
decodes the chunks of up to `max_batch` ready requests in one step, as many as take about
one chunk's time (chunk_batch_limit.py); Piper one.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pipelines import orpheus
from pipelines.speech_context import TTSContext
from scheduler.chunk_batch_limit import ChunkBatchLimit
from serialization.messages import AudioChunk, AudioResult, AudioStep, ResponseBatch


class SpeechQueue:
    kind = "speech"
    context_type = TTSContext
    result_type = AudioResult

    def __init__(self, lm=None, *, chunk_tokens: int = orpheus.AUDIO_CHUNK_TOKENS,
                 held_back_tokens: int = orpheus.LOOKAHEAD_TOKENS, max_batch: int = 16) -> None:
        self.lm = lm  # the text source, for a speech-token model (None: Piper)
        self.chunk_tokens = chunk_tokens if lm is not None else 0
        self.held_back_tokens = held_back_tokens
        self.batch_limit = ChunkBatchLimit(max_batch if lm is not None else 1)
        self._step_id = 0
        self.fresh: deque[TTSContext] = deque()
        self.started: deque[TTSContext] = deque()
        self._running: set[str] = set()  # the requests whose chunks the worker runs now
        self._cancelled: set[str] = set()  # ...aborted meanwhile: don't put them back

    @property
    def running(self) -> str | None:
        return next(iter(self._running), None)

    @property
    def cancelled(self) -> bool:
        return bool(self._cancelled)

    @property
    def has_work(self) -> bool:
        return any(self._ready(ctx) for ctx in self._waiting())

    def __len__(self) -> int:
        return len(self.fresh) + len(self.started)

    def owns(self, request_id: str) -> bool:
        return any(ctx.request_id == request_id for ctx in self._waiting()) \
            or request_id in self._running

    def add(self, ctx: TTSContext) -> None:
        if not ctx.is_done:  # a language model writes its speech tokens
            if self.lm is None:
                raise ValueError("this worker has no speech-token model")
            self.lm.add(ctx)
        self.fresh.append(ctx)

    def abort(self, request_ids: set[str]) -> None:
        """Drop these requests (any id that is not a speech request is ignored: the
        cancellation channel carries every kind)."""
        self._cancelled |= self._running & request_ids
        if self:
            self.fresh = deque(c for c in self.fresh if c.request_id not in request_ids)
            self.started = deque(c for c in self.started if c.request_id not in request_ids)

    def take(self) -> TTSContext:
        """The next ready request (put it back with `put_back`)."""
        for line in (self.fresh, self.started):
            for ctx in line:
                if self._ready(ctx):
                    line.remove(ctx)
                    self._running.add(ctx.request_id)
                    self._cancelled.discard(ctx.request_id)
                    return ctx
        raise LookupError("no speech request is ready")

    def put_back(self, ctx: TTSContext, failed: bool = False) -> None:
        """Its chunk is done: back in line unless it finished, failed or was aborted."""
        cancelled = ctx.request_id in self._cancelled
        self._running.discard(ctx.request_id)
        self._cancelled.discard(ctx.request_id)
        if failed and self.lm is not None and not ctx.is_done:
            self.lm.abort({ctx.request_id})
        if not (cancelled or failed or ctx.audio_generation_status.is_done):
            self.started.append(ctx)

    def next_step(self) -> tuple[AudioStep, list[tuple[TTSContext, int]]] | None:
        """The next chunks of the requests whose turn it is."""
        sent: list[tuple[TTSContext, int]] = []
        while len(sent) < self.batch_limit.limit and self.has_work:
            ctx = self.take()
            sent.append((ctx, ctx._audio_chunks))
        if not sent:
            return None
        step = AudioStep(step_id=self._step_id, contexts=[ctx for ctx, _ in sent],
                         num_tokens=self.chunk_tokens)
        self._step_id += 1
        return step, sent

    def after_step(self, sent: list[tuple[TTSContext, int]], result: AudioResult
                   ) -> ResponseBatch:
        failed = result.error is not None
        if not failed:
            self.batch_limit.record(len(sent), result.finished_at - result.started_at)
        chunks = []
        for i, (ctx, index) in enumerate(sent):
            audio = result.audio[i] if i < len(result.audio) else np.zeros(0, np.int16)
            if not failed:
                ctx.decoded_index = result.decoded_index[i]
                ctx._audio_chunks += 1
                if ctx.is_done and not ctx.has_undecoded_speech_tokens(
                        exclude_last_n=self._partial_frame(ctx)):
                    ctx.update_audio_generation_status(ctx.status)
            chunks.append(AudioChunk(request_id=ctx.request_id, audio=audio, index=index,
                                     is_last=ctx.audio_generation_status.is_done or failed,
                                     synthesis_seconds=result.finished_at - result.started_at,
                                     error=result.error))
            self.put_back(ctx, failed)
        return ResponseBatch(outputs=[], audio=chunks)

    # ---- a speech-token model's requests ----------------------------------------------------
    def _waiting(self):
        yield from self.fresh
        yield from self.started

    def _ready(self, ctx: TTSContext) -> bool:
        if ctx.audio_generation_status.is_done:
            return False
        if self.lm is None:
            return True
        self._read_generated(ctx)
        undecoded = len(ctx.speech_tokens) - ctx.decoded_index
        return ctx.is_done or undecoded >= self.chunk_tokens + self.held_back_tokens

    def _partial_frame(self, ctx: TTSContext) -> int:
        return len(ctx.speech_tokens) % orpheus.TOKENS_PER_FRAME if self.lm is not None else 0

    @staticmethod
    def _read_generated(ctx: TTSContext) -> None:
        """Move what the language model generated since the last read into the speech
        tokens (tokens still being sampled stay for the next read)."""
        start = ctx.prompt_length if ctx._lm_read_idx < 0 else ctx._lm_read_idx
        end = ctx.end_idx - ctx.num_future
        if end > start:
            accepted = orpheus.accept_speech_tokens(ctx.tokens[start:end],
                                                    len(ctx.speech_tokens))
            if len(accepted):
                ctx.update_speech_tokens(accepted)
        ctx._lm_read_idx = max(start, end)
