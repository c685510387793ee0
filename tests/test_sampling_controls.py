"""Generation controls through the HTTP API, each against an independent reference:
transformers' generate() or a plain loop over transformers' logits."""

import asyncio

import httpx
import pytest
import torch

from tests.helpers import hf_greedy
from tests.oracle_cache import cached_oracle

PROMPT = "Write a list of fruits: apple, banana,"


@pytest.fixture(scope="module")
def hf(smollm2_hf):
    return smollm2_hf


@pytest.fixture(scope="module")
def saved(smollm2_dir):
    """saved(what, inputs, compute): a reference's token ids, computed once per weights and
    inputs (tests/oracle_cache.py)."""
    return lambda what, inputs, compute: cached_oracle(f"smollm2-{what}", smollm2_dir,
                                                       [PROMPT, *inputs], compute)


@pytest.fixture(scope="module")
def server(shared_server, smollm2_dir):
    return shared_server(smollm2_dir)


def complete(server, **body):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "temperature": 0,
                                                         **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def reference_loop(model, tok, ids, steps, adjust):
    """Greedy decoding over transformers' logits with `adjust(logits, generated)` applied."""
    generated = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids + generated])).logits[0, -1].float()
            adjust(logits, generated)
            generated.append(int(logits.argmax()))
    return generated


def text_of(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def test_repetition_penalty_matches_generate(server, hf, saved):
    model, tok = hf
    ids = tok(PROMPT)["input_ids"]

    def generate():
        with torch.no_grad():
            return model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                                  repetition_penalty=1.5,
                                  pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()

    want = saved("repetition-penalty", [20, 1.5], generate)
    got = complete(server, max_tokens=20, repetition_penalty=1.5, ignore_eos=True)
    assert got["choices"][0]["text"] == text_of(tok, want)


@pytest.mark.parametrize("frequency,presence", [(1.2, 0.0), (0.0, 1.5), (0.6, 0.6), (-1.0, 0.0)])
def test_frequency_and_presence_penalties(server, hf, saved, frequency, presence):
    model, tok = hf
    ids = tok(PROMPT)["input_ids"]

    def adjust(logits, generated):
        for t in set(generated):
            logits[t] -= frequency * generated.count(t) + presence

    want = saved("penalties", [16, frequency, presence],
                 lambda: reference_loop(model, tok, ids, 16, adjust))
    got = complete(server, max_tokens=16, frequency_penalty=frequency, presence_penalty=presence,
                   ignore_eos=True)
    assert got["choices"][0]["text"] == text_of(tok, want)


def test_logit_bias(server, hf):
    model, tok = hf
    ids = tok(PROMPT)["input_ids"]
    plain = hf_greedy(model, tok, ids, 1)[0]
    banned = {str(plain): -100}
    forced_id = tok.encode(" kiwi", add_special_tokens=False)[0]
    got = complete(server, max_tokens=1, logit_bias=banned)["choices"][0]["text"]
    assert got != tok.decode([plain])
    got = complete(server, max_tokens=3, logit_bias={str(forced_id): 100})["choices"][0]["text"]
    assert got == tok.decode([forced_id] * 3)


def test_min_tokens_masks_eos(server, hf):
    model, tok = hf
    messages = [{"role": "user", "content": "Reply with just the word yes."}]
    body = {"messages": messages, "temperature": 0, "max_tokens": 80}
    short = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    n = short["usage"]["completion_tokens"]
    assert short["choices"][0]["finish_reason"] == "stop" and n < 60
    longer = httpx.post(server.url + "/v1/chat/completions",
                        json={**body, "min_tokens": n + 5}, timeout=60).json()
    assert longer["usage"]["completion_tokens"] >= n + 5


def test_stop_token_ids(server, hf, saved):
    model, tok = hf
    ids = tok(PROMPT)["input_ids"]
    greedy = saved("greedy", [12], lambda: hf_greedy(model, tok, ids, 12))
    stop_id = greedy[5]
    r = complete(server, max_tokens=12, stop_token_ids=[stop_id])
    choice = r["choices"][0]
    cut = greedy.index(stop_id)
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == text_of(tok, greedy[:cut])
    assert r["usage"]["completion_tokens"] == cut + 1


def test_stop_strings(server, hf):
    model, tok = hf
    full = complete(server, max_tokens=16)["choices"][0]["text"]
    stop = full[6:9]
    r = complete(server, max_tokens=16, stop=[stop, "zzzz"])["choices"][0]
    assert r["finish_reason"] == "stop" and r["text"] == full[: full.index(stop)]


def test_n_choices_are_independent_and_seeded(server):
    body = {"prompt": "My favourite animal is", "max_tokens": 10, "temperature": 1.0, "n": 4,
            "ignore_eos": True,
            "seed": 7}
    a = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    b = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    texts = [c["text"] for c in a["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2, 3]
    assert texts == [c["text"] for c in b["choices"]]
    assert len(set(texts)) > 1
    assert a["usage"]["completion_tokens"] == 40
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Name a colour."}], "n": 3, "max_tokens": 8,
        "temperature": 1.0, "seed": 3}, timeout=60).json()
    assert len(chat["choices"]) == 3


def test_seed_is_reproducible_inside_a_busy_batch(server):
    body = {"prompt": "The weather today is", "max_tokens": 16, "temperature": 0.9,
            "top_p": 0.95, "seed": 4242}
    alone = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()

    async def busy():
        async with httpx.AsyncClient(timeout=120) as client:
            noise = [client.post(server.url + "/v1/completions", json={
                "prompt": f"Story number {i}:", "max_tokens": 24, "temperature": 1.0})
                for i in range(6)]
            results = await asyncio.gather(client.post(server.url + "/v1/completions", json=body),
                                           *noise)
            return results[0].json()

    assert asyncio.run(busy())["choices"][0]["text"] == alone["choices"][0]["text"]


