"""Greedy output through the HTTP API equals transformers' generate() on the same weights
(SmolLM2-135M-Instruct, float32): alone, concurrently, chunk-prefilled, and under preemption."""

import asyncio
import re

import httpx
import pytest

from tests.helpers import hf_greedy
from tests.oracle_cache import cached_oracle

PROMPTS = [
    "The capital of France is",
    "Here is a Python function that reverses a string:\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Q: What is 12 times 12?\nA:",
    "List of planets in the solar system: Mercury,",
    "My favourite recipe for pancakes starts with",
    "The French word for cat is",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def oracle(request, smollm2_dir):
    """{prompt: (text, completion tokens, finish reason)} of transformers' greedy generate."""
    def compute():
        model, tok = request.getfixturevalue("smollm2_hf")
        expected = {}
        for p in PROMPTS:
            ids = hf_greedy(model, tok, tok(p)["input_ids"], MAX_TOKENS)
            finish = "stop" if ids[-1] == tok.eos_token_id else "length"
            expected[p] = (tok.decode(ids, skip_special_tokens=True), len(ids), finish)
        return expected

    saved = cached_oracle("smollm2-greedy", smollm2_dir, [PROMPTS, MAX_TOKENS], compute)
    return {p: tuple(v) for p, v in saved.items()}


async def complete(client, url, prompt):
    r = await client.post(url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    c = body["choices"][0]
    return c["text"], body["usage"]["completion_tokens"], c["finish_reason"]


def complete_all(url, concurrent):
    """(text, completion tokens, finish reason) of each prompt, sent together or in turn."""
    async def go():
        async with httpx.AsyncClient() as client:
            if concurrent:
                return await asyncio.gather(*(complete(client, url, p) for p in PROMPTS))
            return [await complete(client, url, p) for p in PROMPTS]

    return asyncio.run(go())


def check_all(url, oracle, concurrent):
    check_results(complete_all(url, concurrent), oracle)


def check_results(results, oracle):
    for p, got in zip(PROMPTS, results):
        assert got == oracle[p], p


def sent_together_once(url):
    """(the prompts' results, the preemptions meanwhile) of one concurrent batch: on a server
    whose chunks are a few tokens and whose cache holds 8 blocks, the one batch is both
    chunk-prefilled and preempted, so its chunked prefill and preemption tests share it."""
    before = preemptions(url)
    results = complete_all(url, concurrent=True)
    return results, preemptions(url) - before


@pytest.fixture(scope="module")
def server(shared_server, smollm2_dir):
    return shared_server(smollm2_dir)


def test_alone(server, oracle):
    check_all(server.url, oracle, concurrent=False)
    assert "steps of up to 512 tokens" in server.log()  # (a CPU's default budget)


def test_concurrent_requests_share_batches(server, oracle):
    check_all(server.url, oracle, concurrent=True)


@pytest.fixture(scope="module")
def chunked_batch(chunked_server):
    return sent_together_once(chunked_server.url)


def test_chunked_prefill(chunked_batch, oracle):
    check_results(chunked_batch[0], oracle)


def test_preemption_under_a_small_kv_cache(chunked_server, chunked_batch, oracle):
    # 8 requests of ~10-token prompts + 24 new tokens need ~270 tokens of KV at once; the cache
    # holds 8 blocks x 16 = 128 tokens, so requests are preempted and recomputed.
    results, preempted = chunked_batch
    check_results(results, oracle)
    assert preempted > 0
    metrics = httpx.get(chunked_server.url + "/metrics").text
    usage = float(re.search(r"^loom:kv_cache_usage_perc\{.*\} (\S+)$", metrics, re.M).group(1))
    assert usage == 0.0


def preemptions(url: str) -> float:
    metrics = httpx.get(url + "/metrics").text
    return float(re.search(r"^loom:num_preemptions_total\{.*\} (\S+)$", metrics,
                           re.M).group(1))


def test_chat_answers_paris(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 40}, timeout=60)
    assert r.status_code == 200
    body = r.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] > 10


def sse_texts(url, path, body):
    deltas = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    import json

    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    for c in chunks:
        for choice in c["choices"]:
            deltas.append(choice.get("text") if "text" in choice else
                          choice["delta"].get("content") or "")
    return deltas, chunks


@pytest.mark.parametrize("content", [
    "Repeat exactly: 日本語のテキスト、中文字符、한국어 🚀🔥 ünïcödé",
    "Write three emojis and the Greek alphabet.",
])
def test_streamed_chat_equals_non_streamed(server, content):
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 48}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    text = whole["choices"][0]["message"]["content"]
    deltas, chunks = sse_texts(server.url, "/v1/chat/completions", body)
    assert "".join(deltas) == text
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas)


def test_streamed_completion_with_usage(server, oracle):
    prompt = PROMPTS[2]
    deltas, chunks = sse_texts(server.url, "/v1/completions", {
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "stream_options": {"include_usage": True}})
    assert "".join(deltas) == oracle[prompt][0]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == oracle[prompt][1]
