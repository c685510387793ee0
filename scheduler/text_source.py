"""Text generation as a step source: the continuous-batching Scheduler (scheduler.py), and the
timings of its steps that go to the API process' metrics with the scheduler's stats."""

from __future__ import annotations

from pipelines.context import TextContext
from scheduler.kv_events import KVCacheEvent
from scheduler.scheduler import ScheduledStep, Scheduler
from serialization.messages import ResponseBatch, SchedulerStats, StepBatch, StepResult


class TextSource:
    kind = "text"
    context_type = TextContext
    result_type = StepResult

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.last_finished_at: float | None = None  # worker clock, last step, while busy
        self._queued: ScheduledStep | None = None  # built ahead, behind the running step
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
        if ahead:
            self._queued = step
        else:  # the worker waited for it since its last step, if it ran one
            step.follows_finished_at = self.last_finished_at
        return step.batch, step

    def idle(self) -> None:
        self.last_finished_at = None

    def after_step(self, step: ScheduledStep, result: StepResult) -> ResponseBatch:
        """A step's result: its tokens applied, its timings kept for the metrics."""
        if self._queued is not None and self._queued is not step:
            # Queued behind this step: the worker went straight on to it.
            self._queued.follows_finished_at = result.finished_at
        self._queued = None
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

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call (empty unless recorded)."""
        if not self.scheduler.blocks.kv_events:
            return []
        return self.scheduler.blocks.take_kv_events()
