"""Log probabilities of sampled and prompt tokens, from the model's raw logits.

Values are `log_softmax` of the logits before any sampling adjustment (temperature,
penalties, bias), as vLLM and OpenAI report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipelines.response import LogProbabilities
from serialization.messages import PromptLogprobs, TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> TokenLogprobs:
    """`logits` [n, V] float32; `token_ids` [n]; the top `top_n` alternatives per row."""
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs_of(logprobs, token_ids, top_n)


def logprobs_of(logprobs: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> TokenLogprobs:
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)
    if top_n > 0:
        top = logprobs.topk(top_n, dim=-1)
        top_ids, top_values = top.indices.to(torch.int32), top.values
    else:
        top_ids = torch.zeros((len(token_ids), 0), dtype=torch.int32)
        top_values = torch.zeros((len(token_ids), 0))
    return TokenLogprobs(chosen.numpy().astype(np.float32), top_ids.numpy(),
                         top_values.numpy().astype(np.float32))


def pack_logprobs(entries: list[LogProbabilities], width: int) -> TokenLogprobs:
    """Sampled tokens' log probabilities (each entry's last token: the sampled one) in the
    wire's packed arrays, `width` likeliest alternatives per row."""
    chosen = np.array([lp.token_log_probabilities[-1] for lp in entries], np.float32)
    ids = np.zeros((len(entries), width), np.int32)
    values = np.zeros((len(entries), width), np.float32)
    for row, lp in enumerate(entries):
        top = sorted(lp.top_log_probabilities[-1].items(), key=lambda kv: -kv[1])[:width]
        if len(top) < width:
            raise ValueError(f"{len(top)} top log probabilities where {width} were asked")
        ids[row], values[row] = zip(*top) if width else ((), ())
    return TokenLogprobs(chosen, ids, values)


@dataclass
class EchoPlan:
    """Which rows of a prefill chunk give prompt-token log probabilities (echo).

    The row at position p predicts the token at p + 1. In a chunk covering positions [a, b),
    rows p in [first, min(b, prompt_len - 1)) are wanted. The row at b - 1 predicts a token that
    only arrives with the next chunk, so its log-softmax is carried until then.
    """

    seq: int
    rows: np.ndarray  # rows of the step's flat token array
    targets: np.ndarray  # the token each row predicts (-1: in the next chunk)
    start: int  # prompt position of the first target
    carry_target: int  # the token the carried row predicts, or -1 if no carry applies


def plan_echo(step, states) -> list[EchoPlan]:
    plans = []
    if not any(st.echo_logprobs for st in states):  # (every step asks: most echo nothing)
        return plans
    first_rows = np.cumsum(step.query_lens.astype(np.int64)) - step.query_lens
    for i, st in enumerate(states):
        if not st.echo_logprobs or st.echo_next >= st.prompt_len:
            continue
        q = int(step.query_lens[i])
        a = int(step.seq_lens[i]) - q
        b = a + q
        carry_target = -1
        if st.echo_carry is not None:
            if a == st.echo_next:  # the carried row predicts this chunk's first token
                carry_target = int(step.input_ids[first_rows[i]])
            else:  # recomputed from scratch (preemption): the row comes again
                st.echo_carry = None
        first = max(a, st.echo_next - 1 + (carry_target >= 0))
        last = min(b, st.prompt_len - 1)
        positions = np.arange(first, max(first, last))
        targets = np.full(len(positions), -1, dtype=np.int64)
        known = positions + 1 < b
        targets[known] = step.input_ids[first_rows[i] + positions[known] + 1 - a]
        if len(positions) or carry_target >= 0:
            plans.append(EchoPlan(i, first_rows[i] + positions - a, targets, first + 1,
                                  carry_target))
    return plans


def resolve_echo(plans: list[EchoPlan], logits: torch.Tensor, states) -> list[PromptLogprobs]:
    """Prompt log probabilities that this step's logits complete, in prompt order."""
    results = []
    offset = 0
    for plan in plans:
        st = states[plan.seq]
        n = len(plan.rows)
        logprobs = torch.log_softmax(logits[offset : offset + n], dim=-1)
        offset += n
        if plan.carry_target >= 0:
            lp = logprobs_of(st.echo_carry.unsqueeze(0), torch.tensor([plan.carry_target]),
                             st.logprobs)
            results.append(PromptLogprobs(plan.seq, st.echo_next, lp))
            st.echo_next += 1
            st.echo_carry = None
        known = int((plan.targets >= 0).sum())
        if known:
            lp = logprobs_of(logprobs[:known], torch.from_numpy(plan.targets[:known]), st.logprobs)
            results.append(PromptLogprobs(plan.seq, plan.start, lp))
            st.echo_next = plan.start + known
        if known < n:
            st.echo_carry = logprobs[n - 1].clone()
    return results
