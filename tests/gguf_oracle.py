"""Shared by the GGUF serving tests: greedy completions with their token ids and logprobs from
the HTTP API, and the teacher-forced agreement check against transformers on the same file
(tests/test_gguf_serving.py's docstring states the criterion and why)."""

import asyncio

import httpx
import torch


async def _complete(client, url, prompt_ids, max_tokens, timeout):
    r = await client.post(url + "/v1/completions", json={
        "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
        # a near tie broken the other way may lead to an end of text the oracle's branch
        # would not reach yet: every prompt is checked over all max_tokens positions
        "ignore_eos": True, "return_tokens_as_token_ids": True}, timeout=timeout)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    return ids, lp["token_logprobs"]


def generate(url, prompts_ids, concurrent, max_tokens, timeout=120.0):
    """[(generated ids, their logprobs)] per prompt, sent together or one after another."""
    async def go():
        async with httpx.AsyncClient() as client:
            calls = [_complete(client, url, p, max_tokens, timeout) for p in prompts_ids]
            if concurrent:
                return await asyncio.gather(*calls)
            return [await call for call in calls]

    return asyncio.run(go())


def oracle_logprobs(model, prompt_ids, generated):
    """The oracle's log probabilities at each generated position, fed Loom's tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + generated])).logits
    return logits[0, len(prompt_ids) - 1:-1].float().log_softmax(-1)


def check_against_oracle(oracle, prompt_ids, generated, logprobs, stats, tie_nats,
                         logprob_nats):
    """Every token the oracle's choice or within tie_nats of it, every reported logprob within
    logprob_nats of the oracle's; counts exact choices and the largest deviations in stats."""
    for j, token in enumerate(generated):
        best = float(oracle[j].max())
        mine = float(oracle[j, token])
        stats["gap"] = max(stats.get("gap", 0.0), best - mine)
        stats["logprob"] = max(stats.get("logprob", 0.0), abs(logprobs[j] - mine))
        assert mine >= best - tie_nats, (
            f"prompt of {len(prompt_ids)} tokens, position {j}: token {token} is "
            f"{best - mine:.3f} nats below the oracle's choice")
        assert abs(logprobs[j] - mine) <= logprob_nats, (
            f"prompt of {len(prompt_ids)} tokens, position {j}: logprob {logprobs[j]:.4f}, "
            f"oracle {mine:.4f}")
        stats["exact"] = stats.get("exact", 0) + int(token == int(oracle[j].argmax()))
        stats["total"] = stats.get("total", 0) + 1
