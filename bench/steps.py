"""Hand-built StepBatch messages, filled the way scheduler.Scheduler._build_step fills them.

Each sequence owns a contiguous run of KV blocks (there is no block manager here), and its
block table lists only the blocks its tokens so far occupy, padded with -1 to the widest
table of the step: the same shapes the scheduler sends, so the worker does the same work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipelines.sampling_params import SamplingParams
from serialization.messages import NewRequest, StepBatch

GREEDY = SamplingParams(temperature=0.0, top_k=1, ignore_eos=True)


@dataclass
class Sequence:
    request_id: str
    tokens: list[int]  # prompt, then every sampled token
    first_block: int
    computed: int = 0  # tokens whose K/V are already in the cache
    announced: bool = False  # the runner has its sampling state (NewRequest sent)
    generated: list[int] = field(default_factory=list)

    @property
    def pending(self) -> int:
        """Tokens not yet fed to the model (prompt remainder, or the last sampled token)."""
        return len(self.tokens) - self.computed


def make_sequences(prompts: list[list[int]], max_len: int, block_size: int,
                   tag: str = "seq") -> list[Sequence]:
    blocks_per_seq = -(-max_len // block_size)
    return [Sequence(f"{tag}-{i}", list(p), first_block=i * blocks_per_seq)
            for i, p in enumerate(prompts)]


def blocks_needed(num_seqs: int, max_len: int, block_size: int) -> int:
    return num_seqs * -(-max_len // block_size)


def build_step(step_id: int, chunks: list[tuple[Sequence, int]], block_size: int) -> StepBatch:
    """One step feeding `n` tokens of each (sequence, n); samples where a sequence's
    pending tokens run out, exactly as the scheduler decides `sample`."""
    count = len(chunks)
    query_lens = np.empty(count, dtype=np.int32)
    seq_lens = np.empty(count, dtype=np.int32)
    sample = np.empty(count, dtype=bool)
    ids = []
    new_requests = []
    for i, (seq, n) in enumerate(chunks):
        ids.extend(seq.tokens[seq.computed: seq.computed + n])
        query_lens[i] = n
        seq_lens[i] = seq.computed + n
        sample[i] = seq.computed + n == len(seq.tokens)
        if not seq.announced:  # (the prompt, as the scheduler sends it)
            new_requests.append(NewRequest(seq.request_id, GREEDY, prompt_len=len(seq.tokens),
                                           prompt_token_ids=np.asarray(seq.tokens)))
            seq.announced = True
    tables = _block_tables([seq for seq, _ in chunks], seq_lens, block_size)
    return StepBatch(
        step_id=step_id,
        request_ids=[seq.request_id for seq, _ in chunks],
        input_ids=np.asarray(ids, dtype=np.int32),
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=tables,
        sample=sample,
        new_requests=new_requests,
    )


class WorkerSteps:
    """Hand-built steps through a runner as the worker process runs them: its
    TextGenerationPipeline, which keeps a context per request (worker/process.py)."""

    def __init__(self, runner) -> None:
        from worker.pipeline import ScheduledSteps, TextGenerationPipeline

        self.pipeline = TextGenerationPipeline(runner, ScheduledSteps(runner.max_model_len))

    def run(self, batch: StepBatch) -> np.ndarray:
        """The step's sampled token ids; raises what the step raised."""
        from worker.process import answer_step

        result = answer_step(self.pipeline, None, batch, 0.0)
        if result.error is not None:
            raise RuntimeError(f"step {batch.step_id}: {result.error}")
        return result.sampled_token_ids


def _block_tables(seqs: list[Sequence], seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    used = -(-seq_lens.astype(np.int64) // block_size)
    tables = np.full((len(seqs), int(used.max(initial=0))), -1, dtype=np.int32)
    for i, seq in enumerate(seqs):
        tables[i, : used[i]] = np.arange(seq.first_block, seq.first_block + used[i])
    return tables


def apply_step(chunks: list[tuple[Sequence, int]], batch: StepBatch, sampled: np.ndarray) -> None:
    """Advance each sequence past the tokens it fed and append what was sampled for it."""
    for i, (seq, n) in enumerate(chunks):
        seq.computed += n
        if batch.sample[i]:
            token = int(sampled[i])
            seq.tokens.append(token)
            seq.generated.append(token)


def finish_step(step_id: int, seqs: list[Sequence]) -> StepBatch:
    """An empty step that only tells the runner to drop these requests' sampling state."""
    return StepBatch(
        step_id=step_id, request_ids=[], input_ids=np.zeros(0, np.int32),
        query_lens=np.zeros(0, np.int32), seq_lens=np.zeros(0, np.int32),
        block_tables=np.zeros((0, 0), np.int32), sample=np.zeros(0, bool),
        finished_request_ids=[s.request_id for s in seqs if s.announced],
    )


def prefill_chunks(seqs: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
    """The next prefill step under a token budget, oldest sequence first, the last one cut
    to what is left: the scheduler's chunked prefill when every request arrives at once."""
    chunks = []
    for seq in seqs:
        if budget <= 0:
            break
        # A sequence with one pending token has finished its prompt (it awaits a decode).
        if seq.pending > 0 and not seq.generated:
            n = min(seq.pending, budget)
            chunks.append((seq, n))
            budget -= n
    return chunks


def decode_chunks(seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
    return [(seq, 1) for seq in seqs]
