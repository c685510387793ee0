"""The scheduler process: receives contexts, batches them into steps for the worker, and sends
each step's new tokens back to the API process.

The loop never busy-waits: when there is no work it blocks in `poll` on its sockets, and while a
step runs on the worker it blocks until the result (or a new request, or a cancellation) arrives.

Text steps overlap: while the worker runs step N, step N+1 is already built and queued on the
worker's socket (see scheduler.py), so the worker goes from one forward pass to the next
without waiting for this process; each result then only has to be applied and streamed.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import zmq

from pipelines.config import BatchingConfig, KVCacheConfig
from pipelines.context import TextContext
from pipelines.cpu_placement import CpuPlacement
from pipelines.embeddings import EmbeddingsContext
from pipelines.lifecycle import (
    die_with_parent,
    freeze_startup_heap,
    ignore_interrupts,
    setup_logging,
)
from pipelines.status import PipelineTask
from pipelines.tts_context import TTSContext
from scheduler.block_manager import BlockManager
from scheduler.embedding_batcher import EmbeddingBatcher
from scheduler.fair_share import FairShare
from scheduler.kv_events import AllBlocksCleared, KVEventPublisher
from scheduler.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from scheduler.speech_queue import SpeechQueue
from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from serialization.messages import (
    AudioChunk,
    AudioResult,
    AudioStep,
    CancelRequest,
    EmbeddingOutput,
    EmbedResult,
    EmbedStep,
    RequestMessage,
    ResponseBatch,
    ResultMessage,
    SchedulerFailed,
    SchedulerReady,
    Shutdown,
    StepResult,
    WorkerFailed,
    WorkerReady,
)
from serialization.sockets import (
    MAX_MESSAGE_BYTES,
    Endpoints,
    decode_or_drop,
    make_socket,
    malformed_frame_counts,
)

logger = logging.getLogger("loom.scheduler")


class SchedulerLoop:
    def __init__(self, batching: BatchingConfig, kv_cache: KVCacheConfig,
                 endpoints: Endpoints, num_worker_ranks: int = 1) -> None:
        self.batching = batching
        self.kv_cache = kv_cache
        self.zctx = zmq.Context()
        self.requests = make_socket(self.zctx, zmq.PULL, endpoints.requests, bind=True,
                                    max_message_bytes=MAX_MESSAGE_BYTES["requests"])
        self.cancel = make_socket(self.zctx, zmq.PULL, endpoints.cancel, bind=True,
                                  max_message_bytes=MAX_MESSAGE_BYTES["cancel"])
        self.responses = make_socket(self.zctx, zmq.PUSH, endpoints.responses, bind=True)
        # One socket per worker rank: a model split over several workers runs every step on
        # each (worker/tensor_parallel.py); rank 0 answers.
        self.steps = [make_socket(self.zctx, zmq.PUSH, endpoints.steps_of_rank(rank), bind=True)
                      for rank in range(num_worker_ranks)]
        self.results = make_socket(self.zctx, zmq.PULL, endpoints.results, bind=True,
                                   max_message_bytes=MAX_MESSAGE_BYTES["results"])
        self.encode = msgpack_numpy_encoder()
        self.decode_request = msgpack_numpy_decoder(RequestMessage)
        self.decode_cancel = msgpack_numpy_decoder(CancelRequest)
        self.decode_result = msgpack_numpy_decoder(ResultMessage)
        self.poller = zmq.Poller()
        for sock in (self.requests, self.cancel, self.results):
            self.poller.register(sock, zmq.POLLIN)
        self.scheduler: Scheduler | None = None
        self.kv_publisher: KVEventPublisher | None = None
        self.embedder: EmbeddingBatcher | None = None  # when the worker serves embeddings
        self.speech = SpeechQueue()
        self.voices: list[str] = []
        self.fair_share = FairShare()  # text and speech waiting together: half the worker each
        # Steps sent to the worker, oldest first: at most two text steps (one running, one
        # queued behind it), or one embeddings or speech step.
        self.inflight: deque[ScheduledStep | InflightEmbed | InflightAudio] = deque()
        self._embed_step_id = 0
        self._audio_step_id = 0
        self._last_stats = None
        self._last_finished_at: float | None = None  # worker clock, last text step, while busy
        self._iteration_tokens: list[int] = []
        self._step_overheads: list[float] = []
        self._prefill_forward_times: list[float] = []
        self._decode_forward_times: list[float] = []

    # ---- start-up ---------------------------------------------------------------------------
    def open_kv_events(self) -> bool:
        """Bind or connect the KV events socket (while the worker loads, so subscribers are
        connected by the first event); False, reported to the API process, if it can't."""
        endpoint = self.kv_cache.events_endpoint
        if endpoint is None:
            return True
        try:
            self.kv_publisher = KVEventPublisher(self.zctx, endpoint, self.kv_cache.events_topic)
        except zmq.ZMQError as exc:
            self.responses.send(self.encode(SchedulerFailed(
                message=f"--kv-events-endpoint {endpoint}: {exc}")))
            return False
        return True

    def wait_for_worker(self) -> WorkerReady | None:
        while True:
            if not self.results.poll(1000):
                if os.getppid() == 1:
                    return None
                continue
            msg = decode_or_drop(self.decode_result, self.results.recv(), "results")
            if isinstance(msg, WorkerReady):
                return msg
            if isinstance(msg, WorkerFailed):
                self.responses.send(self.encode(SchedulerFailed(message=msg.message)))
                return None

    def start(self, ready: WorkerReady) -> None:
        self.voices = ready.voices
        if ready.task is PipelineTask.EMBEDDINGS_GENERATION:
            self.embedder = EmbeddingBatcher(self.batching.max_embedding_batch_tokens,
                                             self.batching.max_num_seqs)
        blocks = BlockManager(max(1, ready.num_blocks), max(1, ready.block_size),
                              self.kv_cache.enable_prefix_caching,
                              record_kv_events=self.kv_publisher is not None)
        if self.kv_publisher is not None:
            # A subscriber may still hold blocks of this endpoint's previous process.
            self.kv_publisher.publish([AllBlocksCleared()])
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=self.batching.max_num_seqs,
                max_num_batched_tokens=self.batching.max_num_batched_tokens,
                max_model_len=ready.max_model_len,
            ),
            blocks,
        )
        self.responses.send(self.encode(SchedulerReady(
            num_blocks=ready.num_blocks, block_size=ready.block_size,
            max_model_len=ready.max_model_len, task=ready.task, voices=ready.voices,
            sample_rate=ready.sample_rate,
        )))

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            if not self.inflight:
                self._drain_inputs()
                if self._start_next_step():
                    continue
                # Idle: report the final state once, then sleep in poll until a request or
                # cancellation arrives.
                self._last_finished_at = None
                self._send_outputs([])
                self.poller.poll(1000)
                if os.getppid() == 1:
                    return
                continue
            events = dict(self.poller.poll(1000))
            if self.requests in events or self.cancel in events:
                self._drain_inputs()
            if self.results in events:
                self._drain_results()

    def _drain_inputs(self) -> None:
        sched = self.scheduler
        while True:
            try:
                frame = self.requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            ctx = decode_or_drop(self.decode_request, frame, "requests")
            if isinstance(ctx, TextContext):
                sched.add_request(ctx)
            elif isinstance(ctx, EmbeddingsContext) and self.embedder is not None:
                self.embedder.add(ctx)
            elif isinstance(ctx, TTSContext) and self.voices:
                self.speech.add(ctx)
            elif ctx is not None:
                logger.warning("dropped a %s: the worker serves another task",
                               type(ctx).__name__)
        while True:
            try:
                frame = self.cancel.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = decode_or_drop(self.decode_cancel, frame, "cancel")
            if msg is not None:
                ids = set(msg.request_ids)
                sched.abort(msg.request_ids)
                if self.embedder is not None:
                    self.embedder.abort(ids)
                self.speech.abort(ids)

    def _drain_results(self) -> None:
        while True:
            try:
                frame = self.results.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            received_at = time.monotonic()
            msg = decode_or_drop(self.decode_result, frame, "results")
            if isinstance(msg, StepResult):
                self._apply_result(msg, received_at)
            elif isinstance(msg, EmbedResult):
                self._apply_embed_result(msg)
            elif isinstance(msg, AudioResult):
                self._apply_audio_result(msg)

    def _apply_result(self, result: StepResult, received_at: float) -> None:
        step = self.inflight[0] if self.inflight else None
        if not isinstance(step, ScheduledStep) or result.step_id != step.batch.step_id:
            logger.warning("dropped a result for unexpected step %d", result.step_id)
            return
        self.inflight.popleft()
        self._last_finished_at = result.finished_at
        forward = result.finished_at - result.started_at
        self.fair_share.record("text", forward)
        self._iteration_tokens.append(int(step.batch.query_lens.sum()))
        if (step.batch.query_lens > 1).any():
            self._prefill_forward_times.append(forward)
        else:
            self._decode_forward_times.append(forward)
        if step.follows_finished_at is not None:
            self._step_overheads.append(result.started_at - step.follows_finished_at)
        if result.error is not None:
            outputs = self.scheduler.fail_step(step, result.error)
        else:
            outputs, _stats = self.scheduler.update(step, result)
        self._drain_inputs()
        if self.inflight:
            # The next step was queued behind this one: the worker is already running it.
            if isinstance(self.inflight[0], ScheduledStep):
                self.inflight[0].follows_finished_at = result.finished_at
            self._send_outputs(outputs)
            self._schedule_ahead()
            return
        # Nothing queued: the worker waits for its next step, the API process for these
        # tokens. The step goes first, so the API's work overlaps the forward pass.
        self._start_next_step()
        self._send_outputs(outputs)

    def _apply_embed_result(self, result: EmbedResult) -> None:
        inflight = self.inflight[0] if self.inflight else None
        if not isinstance(inflight, InflightEmbed) or result.step_id != inflight.step_id:
            logger.warning("dropped a result for unexpected step %d", result.step_id)
            return
        self.inflight.popleft()
        if result.error is not None:
            empty = np.zeros(0, np.float32)
            outputs = [EmbeddingOutput(rid, empty, result.error) for rid in inflight.request_ids]
        else:
            outputs = [EmbeddingOutput(rid, result.embeddings[i])
                       for i, rid in enumerate(inflight.request_ids)]
        self._drain_inputs()
        self._start_next_step()
        self.responses.send(self.encode(ResponseBatch(outputs=[], embeddings=outputs)))

    def _start_embed_step(self) -> bool:
        batch = self.embedder.next_batch()
        if not batch:
            return False
        step = EmbedStep(
            step_id=self._embed_step_id,
            request_ids=[c.request_id for c in batch],
            input_ids=np.concatenate([c.tokens for c in batch]).astype(np.int32),
            lengths=np.array([len(c.tokens) for c in batch], dtype=np.int32),
        )
        self._embed_step_id += 1
        self._send_to_workers(step)
        self.inflight.append(InflightEmbed(step.step_id, step.request_ids))
        return True

    def _apply_audio_result(self, result: AudioResult) -> None:
        inflight = self.inflight[0] if self.inflight else None
        if not isinstance(inflight, InflightAudio) or result.step_id != inflight.step_id:
            logger.warning("dropped a result for unexpected step %d", result.step_id)
            return
        self.inflight.popleft()
        seconds = result.finished_at - result.started_at
        self.fair_share.record("audio", seconds)
        ctx = inflight.ctx
        ctx.decoded_index += 1
        failed = result.error is not None
        chunk = AudioChunk(request_id=ctx.request_id, audio=result.audio,
                           index=inflight.index, is_last=ctx.is_done or failed,
                           synthesis_seconds=seconds, error=result.error)
        self.speech.put_back(ctx, failed)
        self._drain_inputs()
        self._start_next_step()
        self.responses.send(self.encode(ResponseBatch(outputs=[], audio=[chunk])))

    def _start_audio_step(self) -> None:
        ctx = self.speech.take()
        step = AudioStep(step_id=self._audio_step_id, request_id=ctx.request_id,
                         phoneme_ids=ctx.next_segment(), speed=ctx.speed)
        self._audio_step_id += 1
        self._send_to_workers(step)
        self.inflight.append(InflightAudio(step.step_id, ctx, ctx.decoded_index))

    def _audio_turn(self) -> bool:
        """Speech or text next? Alone, either runs; together they split the worker's time."""
        return self.fair_share.audio_next(self.scheduler.has_work, self.speech.has_work)

    def _start_next_step(self) -> bool:
        if self.embedder is not None:
            return self._start_embed_step()
        if self._audio_turn():
            self._start_audio_step()
            return True
        step = self.scheduler.schedule()
        if step is None:
            if self.speech.has_work:  # text is waiting on something: let speech run
                self._start_audio_step()
                return True
            return False
        step.follows_finished_at = self._last_finished_at
        self._send_step(step)
        self._schedule_ahead()
        return True

    def _schedule_ahead(self) -> None:
        """Queue the next text step behind the running one, unless speech is waiting (it
        takes turns with text, decided when the worker is free) or nothing can run yet."""
        if len(self.inflight) != 1 or not isinstance(self.inflight[0], ScheduledStep):
            return
        if self.speech.has_work:
            return
        step = self.scheduler.schedule(ahead=True)
        if step is not None:
            self._send_step(step)

    def _send_step(self, step: ScheduledStep) -> None:
        self._send_to_workers(step.batch)
        self.inflight.append(step)

    def _send_to_workers(self, msg) -> None:
        """Every step message leaves here: encoded once, sent to each worker rank."""
        frame = self.encode(msg)
        for sock in self.steps:
            sock.send(frame, copy=False)

    def _send_outputs(self, outputs: list) -> None:
        stats = self.scheduler.stats()
        stats.iteration_tokens, self._iteration_tokens = self._iteration_tokens, []
        stats.step_overheads, self._step_overheads = self._step_overheads, []
        stats.prefill_forward_times, self._prefill_forward_times = self._prefill_forward_times, []
        stats.decode_forward_times, self._decode_forward_times = self._decode_forward_times, []
        stats.malformed_frames_total = malformed_frame_counts()
        if outputs or stats != self._last_stats:
            self.responses.send(self.encode(ResponseBatch(outputs=outputs, stats=stats)))
            self._last_stats = stats
        # The step's changes to the prefix cache, in one message (as vLLM batches them).
        if self.kv_publisher is not None and self.scheduler.blocks.kv_events:
            self.kv_publisher.publish(self.scheduler.blocks.take_kv_events())

    def close(self, linger_ms: int = 0) -> None:
        frame = self.encode(Shutdown())
        for sock in self.steps:
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.zctx.destroy(linger=linger_ms)


@dataclass
class InflightAudio:
    step_id: int
    ctx: TTSContext
    index: int


@dataclass
class InflightEmbed:
    step_id: int
    request_ids: list[str]


def run_scheduler(batching: BatchingConfig, kv_cache: KVCacheConfig, log_level: str,
                  endpoints: Endpoints, placement: CpuPlacement | None = None,
                  num_worker_ranks: int = 1) -> None:
    """Entry point of the scheduler process (spawned by `loom serve`), with its part of the
    configuration."""
    die_with_parent()
    ignore_interrupts()
    setup_logging(log_level)
    if placement is not None:
        placement.enter_service()
    loop = SchedulerLoop(batching, kv_cache, endpoints, num_worker_ranks)
    ready = loop.open_kv_events() and loop.wait_for_worker()
    if not ready:
        loop.close(linger_ms=1000)  # let SchedulerFailed reach the API process
        sys.exit(1)
    loop.start(ready)
    freeze_startup_heap()  # with the block manager's blocks
    try:
        loop.run()
    finally:
        loop.close()
