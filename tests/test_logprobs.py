"""Log probabilities through the HTTP API against log_softmax of transformers' logits."""

import httpx
import pytest
import torch

TOL = 1e-4


@pytest.fixture(scope="module")
def hf(smollm2_hf):
    return smollm2_hf


@pytest.fixture(scope="module", params=["whole", "chunked"])
def server(request, shared_server, smollm2_dir):
    if request.param == "whole":
        yield shared_server(smollm2_dir)
        return
    # "chunked": a 6-token budget splits every prompt across steps, and echo logprobs must
    # still come out complete and in order (conftest's chunked_server).
    yield request.getfixturevalue("chunked_server")


def hf_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_completion_logprobs_match_oracle(server, hf):
    model, tok = hf
    prompt = "The capital of France is"
    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 5}, timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    ids = tok(prompt)["input_ids"]
    generated = tok(prompt + r["choices"][0]["text"])["input_ids"][len(ids):]
    ref = hf_logprobs(model, ids + generated)
    assert len(lp["token_logprobs"]) == 6
    for k, token_id in enumerate(generated[:6]):
        row = ref[len(ids) - 1 + k]
        assert abs(lp["token_logprobs"][k] - row[token_id].item()) < TOL
        top = row.topk(5)
        want = {tok.decode([int(t)]): v.item() for t, v in zip(top.indices, top.values)}
        got = lp["top_logprobs"][k]
        assert set(got) == set(want)
        assert all(abs(got[t] - want[t]) < TOL for t in want)
        assert lp["tokens"][k] == tok.decode([token_id])


def test_echo_scores_the_prompt_with_max_tokens_zero(server, hf):
    model, tok = hf
    text = "Paris is the capital and largest city of France, with an estimated population"
    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = tok(text)["input_ids"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == len(ids)
    ref = hf_logprobs(model, ids)
    for pos in range(1, len(ids)):
        assert abs(lp["token_logprobs"][pos] - ref[pos - 1, ids[pos]].item()) < TOL
    assert r.json()["usage"]["completion_tokens"] == 0


def test_echo_with_generation(server, hf):
    model, tok = hf
    prompt = "One, two, three,"
    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 0},
        timeout=60).json()
    choice = r["choices"][0]
    ids = tok(prompt)["input_ids"]
    assert choice["text"].startswith(prompt)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 4
    assert all(t == {} for t in lp["top_logprobs"][1:])  # logprobs=0: no alternatives
    ref = hf_logprobs(model, ids)
    assert abs(lp["token_logprobs"][1] - ref[0, ids[1]].item()) < TOL


@pytest.mark.parametrize("length", [7, 13])
def test_echo_when_the_last_prompt_chunk_is_one_token(server, hf, length):
    """7 and 13 tokens under the chunked server's 6-token budget: the last chunk feeds one
    token, and only the row carried from the chunk before scores it."""
    model, tok = hf
    ids = tok("Paris is the capital and largest city of France, with an estimated population "
              "of two million")["input_ids"][:length]
    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1},
        timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == length + 3
    ref = hf_logprobs(model, ids)
    for pos in range(1, length):
        assert abs(lp["token_logprobs"][pos] - ref[pos - 1, ids[pos]].item()) < TOL, pos
    # The first generated token: the greedy choice after the whole prompt.
    assert abs(lp["token_logprobs"][length] - ref[-1].max().item()) < TOL


def test_chat_logprobs(server, hf):
    model, tok = hf
    messages = [{"role": "user", "content": "Say hello."}]
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True,
        "top_logprobs": 3}, timeout=60).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    ref = hf_logprobs(model, ids)[-1]
    first = content[0]
    assert abs(first["logprob"] - ref.max().item()) < TOL
    assert len(first["top_logprobs"]) == 3
    assert first["top_logprobs"][0]["token"] == first["token"]
    assert bytes(first["bytes"]).decode() == first["token"]


def test_streamed_logprobs_equal_non_streamed(server):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "logprobs": 2}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    lp = whole["choices"][0]["logprobs"]
    streamed = []
    import json

    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["logprobs"]:
                    streamed += chunk["choices"][0]["logprobs"]["token_logprobs"]
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-6)
