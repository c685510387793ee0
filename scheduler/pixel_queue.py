"""Image generation as a step source (step_source.py): continuous batching of denoising steps.

A pixel request is `num_inference_steps` steps (PixelContext.compute_num_available_steps). Up
to `max_requests` requests run together: every step advances each of them by one, whatever
step each is at, in one worker call; a waiting request joins at the next step, and one that
finishes or is cancelled frees its slot for the next step. The worker keeps each running
request's latents and text embeddings between steps, so a step message names the requests
and carries only the contexts that are new.
"""

from __future__ import annotations

from collections import deque

from pipelines.pixel_context import GenerationOutput, PixelContext
from pipelines.status import GenerationStatus
from serialization.messages import PixelResult, PixelStep, ResponseBatch

# Requests denoised together: each holds its latents and text embeddings in the worker, and
# up to 4 images (x2 with real CFG) are rows of every transformer call.
MAX_RUNNING = 4


class PixelQueue:
    kind = "pixels"
    context_type = PixelContext
    result_type = PixelResult

    def __init__(self, max_requests: int = MAX_RUNNING) -> None:
        self.max_requests = max_requests
        self._step_id = 0
        self.waiting: deque[PixelContext] = deque()
        self.running: dict[str, PixelContext] = {}  # in the order they joined
        self._in_worker: set[str] = set()  # running requests the worker has been sent
        self._released: list[str] = []  # cancelled in the worker: it forgets them next step

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, ctx: PixelContext) -> None:
        self.waiting.append(ctx)

    def abort(self, request_ids: set[str]) -> None:
        self.waiting = deque(c for c in self.waiting if c.request_id not in request_ids)
        for rid in request_ids & self.running.keys():
            ctx = self.running.pop(rid)
            ctx.status = GenerationStatus.CANCELLED
            if rid in self._in_worker:
                self._in_worker.discard(rid)
                self._released.append(rid)

    def next_step(self) -> tuple[PixelStep, list[PixelContext]] | None:
        while self.waiting and len(self.running) < self.max_requests:
            ctx = self.waiting.popleft()
            self.running[ctx.request_id] = ctx
        if not self.running:
            return None
        contexts = list(self.running.values())
        new = [c for c in contexts if c.request_id not in self._in_worker]
        self._in_worker.update(c.request_id for c in new)
        step = PixelStep(step_id=self._step_id, request_ids=[c.request_id for c in contexts],
                         new=new, released=self._released)
        self._step_id += 1
        self._released = []
        return step, contexts

    def after_step(self, sent: list[PixelContext], result: PixelResult) -> ResponseBatch:
        if result.error is not None or len(result.outputs) != len(sent):
            error = result.error or "the worker answered another step"
            outputs = [GenerationOutput(request_id=c.request_id, steps_executed=c.step,
                                        final_status=GenerationStatus.ERROR, error=error)
                       for c in sent]
        else:
            outputs = result.outputs
        images = []
        for ctx, out in zip(sent, outputs):
            if ctx.status is GenerationStatus.CANCELLED:  # cancelled during the step
                continue
            ctx._step = out.steps_executed
            ctx.status = out.final_status
            if out.is_done:
                self.running.pop(ctx.request_id, None)
                self._in_worker.discard(ctx.request_id)
                if out.final_status is GenerationStatus.ERROR:  # (it forgets finished ones)
                    self._released.append(ctx.request_id)
            images.append(out)
        return ResponseBatch(outputs=[], images=images)
