"""Proposals of a draft model (--speculative-method draft): a smaller model with the served
model's tokenizer, run by the same worker just before the step's forward, proposing greedily
the tokens that the step then verifies (ModelRunner._verify, as any proposer's).

Its KV cache is a second paged cache with as many blocks as the served model's, indexed by
the same block tables: the scheduler's block accounting stays one, and a block the prefix cache
shares holds both models' entries. The scheduler marks a proposing sequence with k placeholder
tokens after its last one (scheduler/speculative/proposer.py: DraftModelSlots); here

  1. one forward of the draft over every sequence that proposes or feeds a prompt chunk (or
     is new to it): the tokens it has not seen yet, up to the last real one; its last row
     gives proposal 1;
  2. k - 1 one-token forwards (the native decode step) over the proposing sequences, each
     feeding the proposal before, give proposals 2..k;

and the proposals replace the placeholders (in the step's ids and the contexts' windows) before
the served model runs. Proposals are greedy (the draft's argmax): for a sampled request its
distribution q is one-hot, the rejection rule's deterministic case, so the output distribution
stays exactly the served model's.

The draft's cache is written up to the position before the last proposal. What it has seen of
each request is tracked (`seen`): a step after all k proposals were accepted feeds the last
proposal again with the bonus token, and a request that decoded without proposing (too many
running, or opted out) catches up on its tokens in its next proposing step. Entries past the
request's length after a rejection are overwritten before they are read (positions past the
context length never are). A stale entry (a block the prefix cache shares whose last proposal
the draft never saw) can only cost acceptance, never change a verified token.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pipelines.context import TextContext
from pipelines.pipeline import PagedCausalLM, PagedKVCacheManager, PagedModelInputs
from serialization.messages import StepBatch

logger = logging.getLogger(__name__)


class DraftModel:
    def __init__(self, model: PagedCausalLM, kv_manager: PagedKVCacheManager,
                 vocab_size: int) -> None:
        self.model = model
        self.kv = kv_manager
        self.vocab_size = vocab_size  # the served model's: proposals stay below it
        self.seen: dict[str, int] = {}  # request -> positions whose draft KV is written

    def propose(self, step: StepBatch, contexts: list[TextContext],
                proposing: np.ndarray) -> np.ndarray | None:
        """The proposals of the `proposing` sequences (their num_draft_tokens each), written
        over the placeholders in `step.input_ids` and in the contexts' windows; returned back
        to back for the result. None when the draft failed (the placeholders are then
        verified as they are: the output is still exact)."""
        try:
            return self._propose(step, contexts, proposing)
        except Exception:
            logger.exception("the draft model failed; step %d verifies no proposals of it",
                             step.step_id)
            for ctx in contexts:
                self.seen.pop(ctx.request_id, None)
            return None

    def release(self, request_id: str) -> None:
        self.seen.pop(request_id, None)

    def _propose(self, step: StepBatch, contexts: list[TextContext],
                 proposing: np.ndarray) -> np.ndarray:
        k = step.num_draft_tokens.astype(np.int64) if step.num_draft_tokens is not None \
            else np.zeros(len(contexts), np.int64)
        q, s = step.query_lens.astype(np.int64), step.seq_lens.astype(np.int64)
        real_end = s - k  # (past each sequence's last real token)
        fed = np.zeros(len(contexts), dtype=bool)
        fed[proposing] = True
        # Prompt chunks, and a request's first step whatever it feeds (a one-token prompt, or
        # the token after a prefix-cache hit): what the draft sees of every request. (Not a
        # request that ended, fed in a step built ahead: its entry would outlive it.)
        prompts = ((q - k > 1) | np.array([ctx.request_id not in self.seen for ctx in contexts])) \
            & np.array([type(ctx) is TextContext and not ctx.is_done for ctx in contexts])
        rows = np.flatnonzero(fed | prompts)
        if not len(rows):
            return np.zeros(0, dtype=np.int32)
        starts = [min(self.seen.get(contexts[i].request_id, s[i] - q[i]), s[i] - q[i])
                  for i in rows.tolist()]
        tokens = [contexts[i].tokens[start:real_end[i]] for i, start in zip(rows.tolist(),
                                                                              starts)]
        lens = np.array([len(t) for t in tokens], dtype=np.int64)
        tables = step.block_tables[rows]
        # Proposal 1: the last row of each proposing sequence, after everything it had not seen.
        proposer_rows = np.flatnonzero(fed[rows])
        logits = self._forward(np.concatenate(tokens), real_end[rows], lens, tables,
                               (np.cumsum(lens) - 1)[proposer_rows])
        for i in rows.tolist():
            self.seen[contexts[i].request_id] = int(real_end[i])
        proposing_seqs = rows[proposer_rows]
        if not len(proposing_seqs):  # (prompt chunks only: their KV is all it wanted)
            return np.zeros(0, dtype=np.int32)
        drafts = np.zeros((len(proposing_seqs), int(k[proposing_seqs].max())), np.int64)
        drafts[:, 0] = self._greedy(logits)
        # Proposals 2..k: one token each, for the sequences that propose that many.
        for j in range(1, drafts.shape[1]):
            going = np.flatnonzero(k[proposing_seqs] > j)
            seqs = proposing_seqs[going]
            logits = self._forward(drafts[going, j - 1], real_end[seqs] + j,
                                   np.ones(len(seqs), np.int64), step.block_tables[seqs],
                                   np.arange(len(seqs)))
            drafts[going, j] = self._greedy(logits)
            for i in seqs.tolist():
                self.seen[contexts[i].request_id] = int(real_end[i]) + j
        return self._write(step, contexts, proposing_seqs, drafts, k)

    def _forward(self, ids: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                 tables: np.ndarray, logits_rows: np.ndarray) -> torch.Tensor:
        device = self.kv.cache.device
        kv = self.kv.inputs(seq_lens, query_lens, tables)
        inputs = PagedModelInputs(torch.from_numpy(ids.astype(np.int64)).to(device), kv,
                                  torch.empty(0), 0)
        inputs.narrow(logits_rows.astype(np.int64), len(logits_rows))
        return self.model.execute(inputs).next_token_logits

    def _greedy(self, logits: torch.Tensor) -> np.ndarray:
        return logits[:, :self.vocab_size].argmax(dim=-1).cpu().numpy()

    @staticmethod
    def _write(step: StepBatch, contexts: list[TextContext], seqs: np.ndarray,
               drafts: np.ndarray, k: np.ndarray) -> np.ndarray:
        """The proposals in the step's ids (a writable copy: the worker's arrays are views
        of the message) and in each context's window, where the placeholders were."""
        if not step.input_ids.flags.writeable:
            step.input_ids = step.input_ids.copy()
        ends = np.cumsum(step.query_lens.astype(np.int64))
        out = []
        for row, i in enumerate(seqs.tolist()):
            n = int(k[i])
            proposal = drafts[row, :n]
            step.input_ids[ends[i] - n:ends[i]] = proposal
            ctx = contexts[i]
            ctx.tokens[ctx.active_idx - n:ctx.active_idx] = proposal
            out.append(proposal)
        return np.concatenate(out).astype(np.int32)
