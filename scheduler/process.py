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
from collections import deque

import zmq

from pipelines.config import PipelineConfig
from pipelines.response import TextGenerationOutput
from pipelines.status import GenerationStatus, PipelineTask
from pipelines.vision_context import IMAGES_NOT_HELD, TextAndVisionContext
from processes.cpu_placement import CpuPlacement
from processes.lifecycle import (
    die_with_parent,
    freeze_startup_heap,
    ignore_interrupts,
    setup_logging,
)
from processes.sockets import (
    MAX_MESSAGE_BYTES,
    Endpoints,
    decode_or_drop,
    make_socket,
    malformed_frame_counts,
)
from scheduler.block_manager import BlockManager
from scheduler.embedding_batcher import EmbeddingBatcher
from scheduler.fair_share import FairShare
from scheduler.kv_events import AllBlocksCleared, KVEventPublisher
from scheduler.scheduler import Scheduler
from scheduler.shared_images import SharedImages
from scheduler.speech_queue import SpeechQueue
from scheduler.step_source import SentStep, StepSource
from scheduler.text_source import TextSource
from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from serialization.messages import (
    CancelRequest,
    RequestMessage,
    ResponseBatch,
    ResultMessage,
    SchedulerFailed,
    SchedulerReady,
    Shutdown,
    WorkerFailed,
    WorkerReady,
)

logger = logging.getLogger("loom.scheduler")


class SchedulerLoop:
    def __init__(self, pipeline_config: PipelineConfig, endpoints: Endpoints,
                 num_worker_ranks: int = 1) -> None:
        self.pipeline_config = pipeline_config
        self.kv_cache = pipeline_config.kv_cache_config
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
        self.text: TextSource | None = None
        self.kv_publisher: KVEventPublisher | None = None
        self.speech = SpeechQueue()
        self.sources: list[StepSource] = []  # set by start(): what the worker serves
        self.fair_share = FairShare()  # text and speech waiting together: half the worker each
        # Steps sent to the worker, oldest first: at most two text steps (one running, one
        # queued behind it), or one embeddings or speech step.
        self.inflight: deque[SentStep] = deque()
        self._last_stats = None
        self.shared_images = SharedImages()

    # ---- start-up ---------------------------------------------------------------------------
    def open_kv_events(self) -> bool:
        """Bind or connect the KV events socket (while the worker loads, so subscribers are
        connected by the first event); False, reported to the API process, if it can't."""
        endpoint = self.kv_cache.kv_events_endpoint
        if endpoint is None:
            return True
        try:
            self.kv_publisher = KVEventPublisher(self.zctx, endpoint, self.kv_cache.kv_events_topic)
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
        blocks = BlockManager(max(1, ready.num_blocks), max(1, ready.block_size),
                              self.kv_cache.enable_prefix_caching,
                              record_kv_events=self.kv_publisher is not None)
        if self.kv_publisher is not None:
            # A subscriber may still hold blocks of this endpoint's previous process.
            self.kv_publisher.publish([AllBlocksCleared()])
        self.scheduler = Scheduler(self.pipeline_config, blocks)
        self.text = TextSource(self.scheduler)
        if ready.task is PipelineTask.EMBEDDINGS_GENERATION:
            self.sources = [EmbeddingBatcher(self.pipeline_config.max_embedding_batch_tokens,
                                             self.pipeline_config.max_batch_size)]
        else:
            self.sources = [self.text] + ([self.speech] if ready.voices else [])
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
                self.text.idle()
                self._send(ResponseBatch(outputs=[]))
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
        while True:
            try:
                frame = self.requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            ctx = decode_or_drop(self.decode_request, frame, "requests")
            if isinstance(ctx, TextAndVisionContext) and not self.shared_images.share(ctx):
                self.responses.send(self.encode(ResponseBatch(outputs=[TextGenerationOutput(
                    ctx.request_id, [], GenerationStatus.ERROR, error=IMAGES_NOT_HELD)])))
                continue
            source = next((s for s in self.sources if isinstance(ctx, s.context_type)), None)
            if source is not None:
                source.add(ctx)
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
                for source in self.sources:
                    source.abort(ids)

    def _drain_results(self) -> None:
        while True:
            try:
                frame = self.results.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = decode_or_drop(self.decode_result, frame, "results")
            if msg is not None:
                self._apply_result(msg)

    def _apply_result(self, result) -> None:
        sent = self.inflight[0] if self.inflight else None
        if (sent is None or not isinstance(result, sent.source.result_type)
                or result.step_id != sent.step_id):
            logger.warning("dropped a %s for unexpected step %s", type(result).__name__,
                           getattr(result, "step_id", None))
            return
        self.inflight.popleft()
        self.fair_share.record(sent.source.kind, result.finished_at - result.started_at)
        response = sent.source.finish(sent.state, result)
        self._drain_inputs()
        if self.inflight:
            # The next text step was queued behind this one: the worker is already running it.
            self.text.queued_behind(self.inflight[0].state, result.finished_at)
            self._send(response)
            self._schedule_ahead()
            return
        # Nothing queued: the worker waits for its next step, the API process for these
        # outputs. The step goes first, so the API's work overlaps the worker's.
        self._start_next_step()
        self._send(response)

    def _turn_order(self) -> list[StepSource]:
        """Speech or text next? Alone, either runs; together they split the worker's time
        (and text that cannot run yet lets speech go)."""
        if self.text not in self.sources:
            return self.sources
        if self.fair_share.speech_next(self.text.has_work, self.speech.has_work):
            return [self.speech]
        return self.sources

    def _start_next_step(self) -> bool:
        for source in self._turn_order():
            planned = source.next_step()
            if planned is not None:
                self._send_step(source, *planned)
                self._schedule_ahead()
                return True
        return False

    def _schedule_ahead(self) -> None:
        """Queue the next text step behind the running one, unless speech is waiting (it
        takes turns with text, decided when the worker is free) or nothing can run yet."""
        if len(self.inflight) != 1 or self.inflight[0].source is not self.text:
            return
        if self.speech.has_work:
            return
        planned = self.text.next_step(ahead=True)
        if planned is not None:
            self._send_step(self.text, *planned)

    def _send_step(self, source: StepSource, message, state) -> None:
        """Every step message leaves here: encoded once, sent to each worker rank."""
        frame = self.encode(message)
        for sock in self.steps:
            sock.send(frame, copy=False)
        self.inflight.append(SentStep(source, message.step_id, state))

    def _send(self, response: ResponseBatch) -> None:
        """Outputs to the API process, with the scheduler's stats when they changed."""
        stats = self.text.take_stats()
        stats.malformed_frames_total = malformed_frame_counts()
        if response.outputs or response.embeddings or response.audio \
                or stats != self._last_stats:
            response.stats = stats
            self.responses.send(self.encode(response))
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


def run_scheduler(pipeline_config: PipelineConfig, log_level: str, endpoints: Endpoints,
                  placement: CpuPlacement | None = None, num_worker_ranks: int = 1) -> None:
    """Entry point of the scheduler process (spawned by `loom serve`)."""
    die_with_parent()
    ignore_interrupts()
    setup_logging(log_level)
    if placement is not None:
        placement.enter_service()
    loop = SchedulerLoop(pipeline_config, endpoints, num_worker_ranks)
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
