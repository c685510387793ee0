"""Per-request adjustments of the logits before sampling: logit_bias, min_tokens, and the
repetition / frequency / presence penalties (OpenAI's and vLLM's meanings).

Each works on the rows that need it only, so a batch of plain requests pays nothing.
"""

from __future__ import annotations

import torch

from worker.sampler import RequestSamplingState


def process_logits(logits: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
    """Adjust `logits` [B, V] (float32) in place for the requests that asked for it."""
    for row, state in enumerate(states):
        if state.logit_bias_ids is not None:
            logits[row].index_add_(0, state.logit_bias_ids, state.logit_bias_values)
        if state.masked_until_min_tokens():
            logits[row, state.stop_ids] = float("-inf")
    penalised = [i for i, s in enumerate(states) if s.has_penalties]
    if penalised:
        _apply_penalties(logits, penalised, [states[i] for i in penalised])
    return logits


def _apply_penalties(logits: torch.Tensor, rows: list[int], states: list[RequestSamplingState]):
    vocab = logits.shape[-1]
    for row, state in zip(rows, states):
        p = state.params
        output = torch.tensor(state.output_tokens, dtype=torch.long)
        values = logits[row]
        if p.repetition_penalty != 1.0:
            # Tokens seen in the prompt or the output: divide positive logits, multiply negative.
            seen = torch.zeros(vocab, dtype=torch.bool)
            if state.prompt_tokens is not None:
                seen[state.prompt_tokens] = True
            seen[output] = True
            values[seen] = torch.where(values[seen] > 0, values[seen] / p.repetition_penalty,
                                       values[seen] * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and len(output):
            counts = torch.bincount(output, minlength=vocab).to(values.dtype)
            values -= p.frequency_penalty * counts
            values -= p.presence_penalty * (counts > 0).to(values.dtype)
