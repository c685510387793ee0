"""Which step the worker runs next: the arbiter owns the step sources of the worker's task
(text with speech or images beside it, images alone, or embeddings) and the steps sent to the
worker, so the loop (process.py) only moves frames.

Text steps overlap: while the worker runs text step N, step N+1 is already built and queued
behind it (scheduler.py says how), so the worker goes from one forward pass to the next
without waiting for this process. Speech or image denoising takes turns with text
(fair_share.py), decided when the worker is free, so nothing is queued ahead when their turn
is due.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from pipelines.config import PipelineConfig
from pipelines.status import PipelineTask
from scheduler.block_manager import BlockManager
from scheduler.embedding_batcher import EmbeddingBatcher
from scheduler.fair_share import FairShare
from scheduler.pixel_queue import MAX_RUNNING, PixelQueue
from scheduler.scheduler import Scheduler
from scheduler.speech_queue import SpeechQueue
from scheduler.step_source import SentStep, StepSource
from scheduler.text_source import TextSource
from serialization.messages import ResponseBatch, SchedulerStats, WorkerReady

logger = logging.getLogger("loom.scheduler")


class Arbiter:
    def __init__(self, text: TextSource, sources: list[StepSource],
                 speech: SpeechQueue | None = None, pixels: PixelQueue | None = None) -> None:
        # The text source reports the scheduler's stats even where it serves nothing
        # (an embeddings worker's), so it exists for every task.
        self.text = text
        self.speech = speech
        # What takes turns with text, each with its share of the worker (fair_share.py).
        self.beside = [s for s in (speech, pixels) if s is not None]
        self.sources = sources  # in the order they go first when nothing else decides
        self.fair_share = FairShare()
        # Steps sent to the worker, oldest first: at most two text steps (one running, one
        # queued behind it), or one embeddings, speech or pixel step.
        self.inflight: deque[SentStep] = deque()

    @classmethod
    def for_worker(cls, pipeline_config: PipelineConfig, ready: WorkerReady,
                   blocks: BlockManager) -> Arbiter:
        """The sources of the task the worker serves (speech where it has voices)."""
        text = TextSource(Scheduler(pipeline_config, blocks))
        if ready.task is PipelineTask.EMBEDDINGS_GENERATION:
            embeddings = EmbeddingBatcher(pipeline_config.max_embedding_batch_tokens,
                                          pipeline_config.max_batch_size)
            return cls(text, [embeddings])
        pixels = PixelQueue(min(pipeline_config.max_batch_size, MAX_RUNNING))
        if ready.task is PipelineTask.PIXEL_GENERATION:
            return cls(text, [pixels])
        if pipeline_config.pixel_config.image_model_path is None:  # (no images beside text)
            pixels = None
        speech = None
        if ready.voices:
            lm = text if ready.speech_task is PipelineTask.SPEECH_TOKEN_GENERATION else None
            speech = SpeechQueue(lm)
        return cls(text, [s for s in (text, speech, pixels) if s is not None], speech, pixels)

    @property
    def busy(self) -> bool:
        """The worker has a step to run (or runs one)."""
        return bool(self.inflight)

    # ---- requests ---------------------------------------------------------------------------
    def add(self, ctx: Any) -> None:
        # The most derived match: a TTSContext is a TextContext too.
        source = max((s for s in self.sources if isinstance(ctx, s.context_type)),
                     key=lambda s: len(s.context_type.__mro__), default=None)
        if source is not None:
            source.add(ctx)
        else:
            logger.warning("dropped a %s: the worker serves another task", type(ctx).__name__)

    def abort(self, request_ids: set[str]) -> None:
        for source in self.sources:
            source.abort(request_ids)

    # ---- steps ------------------------------------------------------------------------------
    def next_step(self) -> Any | None:
        """The next step message for the workers, or None when none should be sent now. Call
        it again after sending one: a text step may then be queued behind it."""
        if not self.inflight:
            for source in self._turn_order():
                planned = source.next_step()
                if planned is not None:
                    return self._sent(source, *planned)
            return None
        if self._may_queue_text_ahead():
            planned = self.text.next_step(ahead=True)
            if planned is not None:
                return self._sent(self.text, *planned)
        return None

    def _turn_order(self) -> list[StepSource]:
        """Text, speech or images next? Alone, each runs; together they share the worker's
        time (and text that cannot run yet lets the others go)."""
        due = self._due_beside()
        return [due] if due is not None else self.sources

    def _due_beside(self) -> StepSource | None:
        """The speech or image source whose turn it is, or None: text's."""
        if not self.beside:
            return None
        waiting = [s for s in self.beside if s.has_work]
        kind = self.fair_share.next_kind(self.text.has_work, [s.kind for s in waiting])
        return next((s for s in waiting if s.kind == kind), None)

    def _may_queue_text_ahead(self) -> bool:
        """Behind one running text step, unless speech's or the images' turn is due (they
        take turns with text, decided when the worker is free)."""
        return (len(self.inflight) == 1 and self.inflight[0].source is self.text
                and self._due_beside() is None)

    def _sent(self, source: StepSource, message: Any, state: Any) -> Any:
        self.inflight.append(SentStep(source, message.step_id, state))
        return message

    def after_step(self, result: Any) -> ResponseBatch | None:
        """The oldest step's result, handled by the source that made it: the outputs for the
        API process, or None for a result of no step in flight (dropped)."""
        sent = self.inflight[0] if self.inflight else None
        if (sent is None or not isinstance(result, sent.source.result_type)
                or result.step_id != sent.step_id):
            logger.warning("dropped a %s for unexpected step %s", type(result).__name__,
                           getattr(result, "step_id", None))
            return None
        self.inflight.popleft()
        self.fair_share.record(sent.source.kind, result.finished_at - result.started_at)
        batch = sent.source.after_step(sent.state, result)
        if self.speech is not None and self.speech.lm is not None and sent.source is self.text:
            # A speech request's language model writes speech tokens: they come back as audio.
            batch.outputs = [o for o in batch.outputs if not self.speech.owns(o.request_id)]
        return batch

    def idle(self) -> None:
        """The worker has nothing to run: its wait for the next step is not step overhead."""
        self.text.idle()

    # ---- what goes with the outputs ---------------------------------------------------------
    def take_stats(self) -> SchedulerStats:
        stats = self.text.take_stats()
        for source in self.sources:
            if isinstance(source, PixelQueue):  # image requests count as requests too
                stats.num_running += len(source.running)
                stats.num_waiting += len(source.waiting)
        return stats

    def take_kv_events(self) -> list:
        """The prefix cache's changes since the last call (empty unless recorded)."""
        return self.text.take_kv_events()
