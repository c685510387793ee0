"""TextGenerationPipeline: MAX's TokenGenerator, what the worker runs.

`next_token(batch, num_steps)` runs the contexts of `batch` forward for `num_steps` steps and
returns, per step, a TextResponse per request id that got a token, each context `update`d with
it (so the context's own status ends it at EOS, a stop token id, max_new_tokens or
max_length); `release(context)` forgets it. The contexts' paged layout (their KV block tables,
and which tokens each step feeds) comes from the pipeline's step source, MAX's KV manager:

- `ScheduledSteps`, in the worker process: the scheduler process owns the blocks and sends one
  StepBatch per step; the worker keeps a context per running request, made from the step's
  NewRequest and kept current from each step's deltas (vLLM V1's persistent batch), so a
  step carries only what changed.
- `LocalSteps`, for scripts, notebooks and benchmarks: the server's own Scheduler (admission,
  chunked prefill, the prefix cache, preemption) in this process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import numpy as np

from pipelines.config import PipelineConfig
from pipelines.context import FUTURE_TOKEN, TextContext
from pipelines.response import TextResponse
from pipelines.status import GenerationStatus
from scheduler.block_manager import BlockManager
from scheduler.scheduler import ScheduledStep, Scheduler, new_tokens, sampled_logprobs_by_seq
from serialization.messages import NewRequest, StepBatch, StepResult
from worker.model_runner import ModelRunner


class TextGenerationPipeline:
    def __init__(self, runner: ModelRunner, steps: ScheduledSteps | LocalSteps) -> None:
        self.runner = runner
        self.steps = steps
        self.last_result: StepResult | None = None  # the last step's, packed (the wire form)

    @classmethod
    def in_process(cls, pipeline_config: PipelineConfig) -> TextGenerationPipeline:
        """A pipeline that schedules its contexts itself, with the server's Scheduler."""
        runner = ModelRunner(pipeline_config)
        return cls(runner, LocalSteps(runner, pipeline_config))

    @property
    def eos_token_ids(self) -> list[int]:
        return self.runner.eos_token_ids

    def next_token(
        self, batch: dict[str, TextContext], num_steps: int = 1
    ) -> list[dict[str, TextResponse]]:
        responses: list[dict[str, TextResponse]] = []
        for _ in range(num_steps):
            step = self.steps.layout(batch)
            if step is None:
                break
            with self.steps.feeding(step) as contexts:
                self.last_result = self.runner.next_token(step.batch, contexts)
            responses.append(self.steps.commit(step, self.last_result))
        return responses

    def release(self, context: TextContext) -> None:
        """Ends the context if it still runs, and forgets it and its KV blocks."""
        self.steps.release(context)
        self.runner.release(context.request_id)


class ScheduledSteps:
    """The scheduler process's steps, as the worker receives them, and the contexts of the
    requests they run."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.contexts: dict[str, TextContext] = {}
        self._step: ScheduledStep | None = None

    def receive(self, step: StepBatch) -> dict[str, TextContext]:
        """Take a step from the scheduler: contexts for its new requests, and the batch of
        contexts it runs, each context's window set to the tokens the step feeds it."""
        for new in step.new_requests:
            self.contexts[new.request_id] = self._new_context(new)
        contexts = [self.contexts[rid] for rid in step.request_ids]
        ids, q, seq_lens = step.input_ids, step.query_lens, step.seq_lens
        # A decode of the token this worker sampled last (FUTURE_TOKEN) finds its context as
        # that update left it; the others (prompt chunks, a preempted request's recomputed
        # tokens, a token given outright) are written into their contexts' windows.
        if len(ids) == len(q):  # (decodes only: the step was checked, every length is >= 1)
            starts, future = np.arange(len(q)), ids == FUTURE_TOKEN
        else:
            starts = np.cumsum(q) - q
            future = (q == 1) & (ids[starts] == FUTURE_TOKEN)
        drafts = step.num_draft_tokens
        for i in np.flatnonzero(~future).tolist():
            ctx, n, s, start = contexts[i], int(q[i]), int(seq_lens[i]), int(starts[i])
            k = int(drafts[i]) if drafts is not None else 0
            ctx.tokens[s - n : s - k] = ids[start : start + n - k]
            ctx.set_token_indices(start_idx=s - n, active_idx=s - k)
            if k:  # (proposals to verify: fed with the window, taken off by the result)
                ctx.append_draft(ids[start + n - k : start + n])
        if future.any():
            self._stand_in_for_done(contexts, np.flatnonzero(future), seq_lens)
        self._step = ScheduledStep(step, contexts, [])
        return {ctx.request_id: ctx for ctx in contexts}

    @staticmethod
    def _stand_in_for_done(contexts: list[TextContext], future: np.ndarray,
                           seq_lens: np.ndarray) -> None:
        """A FUTURE_TOKEN decode whose context took no token from the step before (it ended,
        or failed, while the scheduler built this step ahead of that result) feeds a
        stand-in."""
        for i in future.tolist():
            ctx, s = contexts[i], int(seq_lens[i])
            if ctx.start_idx != s - 1 or ctx.active_idx != s:
                contexts[i] = stand_in(ctx, s)

    def feeding(self, step: ScheduledStep) -> AbstractContextManager[list[TextContext]]:
        # (`receive` set their windows; a nullcontext costs a fifth of a generator's.)
        return nullcontext(step.contexts)

    def _new_context(self, new: NewRequest) -> TextContext:
        tokens = new.prompt_token_ids if new.prompt_token_ids is not None \
            else np.zeros(new.prompt_len, np.int64)  # (then filled in by the chunks)
        ctx = TextContext(request_id=new.request_id, tokens=tokens[: new.prompt_len],
                          max_length=new.max_length or self.max_model_len,
                          eos_token_ids=set(new.eos_token_ids),
                          sampling_params=new.sampling_params,
                          log_probabilities=new.logprobs,
                          log_probabilities_echo=new.echo_logprobs)
        for token in tokens[new.prompt_len :].tolist():  # (given past the prompt)
            ctx.jump_ahead(token)
        return ctx

    def layout(self, batch: dict[str, TextContext]) -> ScheduledStep | None:
        step, self._step = self._step, None  # (one step per step received)
        return step

    def commit(self, step: ScheduledStep, result: StepResult) -> dict[str, TextResponse]:
        return update_contexts(step, result)

    def release(self, context: TextContext) -> None:
        self.contexts.pop(context.request_id, None)


def update_contexts(step: ScheduledStep, result: StepResult) -> dict[str, TextResponse]:
    """Each context of `step` updated with its token (a prompt chunk that samples nothing
    moves past the tokens it fed); the responses, by request id. A context already done (a
    step built ahead of its last token's result, overlap scheduling) takes no more."""
    sampled = result.sampled_token_ids.tolist()
    logprobs = sampled_logprobs_by_seq(result) if result.sampled_logprobs is not None else {}
    failed = {f.seq for f in result.failed}
    active = GenerationStatus.ACTIVE
    drafts = step.batch.num_draft_tokens
    responses = {}
    for i, (ctx, samples, last) in enumerate(zip(step.contexts, step.batch.sample.tolist(),
                                                 sampled)):
        k = int(drafts[i]) if drafts is not None else 0
        if k and ctx.status is active:
            ctx.rollback(k)  # (the proposals; the accepted ones come back as new tokens)
        if ctx.status is not active:
            continue
        if failed and i in failed:
            ctx.status = GenerationStatus.ERROR
        elif samples:
            for token, lp in new_tokens(step.batch, result, i, last, logprobs.get(i)):
                ctx.update(token, lp)
                responses[ctx.request_id] = TextResponse(token, lp)
                if ctx.is_done:  # (a stop among the accepted tokens ends the run there)
                    break
        else:
            ctx.set_token_indices(start_idx=ctx.active_idx)
    return responses


class LocalSteps:
    """The server's Scheduler in this process: it admits the batch's contexts, allocates their
    KV blocks and builds each step; its `update` applies the tokens to the contexts."""

    def __init__(self, runner: ModelRunner, pipeline_config: PipelineConfig) -> None:
        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, runner.block_size,
                                   pipeline_config.kv_cache_config.enable_prefix_caching)
        # (A tree not resolved by `loom serve` gets the model's context length from the runner.)
        self.scheduler = Scheduler(pipeline_config.replace(max_length=runner.max_model_len),
                                   self.blocks)

    def layout(self, batch: dict[str, TextContext]) -> ScheduledStep | None:
        self._admit(batch)
        step = self.scheduler.schedule() if self.scheduler.has_work else None
        if step is not None:
            self.runner.check(step.batch)
        return step

    @staticmethod
    def feeding(step: ScheduledStep):
        return feeding(step)

    def commit(self, step: ScheduledStep, result: StepResult) -> dict[str, TextResponse]:
        outputs = self.scheduler.update(step, result)
        return {o.request_id: TextResponse(next_token=o.tokens[-1],
                                           log_probabilities=(o.log_probabilities or [None])[-1])
                for o in outputs if o.tokens}

    def release(self, context: TextContext) -> None:
        self.scheduler.abort(context.request_id)
        self.blocks.free(context.request_id)

    def _admit(self, batch: dict[str, TextContext]) -> None:
        """New contexts join the scheduler; one it still runs must be in every batch (as MAX's
        pipeline runs exactly the batch it is given) until it is done or released."""
        missing = set(self.scheduler.requests) - set(batch)
        if missing:
            raise ValueError(f"contexts {sorted(missing)} are still generating: pass them in "
                             f"every batch until they are done, or release them")
        for ctx in batch.values():
            if not ctx.is_done and ctx.request_id not in self.scheduler.requests:
                self.scheduler.add_request(ctx)


@contextmanager
def feeding(step: ScheduledStep) -> Iterator[list[TextContext]]:
    """The Scheduler's step's contexts, each window at the tokens the step feeds it, for the
    model (the Scheduler moves them on as it builds a step, so that the next can be built
    before this one's result); then as the Scheduler left them."""
    contexts, batch = list(step.contexts), step.batch
    kept = [(ctx.start_idx, ctx.active_idx) for ctx in contexts]
    for i, (n, s) in enumerate(zip(batch.query_lens.tolist(), batch.seq_lens.tolist())):
        if s > contexts[i].end_idx:  # (it ended before this step, built ahead, ran)
            contexts[i] = stand_in(contexts[i], s)
        else:
            contexts[i].set_token_indices(start_idx=s - n, active_idx=s)
    try:
        yield contexts
    finally:
        for ctx, (start, active) in zip(step.contexts, kept):
            ctx.set_token_indices(start_idx=start, active_idx=active)


def stand_in(ctx: TextContext, seq_len: int) -> TextContext:
    """What a context that ended feeds in a decode step built before it ended: its row is
    discarded, so any token will do at its last position."""
    done = TextContext(request_id=ctx.request_id, tokens=np.zeros(seq_len, np.int64),
                       max_length=seq_len + 1, status=ctx.status)
    done.set_token_indices(start_idx=seq_len - 1)
    return done


def run_step(runner: ModelRunner, step: ScheduledStep) -> StepResult:
    """One step of an in-process Scheduler through the runner (tests and benchmarks that
    drive the Scheduler themselves)."""
    with feeding(step) as contexts:
        return runner.next_token(step.batch, contexts)
