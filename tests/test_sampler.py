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
        (SamplingParams(top_k=2**64 - 1, top_p=0.75, seed=0), {0, 1}),  # (past int64: no top-k)
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


def test_the_cpu_thresholds_keep_what_the_ranking_keeps():
    # On the CPU the filters are thresholds found without sorting the whole vocabulary (a
    # full sort of Orpheus' 157k logits took ~25 ms a row): the kept tokens and their
    # probabilities must be the ranking definition's, for peaked and flat rows alike.
    torch.manual_seed(5)
    vocab = 60_000
    scale = torch.tensor([[8.0], [4.0], [2.0], [1.0], [6.0], [3.0], [0.1], [0.1], [20.0],
                          [14.0]])
    logits = torch.randn(10, vocab) * scale
    params = [SamplingParams(top_k=0, top_p=0.9), SamplingParams(top_k=0, min_p=0.05),
              SamplingParams(top_k=40, top_p=0.95, temperature=0.7),
              SamplingParams(top_k=5000), SamplingParams(top_k=0, top_p=0.5, min_p=0.1),
              SamplingParams(top_k=0, top_p=0.8, temperature=1.3),
              SamplingParams(top_k=0, top_p=0.99),  # flat: top-p reaches most tokens
              SamplingParams(top_k=30_000, top_p=0.6, temperature=0.5),
              SamplingParams(top_k=0, top_p=0.9, min_p=0.02),
              SamplingParams(top_k=0, top_p=0.95, temperature=0.8)]
    # (Peaked rows are cut among the tokens near their best, the others ranked: both here.)
    near = [sampler._near_cut((row / p.temperature).numpy(), p) is not None
            for row, p in zip(logits, params)]
    assert any(near) and not all(near)
    scaled = logits / torch.tensor([[p.temperature] for p in params])
    kept, kept_ids = sampler.filter_by_threshold(scaled, params)
    fast = torch.zeros(logits.shape).scatter_add_(1, kept_ids, kept)
    fast = fast / fast.sum(-1, keepdim=True)
    sorted_logits, ids = scaled.sort(dim=-1, descending=True)
    ranked = sampler._filter_sorted(sorted_logits, params)
    definition = torch.zeros(logits.shape).scatter_(1, ids, ranked)
    assert torch.equal(fast > 0, definition > 0)
    assert int((fast[6] > 0).sum()) > vocab // 2
    definition = definition / definition.sum(-1, keepdim=True)
    assert torch.allclose(fast, definition, rtol=1e-4, atol=1e-9)
    # What the rejection rule reads is the same distribution, normalized.
    for i, p in enumerate(params):
        assert torch.allclose(sampler.probabilities(logits[i:i + 1], p)[0], definition[i],
                              rtol=1e-4, atol=1e-9)


def test_a_row_whose_best_tokens_hold_top_p_is_cut_near_them():
    # A peaked model's rows at a low temperature: a few tokens hundreds of logits above a
    # 157k vocabulary (Orpheus-shaped, as its speech rows). Top-p keeps only those tokens,
    # every far one dropped: found among the near tokens, without a pass of exponentials
    # over the vocabulary (whose underflows cost PyTorch's exp ~2-15 ms a row).
    torch.manual_seed(7)
    vocab = 156_938
    logits = torch.randn(3, vocab)
    logits[0, 11] = 196.0
    logits[1, [5, 900, 70_000]] = torch.tensor([150.0, 149.5, 120.0])
    logits[2, [3, 4]] = 30.0  # tied at the top
    params = [SamplingParams(top_k=0, top_p=0.8, temperature=0.6),
              SamplingParams(top_k=0, top_p=0.9, min_p=0.01),
              SamplingParams(top_k=0, top_p=0.95, temperature=0.5)]
    scaled = logits / torch.tensor([[p.temperature] for p in params])
    assert all(sampler._near_cut(row.numpy(), p) is not None for row, p in zip(scaled, params))
    kept, kept_ids = sampler.filter_by_threshold(scaled, params)
    fast = torch.zeros(logits.shape).scatter_add_(1, kept_ids, kept)
    sorted_logits, ids = scaled.sort(dim=-1, descending=True)
    definition = torch.zeros(logits.shape).scatter_(1, ids, sampler._filter_sorted(
        sorted_logits, params))
    assert torch.equal(fast > 0, definition > 0)
    assert [int(n) for n in (fast > 0).sum(-1)] == [1, 2, 2]
    assert torch.allclose(fast / fast.sum(-1, keepdim=True),
                          definition / definition.sum(-1, keepdim=True), rtol=1e-4, atol=1e-9)
