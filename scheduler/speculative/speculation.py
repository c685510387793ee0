"""Speculative decoding, the scheduler's part: which running requests propose tokens this step,
how many, and what became of them (issue 28).

The scheduler holds every request's realized tokens, so it proposes (n-gram or suffix lookups
over them, proposer.py) and puts the proposals in the step after the request's last
token: the worker verifies them in the same forward (a prefill-like chunk of k + 1 tokens)
and answers how many it accepted. A request proposes only when its last token is known (not
behind a step in flight) and while few requests run: a verify step of k + 1 tokens per
request costs little more than a one-token step when the step is bound by reading the weights,
and more and more as the batch grows and the step turns compute-bound. Each request's
proposal length follows its acceptance (AcceptanceHistory).
"""

from __future__ import annotations

import numpy as np

from pipelines.config import SpeculativeConfig
from pipelines.context import TextContext
from pipelines.status import GenerationStatus
from scheduler.speculative.acceptance import AcceptanceHistory
from scheduler.speculative.proposer import make_proposer

NO_DRAFT = np.zeros(0, dtype=np.int32)
# A request whose proposals found nothing looks again after this many overlapped steps.
RETRY_STEPS = 4


class Speculation:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_draft_tokens
        self.max_running = config.speculative_disable_by_batch_size
        self.proposer = make_proposer(config)
        if self.proposer is None:
            raise ValueError("speculative decoding is off")
        self.histories: dict[str, AcceptanceHistory] = {}
        # Per request: its last proposal's length, and steps built ahead since.
        self._tries: dict[str, list[int]] = {}
        # Totals since the start, for the metrics.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.num_speculative_tokens

    @classmethod
    def for_config(cls, config: SpeculativeConfig) -> Speculation | None:
        return None if config.speculative_method == "none" else cls(config)

    def applies(self, ctx: TextContext, num_running: int) -> bool:
        """Whether `ctx` may propose now: not when too many requests run, nor when it asked
        not to, nor with a LoRA adapter (not yet). (Structured output proposes too: the
        worker cuts the proposals its grammar refuses before verifying them.)"""
        return (num_running <= self.max_running and ctx.speculative_decoding
                and ctx.lora is None)

    def propose(self, ctx: TextContext, num_running: int, max_tokens: int) -> np.ndarray:
        """The tokens `ctx` proposes to follow its last one (at most `max_tokens`), or none."""
        if max_tokens <= 0 or not self.applies(ctx, num_running):
            return NO_DRAFT
        history = self.histories.get(ctx.request_id)
        if history is None:
            history = self.histories[ctx.request_id] = AcceptanceHistory(
                self.num_speculative_tokens)
        draft = self.proposer.propose(ctx.request_id, ctx.all_tokens,
                                      min(max_tokens, history.next_length))
        self._tries[ctx.request_id] = [len(draft), 0]
        return draft

    def waits_for_its_token(self, ctx: TextContext, num_running: int) -> bool:
        """Whether a request whose last token is still being sampled stays out of a step
        built ahead (overlap scheduling), so as to propose once the token is known: while
        its proposals find something, and every few steps to look again. (Else it decodes
        in every step, overlapped, with nothing to verify.)"""
        if not self.applies(ctx, num_running):
            return False
        tried = self._tries.setdefault(ctx.request_id, [0, 0])
        if tried[0] or tried[1] >= RETRY_STEPS:
            return True
        tried[1] += 1
        return False

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verified proposal: `accepted` of its `proposed` tokens were."""
        self.histories[request_id].record(proposed, accepted)
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def stats(self) -> dict:
        """The totals, as SchedulerStats' fields."""
        return dict(spec_num_drafts_total=self.num_drafts,
                    spec_num_draft_tokens_total=self.num_draft_tokens,
                    spec_num_accepted_tokens_total=self.num_accepted_tokens,
                    spec_accepted_per_position=list(self.accepted_per_position))

    def totals(self, request_id: str) -> tuple[int, int]:
        """(tokens proposed, tokens accepted) of the request so far."""
        history = self.histories.get(request_id)
        return (0, 0) if history is None else (history.num_draft_tokens,
                                               history.num_accepted_tokens)

    def release(self, ctx: TextContext) -> None:
        """The request ended: its output joins the suffix proposer's cache, unless it failed
        or was cancelled."""
        self.histories.pop(ctx.request_id, None)
        self._tries.pop(ctx.request_id, None)
        self.proposer.release(ctx.request_id, cache_output=ctx.status not in (
            GenerationStatus.CANCELLED, GenerationStatus.ERROR))


def room_to_generate(ctx: TextContext, max_model_len: int) -> int:
    """How many more tokens the request may generate (its max_length, max_new_tokens and the
    model's length): a step's proposals plus one must fit in it."""
    limit = min(ctx.max_length, max_model_len)
    max_new = ctx.sampling_params.max_new_tokens
    if max_new is not None:
        limit = min(limit, ctx.prompt_length + max_new)
    return limit - ctx.end_idx
