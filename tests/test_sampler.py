"""Batched sampling: greedy, filters, and per-request seeds independent of the batch."""

import torch

from pipelines import SamplingParams
from worker import sampler
from worker.sampler import RequestSamplingState, sample


def states(*params):
    return [RequestSamplingState.create(p) for p in params]


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(3, 100)
    out = sample(logits, states(SamplingParams(), SamplingParams(top_k=5, temperature=0.0),
                                SamplingParams(top_k=1, temperature=1.5)))
    assert out.tolist() == logits.argmax(-1).tolist()
    # PyTorch's index where rows tie, hold a NaN or only -inf (the CPU path takes numpy's)
    odd = torch.tensor([[1.0, 5.0, 5.0, 0.0], [1.0, float("nan"), 9.0, float("nan")],
                        [float("-inf")] * 4])
    assert sample(odd, states(*[SamplingParams()] * 3)).tolist() == odd.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    p = SamplingParams(top_k=0, temperature=1.0, seed=1234)
    alone = [sample(logits[2:3], states(p)).item() for _ in range(1)]
    s = states(SamplingParams(top_k=0, seed=1), SamplingParams(top_k=0, seed=2), p,
               SamplingParams())
    batched = sample(logits, s)
    assert batched[2].item() == alone[0]
    # A sequence of draws repeats too.
    a, b = states(p)[0], states(p)[0]
    seq_a = [sample(logits[:1], [a]).item() for _ in range(20)]
    seq_b = [sample(logits[:1], [b]).item() for _ in range(20)]
    assert seq_a == seq_b and len(set(seq_a)) > 1


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    for params, allowed in [
        (SamplingParams(top_k=2, seed=0), {0, 1}),
        (SamplingParams(top_k=0, top_p=0.75, seed=0), {0, 1}),
        (SamplingParams(top_k=0, min_p=0.5, seed=0), {0, 1}),
        (SamplingParams(top_k=0, top_p=0.5, seed=0), {0}),
    ]:
        st = states(params)[0]
        drawn = {sample(logits, [st]).item() for _ in range(300)}
        assert drawn == allowed, params


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().unsqueeze(0)
    st = states(SamplingParams(top_k=0, seed=7))[0]
    counts = torch.bincount(torch.tensor([sample(logits, [st]).item() for _ in range(3000)]),
                            minlength=3).float() / 3000
    assert torch.allclose(counts, probs, atol=0.04)


def test_masked_tokens_are_never_drawn():
    # A grammar's mask leaves -inf logits; no draw may land on one, whatever the rounding.
    torch.manual_seed(3)
    logits = torch.randn(8, 5000) * 4
    masked = torch.rand(8, 5000) < 0.97
    masked[:, -1] = True  # the last token (where a rounded-up target would land) is masked
    logits[masked] = float("-inf")
    sts = states(*[SamplingParams(top_k=0, temperature=1.0, seed=s) for s in range(8)])
    for _ in range(300):
        tokens = sample(logits, sts)
        assert not masked.gather(1, tokens.unsqueeze(1)).any()


def test_draws_skip_a_zero_probability_token_between_others():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    st = states(SamplingParams(top_k=0, seed=11))[0]
    draws = torch.tensor([sample(probs.log().unsqueeze(0), [st]).item() for _ in range(4000)])
    counts = torch.bincount(draws, minlength=4).float() / 4000
    assert counts[1] == 0
    assert torch.allclose(counts, probs, atol=0.03)


def test_a_large_vocabulary_is_filtered_as_a_full_ranking_would(monkeypatch):
    # Past a few thousand tokens the filters rank only the tokens near each row's best one
    # (a full sort of Orpheus' 157k vocabulary took ~25 ms a row); the kept tokens and their
    # probabilities must be the full ranking's, for peaked and flat rows alike.
    torch.manual_seed(5)
    vocab = 60_000
    logits = torch.randn(6, vocab) * torch.tensor([[8.0], [4.0], [2.0], [1.0], [6.0], [3.0]])
    params = [SamplingParams(top_k=0, top_p=0.9), SamplingParams(top_k=0, min_p=0.05),
              SamplingParams(top_k=40, top_p=0.95, temperature=0.7),
              SamplingParams(top_k=5000), SamplingParams(top_k=0, top_p=0.5, min_p=0.1),
              SamplingParams(top_k=0, top_p=0.8, temperature=1.3)]
    candidates = sampler._filter_candidates
    used = []
    monkeypatch.setattr(sampler, "_filter_candidates",
                        lambda *a: used.append(candidates(*a)) or used[-1])
    fast = torch.cat([sampler.probabilities(logits[i:i + 1], p) for i, p in enumerate(params)])
    batched, batched_ids = sampler._filtered_probs(logits, params)
    assert all(r is not None for r in used)  # (the candidates' path was taken every time)
    monkeypatch.setattr(sampler, "_filter_candidates", lambda *a: None)
    full = torch.cat([sampler.probabilities(logits[i:i + 1], p) for i, p in enumerate(params)])
    assert torch.equal(fast > 0, full > 0)
    assert torch.allclose(fast, full, rtol=1e-5, atol=1e-7)
    scattered = torch.zeros(logits.shape).scatter_(1, batched_ids, batched)
    assert torch.allclose(scattered / scattered.sum(-1, keepdim=True), full,
                          rtol=1e-5, atol=1e-7)
    # A flat row whose top-p reaches far past the near tokens is ranked in full.
    used.clear()
    monkeypatch.setattr(sampler, "_filter_candidates",
                        lambda *a: used.append(candidates(*a)) or used[-1])
    flat = sampler.probabilities(torch.randn(1, vocab) * 0.1, SamplingParams(top_k=0, top_p=0.99))
    assert used == [None] and int((flat > 0).sum()) > vocab // 2
