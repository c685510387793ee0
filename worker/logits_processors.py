"""Per-request adjustments of the logits before sampling: logit_bias, min_tokens, and the
repetition / frequency / presence penalties (OpenAI's and vLLM's meanings).

Each works on the rows that need it only, so a batch of plain requests pays nothing. A row
whose adjustment raises fails alone: it is recorded in `failed` and the other rows go on.
"""

from __future__ import annotations

import torch

from worker.sampler import RequestSamplingState, describe


def adjusts_logits(state: RequestSamplingState) -> bool:
    """Whether `process_logits` may change this request's rows at any step (False: they can
    be left out of it)."""
    return state.logit_bias_ids is not None or state.has_penalties or \
        (state.stop_ids is not None and state.params.min_new_tokens > 0)


def greedy_as_is(state: RequestSamplingState) -> bool:
    """Whether this request's next token is its raw logits' argmax: greedy, with nothing
    adjusting or constraining its row and no log probabilities asked."""
    return state.params.is_greedy and state.matcher is None and not state.logprobs \
        and not adjusts_logits(state)


def process_logits(logits: torch.Tensor, states: list[RequestSamplingState],
                   failed: dict[int, str] | None = None) -> torch.Tensor:
    """Adjust `logits` [B, V] (float32) in place for the requests that asked for it. A row
    that raises is added to `failed` (row -> error), or raises if `failed` is None."""
    for row, state in enumerate(states):
        try:
            if state.logit_bias_ids is not None:
                logits[row].index_add_(0, state.logit_bias_ids, state.logit_bias_values)
            if state.masked_until_min_tokens():
                logits[row, state.stop_ids] = float("-inf")
        except Exception as exc:
            _fail(failed, row, exc)
    penalised = [i for i, s in enumerate(states) if s.has_penalties]
    if penalised:
        _apply_penalties(logits, penalised, [states[i] for i in penalised], failed)
    return logits


def _apply_penalties(logits: torch.Tensor, rows: list[int], states: list[RequestSamplingState],
                     failed: dict[int, str] | None):
    for row, state in zip(rows, states):
        try:
            _penalise(logits[row], state)
        except Exception as exc:
            _fail(failed, row, exc)


def _penalise(values: torch.Tensor, state: RequestSamplingState) -> None:
    # Over the tokens seen only, not the vocabulary: a 157k-entry mask and three boolean
    # gathers a row each step cost ~1 ms where these cost microseconds.
    p = state.params
    output = torch.tensor(state.output_tokens, dtype=torch.long, device=values.device)
    if p.repetition_penalty != 1.0:
        # Tokens seen in the prompt or the output: divide positive logits, multiply negative
        # (a token seen twice is written twice with the same value).
        seen = output if state.prompt_tokens is None else \
            torch.cat([state.prompt_tokens.to(values.device), output])
        logits = values[seen]
        values[seen] = torch.where(logits > 0, logits / p.repetition_penalty,
                                   logits * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and len(output):
        if p.frequency_penalty:
            values.index_add_(0, output, torch.full(output.shape, -p.frequency_penalty,
                                                    dtype=values.dtype, device=values.device))
        if p.presence_penalty:
            values[output.unique()] -= p.presence_penalty


def _fail(failed: dict[int, str] | None, row: int, exc: Exception) -> None:
    if failed is None:
        raise exc
    failed.setdefault(row, describe(exc))
