"""Continuous batching with chunked prefill, prefix caching and preemption.

Every step has one representation for every request: how many of its tokens are fed to the
model this step (vLLM V1's idea). A decode feeds 1, a prompt feeds as much as the token budget
leaves, a prefix-cache hit simply starts later. Running requests are served first, oldest
first; waiting requests are admitted in arrival order while budget, batch slots and KV blocks
last. When blocks run out, the newest running request is preempted: its blocks are freed, its
context `reset()`, and it goes back to the front of the queue to be re-encoded later.

Overlap scheduling: a step advances its contexts when it is built, not when its result comes
back; a context that samples gets a placeholder token (`update_with_future_token`). So the
next step can be built, and sent, while this one runs; the worker feeds its own last sampled
token for the placeholder, and the result fills it in (`realize_future_token`). A step built
ahead (`schedule(ahead=True)`) never preempts and skips requests that will have finished.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from pipelines.config import PipelineConfig
from pipelines.context import TextContext
from pipelines.response import LogProbabilities, RequestTimings, TextGenerationOutput
from pipelines.status import GenerationStatus
from pipelines.vision_context import TextAndVisionContext
from scheduler.block_manager import BlockManager
from scheduler.speculative.speculation import NO_DRAFT, Speculation, room_to_generate
from scheduler.step_builder import build_step_batch
from serialization.messages import NewRequest, SchedulerStats, StepBatch, StepResult, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class ScheduledStep:
    batch: StepBatch
    contexts: list[TextContext]
    prompt_tokens: list[int]  # of each context's tokens fed this step, how many are prompt
    # The worker's finishing time of the step before, if this one was ready for the worker
    # right then (queued behind it, or sent as its result arrived): the worker sat idle from
    # then until this step started (the per-step overhead).
    follows_finished_at: float | None = None


class Scheduler:
    def __init__(self, pipeline_config: PipelineConfig, blocks: BlockManager) -> None:
        if pipeline_config.model_config.max_length is None:
            raise ValueError("the scheduler needs the resolved context length (max_length)")
        self.max_batch_size = pipeline_config.max_batch_size
        # (Unset: the worker's device's default, which SchedulerLoop.start puts in the config
        # from WorkerReady; a scheduler made in process is a CPU's.)
        self.max_batch_input_tokens = pipeline_config.batch_input_tokens_on("cpu")
        self.enable_chunked_prefill = pipeline_config.enable_chunked_prefill
        lora = pipeline_config.lora_config
        self.max_num_loras = lora.max_num_loras if lora.enable_lora else 0
        self.max_model_len = pipeline_config.model_config.max_length
        self.blocks = blocks
        self.waiting: deque[TextContext] = deque()
        self.running: list[TextContext] = []
        self.requests: dict[str, TextContext] = {}
        self._known_to_worker: set[str] = set()
        self._finished_since_last_step: list[str] = []
        self._next_step_id = 0
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.timings: dict[str, RequestTimings] = {}
        self._prompt_logprobs: dict[str, list[LogProbabilities]] = {}
        self.speculation = Speculation.for_config(pipeline_config.speculative_config)
        # Requests whose step in flight verifies proposals, and how many: their contexts
        # hold the proposals until the result says which stay.
        self._verifying: dict[str, int] = {}

    # ---- request lifecycle ------------------------------------------------------------------
    def add_request(self, ctx: TextContext) -> None:
        if ctx.request_id in self.requests:
            logger.warning("duplicate request id %s dropped", ctx.request_id)
            return
        self.requests[ctx.request_id] = ctx
        self.timings[ctx.request_id] = RequestTimings(arrival=time.monotonic())
        self.waiting.append(ctx)

    def abort(self, request_ids: str | list[str]) -> int:
        """Cancel requests; returns how many were still known. The queues are filtered once
        for all of them: a request of many prompts or choices cancels its hundreds of
        sequences at once, and one scan each would make that quadratic."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        aborted = {}
        for request_id in request_ids:
            ctx = self.requests.get(request_id)
            if ctx is not None:
                aborted[id(ctx)] = ctx
        for ctx in aborted.values():
            ctx.status = GenerationStatus.CANCELLED
            self._finish(ctx, dequeue=False)
        if aborted:
            self.running = [c for c in self.running if id(c) not in aborted]
            self.waiting = deque(c for c in self.waiting if id(c) not in aborted)
        return len(aborted)

    def _finish(self, ctx: TextContext, dequeue: bool = True) -> RequestTimings | None:
        self.requests.pop(ctx.request_id, None)
        timings = self.timings.pop(ctx.request_id, None)
        self._prompt_logprobs.pop(ctx.request_id, None)
        if timings is not None:
            timings.finished = time.monotonic()
        if not dequeue:
            pass  # the caller filters the queues
        elif ctx in self.running:
            self.running.remove(ctx)
        elif ctx in self.waiting:
            self.waiting.remove(ctx)
        self.blocks.free(ctx.request_id)
        if self.speculation is not None:
            self._verifying.pop(ctx.request_id, None)
            self.speculation.release(ctx)
        if ctx.request_id in self._known_to_worker:
            self._known_to_worker.discard(ctx.request_id)
            self._finished_since_last_step.append(ctx.request_id)
        return timings

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self, ahead: bool = False) -> ScheduledStep | None:
        """The next step, or None if nothing can run. `ahead`: built while earlier steps are
        still running, so it may not preempt (their contexts hold placeholders); it gives up
        instead, and the step is built once they are done."""
        budget = self.max_batch_input_tokens
        scheduled: list[TextContext] = []
        num_new: dict[str, int] = {}
        drafts: dict[str, np.ndarray] = {}
        preempted = False

        # Running requests first, oldest first; preempt from the newest end when out of blocks.
        i = 0
        while i < len(self.running) and budget > 0:
            ctx = self.running[i]
            n = image_aligned_chunk(ctx, ctx.start_idx, min(ctx.end_idx - ctx.start_idx, budget))
            if (n == 0 or self._finishes_with_pending_token(ctx) or self._waits_to_propose(ctx)):
                i += 1  # waiting for a result: nothing it can feed yet
                continue
            draft = self._propose(ctx, n, budget)
            while not self.blocks.allocate(ctx.request_id, ctx.start_idx + n + len(draft)):
                if len(draft):  # (proposals never take blocks from others)
                    draft = draft[:0]
                    continue
                if ahead:
                    return None
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is ctx:
                    break
            if ctx not in self.running:
                break
            scheduled.append(ctx)
            if len(draft):
                ctx.append_draft(draft)
                drafts[ctx.request_id] = draft
            num_new[ctx.request_id] = n + len(draft)
            budget -= n + len(draft)
            i += 1

        # Then waiting requests, in arrival order, while everything they need is there.
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_batch_size):
            ctx = self._next_admissible()
            if ctx is None:
                break
            cached = []
            if ctx.start_idx == 0 and not ctx.log_probabilities_echo:
                # (Echo needs logits at every prompt position: nothing may be skipped.)
                cached = self._cached_prefix(ctx)
            start = len(cached) * self.blocks.block_size if cached else ctx.start_idx
            n = image_aligned_chunk(ctx, start, min(ctx.end_idx - start, budget))
            if n < ctx.end_idx - start and not self.enable_chunked_prefill:
                break  # (the whole prompt in a step of its own, later)
            if not self.blocks.allocate(ctx.request_id, start + n, cached):
                break
            if cached:
                ctx.set_token_indices(start_idx=start)
            if ctx is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(ctx)
            self.running.append(ctx)
            scheduled.append(ctx)
            num_new[ctx.request_id] = n
            budget -= n

        if not scheduled:
            return None
        return self._build_step(scheduled, num_new, drafts)

    def _waits_to_propose(self, ctx: TextContext) -> bool:
        """Its proposals are being verified, or it will propose once its token is known."""
        if self.speculation is None:
            return False
        return ctx.request_id in self._verifying or (
            ctx.num_future > 0 and self.speculation.waits_for_its_token(ctx, len(self.running)))

    def _propose(self, ctx: TextContext, n: int, budget: int) -> np.ndarray:
        """Tokens a decoding request proposes to follow its last (speculative decoding), to
        be verified in the same step: within the step's token budget, and never more than it
        may still generate."""
        if (self.speculation is None or n != 1 or ctx.num_future or ctx.is_initial_prompt
                or type(ctx) is not TextContext or ctx.end_idx - ctx.start_idx != 1):
            return NO_DRAFT
        room = room_to_generate(ctx, self.max_model_len) - 1  # (and the token after them)
        return self.speculation.propose(ctx, len(self.running), min(room, budget - n))

    def _next_admissible(self) -> TextContext | None:
        """The oldest waiting request whose LoRA adapter can run beside the running ones' (at
        most max_num_loras adapters at once, vLLM's rule: the worker holds that many); one
        of another adapter waits until a running adapter's requests are done."""
        if not self.max_num_loras:
            return self.waiting[0]
        running = self._lora_names(self.running)
        for ctx in self.waiting:
            if ctx.lora is None or ctx.lora.name in running or \
                    len(running) < self.max_num_loras:
                return ctx
        return None

    @staticmethod
    def _lora_names(contexts) -> set[str]:
        return {ctx.lora.name for ctx in contexts if ctx.lora is not None}

    def _cached_prefix(self, ctx: TextContext) -> list[int]:
        """Cached blocks holding a prefix of the context's tokens under its `cache_salt`
        (another salt's blocks never match). Images are keyed by their pixels
        (`prefix_cache_tokens`), so only the same image hits. A hit that ends inside an image
        is cut back to the block holding the image's first token (and again if that block
        starts inside another image): no chunk starts inside an image."""
        cached = self.blocks.find_cached_prefix(ctx.prefix_cache_tokens[: ctx.end_idx],
                                                ctx.prefix_salt)
        if isinstance(ctx, TextAndVisionContext):
            size, kept = self.blocks.block_size, len(cached)
            # (That block's start may lie inside an earlier image: cut back again.)
            while kept and (start := ctx.compute_image_aligned_idx(kept * size)) < kept * size:
                kept = start // size
            cached = cached[:kept]
        return cached

    def _finishes_with_pending_token(self, ctx: TextContext) -> bool:
        """Its placeholder token is the last it may have: it is done once that arrives."""
        limit = min(ctx.max_length, self.max_model_len)
        return ctx.num_future > 0 and ctx.end_idx >= limit

    def _preempt(self, ctx: TextContext) -> None:
        assert ctx.num_future == 0, "preempting a request with a step in flight"
        self.running.remove(ctx)
        self.blocks.free(ctx.request_id)
        ctx.reset()
        self.waiting.appendleft(ctx)
        self.num_preemptions += 1
        self.timings[ctx.request_id].num_preemptions += 1
        logger.debug("preempted %s (%d tokens)", ctx.request_id, ctx.end_idx)

    def _build_step(self, contexts: list[TextContext], num_new: dict[str, int],
                    drafts: dict[str, np.ndarray]) -> ScheduledStep:
        new_requests = []
        now = time.monotonic()
        for ctx in contexts:
            timings = self.timings[ctx.request_id]
            if not timings.first_scheduled:
                timings.first_scheduled = now
            if ctx.request_id not in self._known_to_worker:
                self._known_to_worker.add(ctx.request_id)
                new_requests.append(new_request_for_worker(ctx))
        batch = build_step_batch(
            self._next_step_id,
            contexts,
            [num_new[c.request_id] for c in contexts],
            [self.blocks.block_table(c.request_id) for c in contexts],
            new_requests,
            self._finished_since_last_step,
        )
        if drafts:
            batch.num_draft_tokens = np.array([len(drafts.get(c.request_id, ()))
                                               for c in contexts], dtype=np.int32)
            self._verifying.update((rid, len(d)) for rid, d in drafts.items())
        self._finished_since_last_step = []
        self._next_step_id += 1
        prompt_tokens = []
        for ctx, samples in zip(contexts, batch.sample):
            prompt_tokens.append(ctx.active_length if ctx.is_initial_prompt else 0)
            if ctx.request_id in drafts:
                continue  # (it holds its proposals until the result)
            # Advance now, so the next step can be built before this one's result.
            if samples:
                ctx.update_with_future_token()
            else:
                ctx.set_token_indices(start_idx=ctx.active_idx, active_idx=ctx.end_idx)
        return ScheduledStep(batch, contexts, prompt_tokens)

    def update(self, step: ScheduledStep, result: StepResult) -> list[TextGenerationOutput]:
        """Apply a step's results; returns the outputs to send to the API process."""
        outputs: list[TextGenerationOutput] = []
        take_draft_tokens(step.batch, result)
        sampled = result.sampled_token_ids
        logprobs = sampled_logprobs_by_seq(result)
        drafts = step.batch.num_draft_tokens
        prompt_logprobs = prompt_logprobs_by_seq(result)
        failures = {f.seq: f.error for f in result.failed}
        for i, ctx in enumerate(step.contexts):
            if ctx.request_id not in self.requests:  # aborted (or ended) while the step ran
                continue
            if i in failures:  # it failed alone: the others of the step go on
                outputs.append(self._fail(ctx, failures[i]))
                continue
            self.prompt_tokens_total += step.prompt_tokens[i]
            num_computed = int(step.batch.seq_lens[i])
            if drafts is not None and drafts[i]:
                num_computed = self._verified(step, result, i, ctx, logprobs.get(i))
            elif step.batch.sample[i]:
                ctx.realize_future_token(int(sampled[i]), (logprobs.get(i) or [None])[-1])
                self.generation_tokens_total += 1
                timings = self.timings[ctx.request_id]
                if not timings.first_token:
                    timings.first_token = time.monotonic()
            elif step.batch.seq_lens[i] == ctx.end_idx and ctx.end_idx >= ctx.max_length:
                # Prompt-only request (max_tokens=0, e.g. scoring with echo) whose last chunk
                # this was: done.
                ctx.status = GenerationStatus.MAXIMUM_LENGTH
            # Blocks full of tokens this step computed (steps queued behind it are not done).
            self.blocks.register_full_blocks(
                ctx.request_id, ctx.prefix_cache_tokens, num_computed, ctx.prefix_salt,
                ctx.lora.lora_int_id if ctx.lora is not None else None)
            if ctx.end_idx - ctx.num_future >= self.max_model_len and not ctx.is_done:
                ctx.status = GenerationStatus.MAXIMUM_LENGTH
            if i in prompt_logprobs:
                self._prompt_logprobs.setdefault(ctx.request_id, []).extend(prompt_logprobs[i])
            prompt_lp = self._prompt_logprobs.pop(ctx.request_id, None)
            timings = None
            spec_totals = None
            if ctx.is_done:
                if self.speculation is not None:
                    spec_totals = self.speculation.totals(ctx.request_id)
                timings = self._finish(ctx)
            if step.batch.sample[i] or ctx.is_done or prompt_lp:
                output = ctx.to_generation_output()
                output.timings = timings
                output.prompt_log_probabilities = prompt_lp
                if spec_totals is not None:
                    output.num_draft_tokens, output.num_accepted_tokens = spec_totals
                outputs.append(output)
        return outputs

    def _verified(self, step: ScheduledStep, result: StepResult, i: int, ctx: TextContext,
                  logprobs: list[LogProbabilities] | None) -> int:
        """Apply the result of a step in which sequence i verified proposals: they come off
        the context, the accepted ones and the token after them go on (up to the first that
        ends the request), and the blocks past them are freed. Returns the tokens whose KV
        is now verified (the prefix cache may hold those)."""
        k = self._verifying.pop(ctx.request_id)
        ctx.rollback(k)
        sampled = int(result.sampled_token_ids[i])
        for token, lp in new_tokens(step.batch, result, i, sampled, logprobs):
            ctx.update(token, lp)
            self.generation_tokens_total += 1
            if ctx.is_done:
                break
        accepted = int(result.num_accepted[i]) if result.num_accepted is not None else 0
        self.speculation.record(ctx.request_id, k, accepted)
        self.blocks.truncate(ctx.request_id, ctx.end_idx)
        timings = self.timings[ctx.request_id]
        if not timings.first_token:
            timings.first_token = time.monotonic()
        return min(int(step.batch.seq_lens[i]) - k + accepted, ctx.end_idx)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.blocks.usage,
            num_preemptions_total=self.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            prefix_cache_queries_total=self.blocks.prefix_queries,
            prefix_cache_hits_total=self.blocks.prefix_hits,
            running_lora_adapters=sorted(self._lora_names(self.running))
            if self.max_num_loras else [],
            waiting_lora_adapters=sorted(self._lora_names(self.waiting))
            if self.max_num_loras else [],
            **(self.speculation.stats() if self.speculation is not None else {}),
        )

    def fail_step(self, step: ScheduledStep, message: str) -> list[TextGenerationOutput]:
        """The worker could not run this step: its requests end with an error."""
        return [self._fail(ctx, message) for ctx in step.contexts
                if ctx.request_id in self.requests]

    def _fail(self, ctx: TextContext, message: str) -> TextGenerationOutput:
        """End a request with an error."""
        ctx.status = GenerationStatus.ERROR
        timings = self._finish(ctx)
        return TextGenerationOutput(request_id=ctx.request_id, tokens=[],
                                    final_status=GenerationStatus.ERROR, error=message,
                                    timings=timings)


def image_aligned_chunk(ctx: TextContext, start: int, n: int) -> int:
    """How many tokens from `start` a chunk of at most `n` feeds so that the next chunk does
    not start inside an image (MAX's TextAndVisionContext forbids it): a chunk that would end
    inside an image ends at its start instead. A chunk that starts at an image longer than
    the budget takes the whole image, over the budget, rather than refusing the request: an
    image of a real Idefics3 or Qwen2-VL prompt can be longer than the default budget, and a
    vision step runs on the CPU, unsharded, with no buffer sized by the budget."""
    end = start + n
    if not isinstance(ctx, TextAndVisionContext) or end >= ctx.end_idx:
        return n
    aligned = ctx.compute_image_aligned_idx(end)
    if aligned > start:
        return aligned - start
    return next(img.end_idx for img in ctx.images if img.start_idx <= end < img.end_idx) - start


def new_request_for_worker(ctx: TextContext) -> NewRequest:
    params = ctx.sampling_params
    return NewRequest(
        request_id=ctx.request_id,
        sampling_params=params,
        eos_token_ids=[] if ctx.ignore_eos else sorted(ctx.eos_token_ids),
        logprobs=ctx.log_probabilities,
        echo_logprobs=ctx.log_probabilities_echo,
        prompt_len=ctx.prompt_length,
        prompt_token_ids=ctx.all_tokens.copy(),  # (the worker keeps a context of them)
        json_schema=ctx.json_schema,
        rope_positions=ctx.extra_model_args.get("rope_positions")
        if isinstance(ctx, TextAndVisionContext) else None,
        max_length=ctx.max_length,
        lora=ctx.lora,
    )


def to_log_probabilities(lp: TokenLogprobs, row: int) -> LogProbabilities:
    top = dict(zip(lp.top_token_ids[row].tolist(), lp.top_logprobs[row].tolist()))
    return LogProbabilities([float(lp.token_logprobs[row])], [top])


def sampled_logprobs_by_seq(result: StepResult) -> dict[int, list[LogProbabilities]]:
    """Each sequence's new tokens' log probabilities, in order (one token's without
    speculation)."""
    if result.sampled_logprobs is None:
        return {}
    by_seq: dict[int, list[LogProbabilities]] = {}
    for row, seq in enumerate(result.logprob_seqs):
        by_seq.setdefault(seq, []).append(to_log_probabilities(result.sampled_logprobs, row))
    return by_seq


def take_draft_tokens(batch: StepBatch, result: StepResult) -> None:
    """A draft model's proposals (made by the worker) in place of the placeholders the step
    fed, so that the accepted ones read as any proposer's."""
    if result.draft_token_ids is None or batch.num_draft_tokens is None:
        return
    k = batch.num_draft_tokens.astype(np.int64)
    ends = np.cumsum(batch.query_lens.astype(np.int64))
    proposing = np.flatnonzero(k)
    if int(k.sum()) != len(result.draft_token_ids):
        raise ValueError(f"step {batch.step_id}: {len(result.draft_token_ids)} draft tokens "
                         f"for {int(k.sum())} proposed")
    where = np.concatenate([np.arange(ends[i] - k[i], ends[i]) for i in proposing])
    batch.input_ids[where] = result.draft_token_ids


def new_tokens(batch: StepBatch, result: StepResult, seq: int, sampled: int,
               logprobs: list[LogProbabilities] | None) -> list[tuple]:
    """Sequence `seq`'s new tokens from the step, with their log probabilities (or None):
    the accepted proposals, then the sampled token (that alone without speculation)."""
    accepted = int(result.num_accepted[seq]) if result.num_accepted is not None else 0
    tokens = [sampled]
    if accepted:
        end = int(np.cumsum(batch.query_lens[: seq + 1])[-1])
        k = int(batch.num_draft_tokens[seq])
        tokens = batch.input_ids[end - k : end - k + accepted].tolist() + tokens
    return list(zip(tokens, logprobs or [None] * len(tokens)))



def prompt_logprobs_by_seq(result: StepResult) -> dict[int, list[LogProbabilities]]:
    by_seq: dict[int, list[LogProbabilities]] = {}
    for part in result.prompt_logprobs:
        entries = by_seq.setdefault(part.seq, [])
        entries.extend(to_log_probabilities(part.logprobs, r)
                       for r in range(len(part.logprobs.token_logprobs)))
    return by_seq
