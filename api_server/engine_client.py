"""The API process's side of the ZMQ channels: sends contexts and cancellations to the
scheduler, and routes each step's outputs to the waiting request handlers."""

from __future__ import annotations

import asyncio
import logging
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
        self.metrics = metrics
        self._ended_early: dict[str, str] = {}

    @property
    def is_healthy(self) -> bool:
        return self.ready is not None and self.dead_reason is None

    @property
    def num_in_flight(self) -> int:
        return len(self.streams)

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

    async def generate(self, ctx: TextContext) -> AsyncIterator[TextGenerationOutput]:
        """Send a context and yield its outputs until it finishes.

        If the consumer stops early (client gone, stop string), the request is cancelled in the
        scheduler so its KV blocks are freed at once.
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        queue: asyncio.Queue[TextGenerationOutput] = asyncio.Queue()
        self.streams[ctx.request_id] = queue
        finished = False
        clock = RequestClock()
        generated = 0
        try:
            await self.requests.send(self.encode(ctx), copy=False)
            while True:
                output = await queue.get()
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
        try:
            self.cancel_sock.send(self.encode(CancelRequest(request_ids=request_ids)),
                                  zmq.NOBLOCK)
        except zmq.ZMQError:
            logger.warning("could not send a cancellation for %s", request_ids)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.zctx.destroy(linger=0)
