"""The scheduler process: receives contexts, sends the worker the steps the arbiter
(arbiter.py) picks, and sends each step's outputs back to the API process. The loop only moves
frames between its sockets and the arbiter.

The loop never busy-waits: when there is no work it blocks in `poll` on its sockets, and while a
step runs on the worker it blocks until the result (or a new request, or a cancellation) arrives.
Text steps overlap: the next is queued behind the running one (arbiter.py), so each result
only has to be applied and streamed while the worker runs on.
"""

from __future__ import annotations

import os
import sys

import zmq

from pipelines.config import PipelineConfig
from pipelines.response import TextGenerationOutput
from pipelines.status import GenerationStatus
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
from scheduler.arbiter import Arbiter
from scheduler.block_manager import BlockManager
from scheduler.kv_events import AllBlocksCleared, KVEventPublisher
from scheduler.shared_images import SharedImages
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
        self.kv_publisher: KVEventPublisher | None = None
        self.arbiter: Arbiter | None = None  # set by start(): the sources of the worker's task
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
        if self.pipeline_config.max_batch_input_tokens is None and ready.max_batch_input_tokens:
            # (unset: the default of the worker's device, which only the worker knows)
            self.pipeline_config = self.pipeline_config.replace(
                max_batch_input_tokens=ready.max_batch_input_tokens)
        self.arbiter = Arbiter.for_worker(self.pipeline_config, ready, blocks)
        self.responses.send(self.encode(SchedulerReady(
            num_blocks=ready.num_blocks, block_size=ready.block_size,
            max_model_len=ready.max_model_len, task=ready.task, voices=ready.voices,
            sample_rate=ready.sample_rate, speech_task=ready.speech_task,
        )))

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            if not self.arbiter.busy:
                self._drain_inputs()
                if self._send_steps():
                    continue
                # Idle: report the final state once, then sleep in poll until a request or
                # cancellation arrives.
                self.arbiter.idle()
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
            if ctx is not None:
                self.arbiter.add(ctx)
        while True:
            try:
                frame = self.cancel.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = decode_or_drop(self.decode_cancel, frame, "cancel")
            if msg is not None:
                self.arbiter.abort(set(msg.request_ids))

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
        response = self.arbiter.after_step(result)
        if response is None:
            return
        self._drain_inputs()
        if self.arbiter.busy:
            # The next text step was queued behind this one: the worker is already running it.
            self._send(response)
            self._send_steps()
            return
        # Nothing queued: the worker waits for its next step, the API process for these
        # outputs. The step goes first, so the API's work overlaps the worker's.
        self._send_steps()
        self._send(response)

    def _send_steps(self) -> bool:
        """Every step message leaves here, each as soon as the arbiter has it (the worker
        starts on one while the next is built): encoded once, sent to each worker rank."""
        sent = False
        while (message := self.arbiter.next_step()) is not None:
            frame = self.encode(message)
            for sock in self.steps:
                sock.send(frame, copy=False)
            sent = True
        return sent

    def _send(self, response: ResponseBatch) -> None:
        """Outputs to the API process, with the scheduler's stats when they changed."""
        stats = self.arbiter.take_stats()
        stats.malformed_frames_total = malformed_frame_counts()
        if response.outputs or response.embeddings or response.audio or response.images \
                or stats != self._last_stats:
            response.stats = stats
            self.responses.send(self.encode(response))
            self._last_stats = stats
        # The step's changes to the prefix cache, in one message (as vLLM batches them).
        if self.kv_publisher is not None:
            events = self.arbiter.take_kv_events()
            if events:
                self.kv_publisher.publish(events)

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
