"""The API process's side of the ZMQ channels: sends contexts and cancellations to the
scheduler, and routes each step's outputs to the waiting request handlers."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from api_server.metrics import Metrics, RequestClock
from pipelines.context import TextContext
from pipelines.embeddings import EmbeddingsContext
from pipelines.pixel_context import GenerationOutput, PixelContext
from pipelines.response import TextGenerationOutput
from pipelines.speech_context import TTSContext
from pipelines.status import GenerationStatus
from pipelines.vision_context import IMAGES_NOT_HELD, TextAndVisionContext
from processes.sockets import Endpoints, decode_or_drop, make_socket
from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from serialization.messages import (
    AudioChunk,
    CancelRequest,
    ResponseBatch,
    ResponseMessage,
    SchedulerFailed,
    SchedulerReady,
)

logger = logging.getLogger("loom.api")


def _no_pixels(pixels: np.ndarray) -> np.ndarray:
    """What an image sent by reference carries instead of its pixels."""
    return np.empty(0, pixels.dtype)


class EngineDeadError(RuntimeError):
    pass


class GenerationFailed(RuntimeError):
    """The engine ended a request with an error (a failed step, a dead process)."""


# Put into a request's output queue when its --request-timeout passes.
_DEADLINE_PASSED = object()


@dataclass
class _OpenRequest:
    """A text request sent (or about to be) to the scheduler and not yet finished."""

    queue: asyncio.Queue
    clock: RequestClock
    timeout: float | None
    deadline: asyncio.TimerHandle | None


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
        self._submitted: dict[str, _OpenRequest] = {}  # sent, nobody reads their outputs yet
        self._embed_waiters: dict[str, asyncio.Future] = {}
        self._image_sends = asyncio.Lock()
        # Pixel arrays sent whole (by id, while they live), and the contexts sent by reference
        # until their first output.
        self._sent_images: weakref.WeakValueDictionary[int, np.ndarray] = \
            weakref.WeakValueDictionary()
        self._by_reference: dict[str, TextContext] = {}
        self._resends: set[asyncio.Task] = set()
        self.audio_streams: dict[str, asyncio.Queue] = {}
        self.pixel_streams: dict[str, asyncio.Queue[GenerationOutput]] = {}
        # Admission bookkeeping: requests admitted or sent that have produced nothing yet.
        # A reservation is made when a request is admitted, before its stream starts, so a
        # burst of requests can't all pass the check before any of them is counted.
        self._queued: dict[str, int] = {}
        self._reserved: dict[str, tuple[int, float]] = {}
        self.queued_tokens = 0
        self._lora_of: dict[str, str] = {}  # request id: its LoRA adapter's name
        # Stall detection: when anything last came back, and since when work is in flight.
        self.last_progress_at = time.monotonic()
        self.busy_since = time.monotonic()

    @property
    def num_in_flight(self) -> int:
        return len(self.streams)

    def requests_using(self, lora_name: str) -> int:
        """Requests in flight that run the LoRA adapter `lora_name`."""
        return sum(1 for name in self._lora_of.values() if name == lora_name)

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
                    if self._by_reference and output.request_id in self._by_reference:
                        if output.error == IMAGES_NOT_HELD:
                            self._resend_whole(output.request_id)
                            continue
                        del self._by_reference[output.request_id]
                    queue = self.streams.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
                if msg.embeddings and self.metrics is not None:
                    self.metrics.embedding_batches.inc()
                    self.metrics.embedding_inputs.inc(len(msg.embeddings))
                for chunk in msg.audio:
                    queue = self.audio_streams.get(chunk.request_id)
                    if queue is not None:
                        queue.put_nowait(chunk)
                for out in msg.images:
                    queue = self.pixel_streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                for item in msg.embeddings:
                    waiter = self._embed_waiters.pop(item.request_id, None)
                    if waiter is not None and not waiter.done():
                        if item.error is not None:
                            waiter.set_exception(GenerationFailed(item.error))
                        else:
                            waiter.set_result(item.embedding)
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
        for waiter in self._embed_waiters.values():
            if not waiter.done():
                waiter.set_exception(EngineDeadError(f"the engine stopped: {reason}"))
        for request_id, queue in self.audio_streams.items():
            queue.put_nowait(AudioChunk(request_id=request_id, audio=np.zeros(0, np.int16),
                                        index=-1, is_last=True,
                                        error=f"the engine stopped: {reason}"))
        for request_id, queue in self.pixel_streams.items():
            queue.put_nowait(GenerationOutput(request_id=request_id,
                                              final_status=GenerationStatus.ERROR,
                                              error=f"the engine stopped: {reason}"))

    async def paint(self, ctx: PixelContext) -> AsyncIterator[GenerationOutput]:
        """Send an image request; yield its progress, one output per denoising step, the
        last with the images. Leaving early cancels the rest in the scheduler."""
        async with aclosing(self._stream(ctx, self.pixel_streams,
                                         lambda out: out.is_done)) as outputs:
            async for out in outputs:  # (closed with this one: a client leaving cancels)
                yield out

    async def speak(self, ctx: TTSContext) -> AsyncIterator[AudioChunk]:
        """Send a speech context; yield its audio chunks as they are synthesized. Leaving
        early cancels the rest in the scheduler."""
        tokens = self._reserved.pop(ctx.request_id, (0, 0.0))[0]
        try:
            async with aclosing(self._stream(ctx, self.audio_streams,
                                             lambda chunk: chunk.is_last)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self.queued_tokens -= tokens

    async def _stream(self, ctx, streams: dict, is_last) -> AsyncIterator:
        """Send `ctx`; yield what the scheduler streams back for it (into `streams`) until
        `is_last` of an item; an item with an error raises. Leaving early cancels it."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        queue: asyncio.Queue = asyncio.Queue()
        streams[ctx.request_id] = queue
        finished = False
        try:
            await self.requests.send(self.encode(ctx), copy=False)
            while not finished:
                item = await queue.get()
                if item.error is not None:
                    raise GenerationFailed(item.error)
                finished = is_last(item)
                yield item
        finally:
            del streams[ctx.request_id]
            if not finished and not self.closed and self.dead_reason is None:
                self.cancel([ctx.request_id])

    async def embed(self, contexts: list[EmbeddingsContext]) -> list[np.ndarray]:
        """Send embeddings inputs; returns their vectors in order. Cancelled if the caller is."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        loop = asyncio.get_running_loop()
        waiters = []
        reserved_tokens = 0  # admitted requests count as queued until their vectors return
        for ctx in contexts:
            waiter = loop.create_future()
            self._embed_waiters[ctx.request_id] = waiter
            waiters.append(waiter)
            reserved_tokens += self._reserved.pop(ctx.request_id, (0, 0.0))[0]
        try:
            for ctx in contexts:
                await self.requests.send(self.encode(ctx), copy=False)
            return list(await asyncio.gather(*waiters))
        finally:
            pending = [c.request_id for c in contexts
                       if self._embed_waiters.pop(c.request_id, None) is not None]
            self.queued_tokens -= reserved_tokens
            if pending and not self.closed and self.dead_reason is None:
                self.cancel(pending)

    async def submit(self, ctx: TextContext, timeout: float | None = None) -> None:
        """Send a context now; `generate(ctx)` yields its outputs later.

        The streaming routes submit before the response headers go out, so the prompt is being
        scheduled and prefilled while they are written. A submitted request whose outputs are
        never read must be `withdraw`n, else it runs to its end.
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self._submitted[ctx.request_id] = self._open(ctx, timeout)
        try:
            await self._send_context(_without_stop_strings(ctx))
        except BaseException:
            self.withdraw([ctx.request_id])
            raise

    async def _send_context(self, ctx: TextContext, whole: bool = False) -> None:
        if not isinstance(ctx, TextAndVisionContext) or not ctx.images:
            await self.requests.send(self.encode(ctx), copy=False)
            return
        arrays = [img.pixel_values for img in ctx.images]
        if not whole and all(self._sent_images.get(id(a)) is a for a in arrays):
            # The other choices of a request share the first's arrays, which the scheduler
            # holds: their images go by reference (if it let them go, it says so and the
            # context is sent again whole, `_resend_whole`).
            self._by_reference[ctx.request_id] = ctx
            await self.requests.send(self.encode(msgspec.structs.replace(ctx, images=[
                msgspec.structs.replace(img, pixel_values=_no_pixels(img.pixel_values))
                for img in ctx.images])),
                copy=False)
            return
        # A context with images carries their pixel arrays (megabytes): one encoded at a time,
        # until ZeroMQ has handed it over.
        async with self._image_sends:
            tracker = await self.requests.send(self.encode(ctx), copy=False, track=True)
            while not tracker.done and self.dead_reason is None:
                await asyncio.sleep(0.002)
        for array in arrays:
            self._sent_images[id(array)] = array

    def _resend_whole(self, request_id: str) -> None:
        ctx = self._by_reference.pop(request_id)

        async def resend():
            try:
                await self._send_context(ctx, whole=True)
            except Exception as exc:  # (the engine is gone: its death reaches the stream)
                logger.warning("could not resend %s with its images: %s", request_id, exc)

        task = asyncio.ensure_future(resend())
        self._resends.add(task)  # (the loop keeps only a weak reference to a task)
        task.add_done_callback(self._resends.discard)

    def withdraw(self, request_ids: list[str]) -> None:
        """Cancel submitted requests whose outputs nobody started to read (the client left
        before the response body began); requests being read are left to their readers."""
        for request_id in request_ids:
            opened = self._submitted.pop(request_id, None)
            if opened is not None:
                self._close(request_id, opened, finished=False)

    async def generate(self, ctx: TextContext, timeout: float | None = None,
                       ) -> AsyncIterator[TextGenerationOutput]:
        """Send a context (unless it was submitted) and yield its outputs until it finishes.

        If the consumer stops early (client gone, stop string) or `timeout` seconds pass, the
        request is cancelled in the scheduler so its KV blocks are freed at once.
        """
        if ctx.request_id not in self._submitted:
            await self.submit(ctx, timeout)
        opened = self._submitted.pop(ctx.request_id)
        queue, clock = opened.queue, opened.clock
        finished = False
        generated = 0
        try:
            while True:
                output = await queue.get()
                if output is _DEADLINE_PASSED:
                    self._ended_early[ctx.request_id] = "error"
                    raise RequestTimeoutError(
                        f"the request exceeded the server's {opened.timeout:g}s time limit")
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
            self._close(ctx.request_id, opened, finished)

    def _open(self, ctx: TextContext, timeout: float | None) -> _OpenRequest:
        """Start the bookkeeping of a request about to be sent: its output queue, its clock,
        its deadline."""
        queue: asyncio.Queue[TextGenerationOutput | object] = asyncio.Queue()
        if not self.streams:
            self.busy_since = time.monotonic()
        self.streams[ctx.request_id] = queue
        if ctx.lora is not None:
            self._lora_of[ctx.request_id] = ctx.lora.name
        reserved = self._reserved.pop(ctx.request_id, None)
        if reserved is None:
            self.queued_tokens += ctx.prompt_length
        self._queued[ctx.request_id] = ctx.prompt_length
        # The deadline arrives through the queue, not as asyncio.wait_for around each get:
        # Python 3.11's wait_for swallows a cancellation (client gone) that lands while an
        # output is arriving, and the request would then run to its end.
        deadline = None if timeout is None else asyncio.get_running_loop().call_later(
            timeout, queue.put_nowait, _DEADLINE_PASSED)
        return _OpenRequest(queue, RequestClock(), timeout, deadline)

    def _close(self, request_id: str, opened: _OpenRequest, finished: bool) -> None:
        if opened.deadline is not None:
            opened.deadline.cancel()
        self._by_reference.pop(request_id, None)
        self._lora_of.pop(request_id, None)
        del self.streams[request_id]
        self._dequeue(request_id)
        # Popped whether or not it finished: a stop string can match in the final output.
        reason = self._ended_early.pop(request_id, "abort")
        if not finished:
            if self.metrics is not None:
                self.metrics.observe_early_end(opened.clock, reason)
            if self.dead_reason is None:
                self.cancel([request_id])

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


def _without_stop_strings(ctx: TextContext) -> TextContext:
    """The context as the scheduler gets it: stop strings are applied by this process's
    detokenizer, so they never cross the wire (up to 16 x 256 characters a request)."""
    if not ctx.sampling_params.stop:
        return ctx
    params = msgspec.structs.replace(ctx.sampling_params, stop=None)
    return msgspec.structs.replace(ctx, sampling_params=params)
