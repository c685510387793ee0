"""Text generation as a step source: the continuous-batching Scheduler (scheduler.py), and the
timings of its steps that go to the API process' metrics with the scheduler's stats."""

from __future__ import annotations

from pipelines.context import TextContext
from scheduler.scheduler import ScheduledStep, Scheduler
from serialization.messages import ResponseBatch, SchedulerStats, StepBatch, StepResult


class TextSource:
    kind = "text"
    context_type = TextContext
    result_type = StepResult

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.last_finished_at: float | None = None  # worker clock, last step, while busy
        self._iteration_tokens: list[int] = []
        self._step_overheads: list[float] = []
        self._prefill_forward_times: list[float] = []
        self._decode_forward_times: list[float] = []

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, ctx: TextContext) -> None:
        self.scheduler.add_request(ctx)

    def abort(self, request_ids: set[str]) -> None:
        self.scheduler.abort(list(request_ids))

    def next_step(self, ahead: bool = False) -> tuple[StepBatch, ScheduledStep] | None:
        """`ahead`: to queue behind the running step (scheduler.py says what that changes)."""
        step = self.scheduler.schedule(ahead=ahead)
        if step is None:
            return None
        if not ahead:  # the worker waited for it since its last step, if it ran one
            step.follows_finished_at = self.last_finished_at
        return step.batch, step

    def queued_behind(self, step: ScheduledStep, finished_at: float) -> None:
        """`step` was queued behind the one that finished at `finished_at`: the worker went
        straight on to it."""
        step.follows_finished_at = finished_at

    def idle(self) -> None:
        self.last_finished_at = None

    def finish(self, step: ScheduledStep, result: StepResult) -> ResponseBatch:
        self.last_finished_at = result.finished_at
        forward = result.finished_at - result.started_at
        self._iteration_tokens.append(int(step.batch.query_lens.sum()))
        if (step.batch.query_lens > 1).any():
            self._prefill_forward_times.append(forward)
        else:
            self._decode_forward_times.append(forward)
        if step.follows_finished_at is not None:
            self._step_overheads.append(result.started_at - step.follows_finished_at)
        if result.error is not None:
            return ResponseBatch(outputs=self.scheduler.fail_step(step, result.error))
        outputs = self.scheduler.update(step, result)
        return ResponseBatch(outputs=outputs)

    def take_stats(self) -> SchedulerStats:
        """The scheduler's state, with the step timings gathered since the last call."""
        stats = self.scheduler.stats()
        stats.iteration_tokens, self._iteration_tokens = self._iteration_tokens, []
        stats.step_overheads, self._step_overheads = self._step_overheads, []
        stats.prefill_forward_times, self._prefill_forward_times = self._prefill_forward_times, []
        stats.decode_forward_times, self._decode_forward_times = self._decode_forward_times, []
        return stats
