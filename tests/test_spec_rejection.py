"""The rejection rule of speculative sampling (worker/speculative/rejection.py): whatever the
proposals, the tokens it returns have the target model's distribution; greedy requests get the
target's argmax."""

import numpy as np
import torch

from pipelines import SamplingParams
from worker.sampler import probabilities
from worker.speculative.rejection import rejection_sample, residual_distribution

# Chi-square critical value at significance 0.001 for 4 degrees of freedom (5 tokens): a
# correct sampler exceeds it once in a thousand seeds; the seeds below are fixed.
CHI2_4DF_0_001 = 18.467
DRAWS = 6_000

P = torch.tensor([0.1, 0.35, 0.05, 0.3, 0.2])  # the target, at every position
Q = torch.tensor([0.4, 0.1, 0.3, 0.1, 0.1])  # a draft model's, far from it


def chi_square(counts: np.ndarray, probs: torch.Tensor) -> float:
    expected = probs.double().numpy() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def first_tokens(k: int, draft_probs: torch.Tensor | None, draft_tokens: np.ndarray,
                 seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Counts of the first and of the second returned token (where there is one) over the
    draws, and the mean accepted count."""
    generator = torch.Generator().manual_seed(seed)
    target = P.expand(k + 1, -1)
    q = None if draft_probs is None else draft_probs.expand(k, -1)
    first, second, accepted = np.zeros(len(P)), np.zeros(len(P)), 0
    for draft in draft_tokens:
        out = rejection_sample(target, torch.from_numpy(draft), q, generator=generator)
        first[int(out[0])] += 1
        if len(out) > 1:
            second[int(out[1])] += 1
        accepted += len(out) - 1
    return first, second, accepted / len(draft_tokens)


def test_sampled_tokens_follow_the_target_distribution_whatever_the_draft():
    rng = np.random.default_rng(0)
    # A draft model: its tokens drawn from Q, its probabilities given.
    drafts = rng.choice(len(Q), size=(DRAWS, 2), p=Q.numpy())
    first, second, accepted = first_tokens(2, Q, drafts, seed=1)
    assert chi_square(first, P) < CHI2_4DF_0_001, first
    # (The token after an accepted one is the target's too: p at every position here.)
    assert chi_square(second, P) < CHI2_4DF_0_001, second
    assert 0.5 < accepted < 1.0  # (sum of min(p, q) = 0.45 per position: 0.45 + 0.45**2)
    # A deterministic proposer (q one-hot): tokens from anywhere, always the same one here.
    drafts = np.full((DRAWS, 3), 3)
    first, second, accepted = first_tokens(3, None, drafts, seed=2)
    assert chi_square(first, P) < CHI2_4DF_0_001, first
    assert chi_square(second, P) < CHI2_4DF_0_001, second
    assert 0.3 < accepted < 0.5  # (0.3 + 0.09 + 0.027)
    # The test can fail: the draft's distribution is not the target's.
    assert chi_square(np.bincount(rng.choice(len(Q), DRAWS, p=Q.numpy()), minlength=5),
                      P) > CHI2_4DF_0_001


def test_a_draft_that_is_always_wrong_yields_exactly_the_target():
    target = torch.tensor([0.0, 0.35, 0.05, 0.4, 0.2])  # token 0: never right
    assert torch.equal(residual_distribution(target, torch.tensor(0), None), target)
    one_hot = torch.tensor([1.0, 0, 0, 0, 0])
    assert torch.equal(residual_distribution(target, torch.tensor(0), one_hot), target)
    generator = torch.Generator().manual_seed(3)
    counts = np.zeros(5)
    for _ in range(DRAWS):
        out = rejection_sample(target.expand(3, -1), torch.tensor([0, 0]), None,
                               generator=generator)
        assert len(out) == 1  # (nothing accepted, one token drawn)
        counts[int(out[0])] += 1
    assert counts[0] == 0
    nonzero = target > 0
    chi2 = chi_square(counts[nonzero.numpy()], target[nonzero])
    assert chi2 < 16.266  # (3 degrees of freedom, 0.001)


def test_all_accepted_adds_a_bonus_token_from_the_last_position():
    target = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.5, 0.0, 0.5]])
    generator = torch.Generator().manual_seed(4)
    bonus = set()
    for _ in range(200):
        out = rejection_sample(target, torch.tensor([1, 2]), generator=generator).tolist()
        assert out[:2] == [1, 2] and len(out) == 3
        bonus.add(out[2])
    assert bonus == {0, 2}


def test_greedy_is_argmax_matching():
    logits = torch.tensor([[0.1, 2.0, 0.3], [1.0, 0.0, 0.5], [0.0, 0.2, 3.0], [4.0, 0, 0]])
    assert rejection_sample(logits, torch.tensor([1, 0, 2]), greedy=True).tolist() == [1, 0, 2, 0]
    assert rejection_sample(logits, torch.tensor([1, 2, 2]), greedy=True).tolist() == [1, 0]
    assert rejection_sample(logits, torch.tensor([0, 0, 2]), greedy=True).tolist() == [1]
    assert rejection_sample(logits[:1], torch.tensor([], dtype=torch.long),
                            greedy=True).tolist() == [1]


def test_the_same_seed_gives_the_same_tokens():
    target = torch.softmax(torch.randn(5, 50, generator=torch.Generator().manual_seed(5)), -1)
    draft = torch.tensor([3, 7, 7, 1])
    runs = [[rejection_sample(target, draft, generator=generator).tolist()
             for _ in range(50)]
            for generator in (torch.Generator().manual_seed(6), torch.Generator().manual_seed(6))]
    assert runs[0] == runs[1]


def test_a_filtered_target_keeps_its_distribution():
    # The target samples with top-p: the rejection rule must weigh a proposal by its
    # probability among the kept tokens (what `sample` draws from), not by its unfiltered one.
    logits = torch.tensor([[0.4, 0.25, 0.2, 0.1, 0.05]]).log().expand(3, -1)
    params = SamplingParams(top_k=0, top_p=0.8, seed=0)
    target = probabilities(logits, params)
    kept = torch.tensor([0.4, 0.25, 0.2, 0.0, 0.0]) / 0.85
    assert torch.allclose(target[0], kept)
    generator = torch.Generator().manual_seed(4)
    counts = np.zeros(5)
    for _ in range(DRAWS):
        out = rejection_sample(target, torch.tensor([0, 1]), None, generator=generator)
        counts[int(out[0])] += 1
    assert counts[3:].sum() == 0
    assert chi_square(counts[:3], kept[:3]) < 13.816  # (2 degrees of freedom, 0.001)
