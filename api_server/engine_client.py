"""The API process's side of the ZMQ channels: sends contexts and cancellations to the
scheduler, and routes each step's outputs to the waiting request handlers."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import zmq
import zmq.asyncio

from api_server.metrics import Metrics, RequestClock
from pipelines.context import TextContext
from pipelines.response import TextGenerationOutput
from pipelines.status import GenerationStatus
from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from serialization.messages import (
    CancelRequest,
    ResponseBatch,
    ResponseMessage,
    SchedulerFailed,
    SchedulerReady,
)
from serialization.sockets import Endpoints, decode_or_drop, make_socket

logger = logging.getLogger("loom.api")


class EngineDeadError(RuntimeError):
    pass


class RequestTimeoutError(RuntimeError):
    """A request ran past --request-timeout; it has been aborted in the scheduler."""


class EngineClient:
    def __init__(self, endpoints: Endpoints, metrics: Metrics | None = None) -> None:
        self.zctx = zmq.asyncio.Context()
        self.requests = make_socket(self.zctx, zmq.PUSH, endpoints.requests, bind=False)
        self.cancel_sock = make_socket(self.zctx, zmq.PUSH, endpoints.cancel, bind=False)
        self.responses = make_socket(self.zctx, zmq.PULL, endpoints.responses, bind=False)
        self.encode = msgpack_numpy_encoder()
        self.decode = msgpack_numpy_decoder(ResponseMessage)
        self.streams: dict[str, asyncio.Queue[TextGenerationOutput]] = {}
        self.ready: SchedulerReady | None = None
        self.dead_reason: str | None = None
        self._ready_event = asyncio.Event()
        self._reader: asyncio.Task | None = None
        self.closed = False
        self.metrics = metrics
        self._ended_early: dict[str, str] = {}
        # Admission bookkeeping: requests admitted or sent that have produced nothing yet.
        # A reservation is made when a request is admitted, before its stream starts, so a
        # burst of requests can't all pass the check before any of them is counted.
        self._queued: dict[str, int] = {}
        self._reserved: dict[str, tuple[int, float]] = {}
        self.queued_tokens = 0
        # Stall detection: when anything last came back, and since when work is in flight.
        self.last_progress_at = time.monotonic()
        self.busy_since = time.monotonic()

    @property
    def is_healthy(self) -> bool:
        return self.ready is not None and self.dead_reason is None

    @property
    def num_in_flight(self) -> int:
        return len(self.streams)

    @property
    def queued_requests(self) -> int:
        return len(self._queued) + len(self._reserved)

    def reserve(self, contexts: list[TextContext]) -> None:
        """Count admitted requests as queued right away (see `_reserved`)."""
        now = time.monotonic()
        for ctx in contexts:
            self._reserved[ctx.request_id] = (ctx.prompt_length, now)
            self.queued_tokens += ctx.prompt_length

    def expire_reservations(self, max_age: float = 5.0) -> None:
        """Drop reservations of requests whose stream never started (client gone early)."""
        now = time.monotonic()
        for request_id, (tokens, at) in list(self._reserved.items()):
            if now - at > max_age:
                del self._reserved[request_id]
                self.queued_tokens -= tokens

    def _dequeue(self, request_id: str) -> None:
        self.queued_tokens -= self._queued.pop(request_id, 0)

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read_responses())

    async def wait_ready(self) -> SchedulerReady:
        """Returns once the scheduler (and so the worker) is ready; raises if start-up failed."""
        await self._ready_event.wait()
        if self.ready is None:
            raise EngineDeadError(self.dead_reason or "the engine failed to start")
        return self.ready

    async def _read_responses(self) -> None:
        while True:
            frame = await self.responses.recv()
            msg = decode_or_drop(self.decode, frame, "responses")
            if isinstance(msg, ResponseBatch):
                self.last_progress_at = time.monotonic()
                if msg.stats is not None and self.metrics is not None:
                    self.metrics.observe_scheduler(msg.stats)
                for output in msg.outputs:
                    queue = self.streams.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
            elif isinstance(msg, SchedulerReady):
                self.ready = msg
                self._ready_event.set()
            elif isinstance(msg, SchedulerFailed):
                self.mark_dead(msg.message)

    def mark_dead(self, reason: str) -> None:
        """A process died or failed: every in-flight request ends with an error."""
        if self.dead_reason is None:
            self.dead_reason = reason
        self._ready_event.set()
        for request_id, queue in self.streams.items():
            queue.put_nowait(TextGenerationOutput(
                request_id=request_id, tokens=[], final_status=GenerationStatus.ERROR,
                error=f"the engine stopped: {reason}"))

    async def generate(self, ctx: TextContext, timeout: float | None = None,
                       ) -> AsyncIterator[TextGenerationOutput]:
        """Send a context and yield its outputs until it finishes.

        If the consumer stops early (client gone, stop string) or `timeout` seconds pass, the
        request is cancelled in the scheduler so its KV blocks are freed at once.
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        queue: asyncio.Queue[TextGenerationOutput] = asyncio.Queue()
        if not self.streams:
            self.busy_since = time.monotonic()
        self.streams[ctx.request_id] = queue
        reserved = self._reserved.pop(ctx.request_id, None)
        if reserved is None:
            self.queued_tokens += ctx.prompt_length
        self._queued[ctx.request_id] = ctx.prompt_length
        finished = False
        clock = RequestClock()
        generated = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            await self.requests.send(self.encode(ctx), copy=False)
            while True:
                if deadline is None:
                    output = await queue.get()
                else:
                    try:
                        output = await asyncio.wait_for(queue.get(), deadline - time.monotonic())
                    except asyncio.TimeoutError:
                        self._ended_early[ctx.request_id] = "error"
                        raise RequestTimeoutError(
                            f"the request exceeded the server's {timeout:g}s time limit"
                        ) from None
                self._dequeue(ctx.request_id)
                generated += len(output.tokens)
                if self.metrics is not None:
                    self.metrics.observe_output(clock, output)
                    if output.is_done:
                        self.metrics.observe_request_tokens(ctx.prompt_length, generated)
                if output.is_done:
                    finished = True
                yield output
                if finished:
                    return
        finally:
            del self.streams[ctx.request_id]
            self._dequeue(ctx.request_id)
            if not finished:
                reason = self._ended_early.pop(ctx.request_id, "abort")
                if self.metrics is not None:
                    self.metrics.observe_early_end(clock, reason)
                if self.dead_reason is None:
                    self.cancel([ctx.request_id])

    def end_early(self, request_id: str, reason: str) -> None:
        """The consumer is about to stop reading (e.g. a stop string matched): for metrics,
        the request ends with `reason` rather than as an abort."""
        self._ended_early[request_id] = reason

    def cancel(self, request_ids: list[str]) -> None:
        if self.closed:
            return
        try:
            self.cancel_sock.send(self.encode(CancelRequest(request_ids=request_ids)),
                                  zmq.NOBLOCK)
        except zmq.ZMQError:
            logger.warning("could not send a cancellation for %s", request_ids)

    def close(self) -> None:
        self.closed = True
        if self._reader is not None:
            self._reader.cancel()
        self.zctx.destroy(linger=0)
