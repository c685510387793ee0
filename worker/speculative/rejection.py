"""The rejection rule of speculative sampling (Leviathan et al. 2023; vLLM's rejection sampler):
the verified tokens of one request, drawn so that the output has exactly the target model's
distribution whatever the proposals were.

Draft token i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
the token is drawn instead from the residual normalize(max(p_i - q_i, 0)); when all k are
accepted, a bonus token is drawn from p_k. Deterministic proposers (n-gram, suffix) have a
one-hot q: a draft token is accepted with probability p_i(d_i), the residual is p_i without d_i.
Greedy requests degenerate to argmax matching.

`p` is the target's distribution after all of the request's logits processing (temperature,
top-k/p, min-p, penalties, bias, grammar mask) at each verified position, and `q` the draft
model's after the same processing.
"""

from __future__ import annotations

import torch

from worker.sampler import argmax_rows


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor | None = None, *,
                     generator: torch.Generator | None = None,
                     greedy: bool = False) -> torch.Tensor:
    """The accepted draft tokens followed by the correction or bonus token: 1 to k+1 tokens.

    target_probs: [k+1, V], the target's distribution at the k proposed positions and the one
    after them; draft_tokens: [k]; draft_probs: [k, V], or None for a deterministic proposer.
    Greedy: the target's argmax at each position, as long as it matches the draft (target_probs
    may then be logits). The tensors may be on any device; `generator` is the request's CPU
    generator, as the sampler's."""
    k = draft_tokens.numel()
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows for {k} draft tokens")
    drafts = draft_tokens.tolist()
    if greedy:
        best = argmax_rows(target_probs).tolist()  # (the one-token step's argmax)
        accepted = leading_matches(best, drafts)
        return torch.tensor(best[:accepted + 1], dtype=torch.long)
    # (A few tensor operations, then plain floats: this runs per request per step.)
    index = draft_tokens.view(k, 1).to(target_probs.device)
    p = target_probs[:k].gather(1, index).view(k).tolist()
    q = [1.0] * k if draft_probs is None else draft_probs.gather(1, index).view(k).tolist()
    u = torch.rand(k, generator=generator, dtype=torch.float64).tolist()
    # u < p/q without dividing: P(accept) = min(1, p/q), and p = 0 is never accepted.
    accepted = leading_matches([ui * qi < pi for ui, qi, pi in zip(u, q, p)], [True] * k)
    if accepted == k:
        weights = target_probs[k]
    else:
        weights = residual_distribution(target_probs[accepted], draft_tokens[accepted],
                                        None if draft_probs is None
                                        else draft_probs[accepted])
    last = sample(weights, generator)
    return torch.tensor(drafts[:accepted] + [last], dtype=torch.long)


def residual_distribution(p: torch.Tensor, draft_token: torch.Tensor,
                          q: torch.Tensor | None) -> torch.Tensor:
    """max(p - q, 0), unnormalized: what a rejected position is drawn from. A one-hot q (q is
    None) leaves p with the draft token removed."""
    if q is None:
        residual = p.clone()
        residual[draft_token] = 0
    else:
        residual = (p - q).clamp_min(0)
    if not bool(residual.sum() > 0):
        # (p == q: a rejection had probability 0; only rounding gets here.)
        return p
    return residual


def sample(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from unnormalized weights: inverse CDF with one uniform draw, as the sampler
    does (torch.multinomial is many times slower over a vocabulary)."""
    cdf = weights.cumsum(0, dtype=torch.float64)
    u = float(torch.rand((), generator=generator, dtype=torch.float64)) * float(cdf[-1])
    where = torch.tensor([u], dtype=torch.float64, device=weights.device)
    token = min(int(torch.searchsorted(cdf, where, right=True)), weights.numel() - 1)
    if not weights[token] > 0:  # (rounding must never pick a token without mass)
        token = int(weights.argmax())
    return token


def leading_matches(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
