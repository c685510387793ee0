"""/metrics after real traffic: the names, labels and values a Prometheus user relies on.

On the session's shared tiny server (conftest.tiny_server): counters are read as what this
module's own requests added."""

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def sample(text, name, **labels):
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
            if all(got.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def sample_or_zero(text, name, **labels):
    """A counter before traffic: absent until its labels were first used."""
    try:
        return sample(text, name, **labels)
    except AssertionError:
        return 0.0


def test_metrics_follow_traffic(server):
    m = {"model_name": "tiny"}
    http = {"handler": "/v1/completions", "method": "POST"}
    added = [  # (name, labels, what this test's traffic adds)
        ("loom:generation_tokens_total", m, 5 + 6 + 7),
        ("loom:request_success_total", dict(m, finished_reason="length"), 3),
        ("loom:time_to_first_token_seconds_count", m, 3),
        ("loom:inter_token_latency_seconds_count", m, 4 + 5 + 6),
        ("loom:e2e_request_latency_seconds_count", m, 3),
        ("loom:request_generation_tokens_sum", m, 18),
        ("loom:request_prompt_tokens_count", m, 3),
        ("loom:request_queue_time_seconds_count", m, 3),
        ("loom:request_prefill_time_seconds_count", m, 3),
        ("loom:request_decode_time_seconds_count", m, 3),
        ("loom:http_requests_total", dict(http, status="200"), 3),
        ("loom:http_requests_total", dict(http, status="400"), 1),
    ]
    text = httpx.get(server.url + "/metrics").text
    before = [sample_or_zero(text, name, **labels) for name, labels, _ in added]
    iterations = sample_or_zero(text, "loom:iteration_tokens_total_count", **m)
    prompt_tokens = sample_or_zero(text, "loom:prompt_tokens_total", **m)
    for i in range(3):
        r = httpx.post(server.url + "/v1/completions", json={
            "prompt": "hello there", "max_tokens": 5 + i, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
    httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": -1})
    text = httpx.get(server.url + "/metrics").text
    for (name, labels, count), was in zip(added, before):
        assert sample(text, name, **labels) - was == count, (name, labels)
    assert sample(text, "loom:iteration_tokens_total_count", **m) - iterations >= 18
    assert sample(text, "loom:num_requests_running", **m) == 0
    assert sample(text, "loom:kv_cache_usage_perc", **m) == 0
    assert sample(text, "loom:prompt_tokens_total", **m) > prompt_tokens


def test_stop_string_counts_as_stop(server):
    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": "hello", "max_tokens": 30, "temperature": 0, "ignore_eos": True})
    text = r.json()["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("generated text has no usable stop string")
    before = sample_or_zero(httpx.get(server.url + "/metrics").text,
                            "loom:request_success_total", finished_reason="stop",
                            model_name="tiny")
    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": "hello", "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": [stop]})
    body = r.json()["choices"][0]
    assert body["finish_reason"] == "stop" and stop not in body["text"]
    assert body["text"] == text[: text.find(stop)]
    after = sample(httpx.get(server.url + "/metrics").text, "loom:request_success_total",
                   finished_reason="stop", model_name="tiny")
    assert after == before + 1


# The Gateway API Inference Extension's model-server protocol: the vLLM names endpoint pickers
# scrape, each the twin of a loom gauge.
VLLM_TWINS = {
    "vllm:num_requests_running": "loom:num_requests_running",
    "vllm:num_requests_waiting": "loom:num_requests_waiting",
    "vllm:kv_cache_usage_perc": "loom:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc": "loom:kv_cache_usage_perc",
}


def test_inference_gateway_metrics_track_loom_values(server):
    m = {"model_name": "tiny"}
    body = {"prompt": "hello", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        done = [pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=60)
                for _ in range(4)]
        deadline = time.monotonic() + 30
        while True:  # a scrape while the requests run
            busy = httpx.get(server.url + "/metrics").text
            if sample(busy, "loom:num_requests_running", **m) > 0:
                break
            assert time.monotonic() < deadline, "the requests never showed as running"
            time.sleep(0.01)
        assert all(f.result().status_code == 200 for f in done)
    idle = httpx.get(server.url + "/metrics").text
    for text in (busy, idle):
        for vllm, loom in VLLM_TWINS.items():
            assert sample(text, vllm, **m) == sample(text, loom, **m), (vllm, text)
    assert sample(busy, "vllm:num_requests_running", **m) > 0
    assert sample(busy, "vllm:kv_cache_usage_perc", **m) > 0
    assert sample(idle, "vllm:num_requests_running", **m) == 0
    assert sample(idle, "vllm:kv_cache_usage_perc", **m) == 0
    # No adapter running or waiting (tiny_server holds up to 3, tests/test_lora.py runs
    # them); the value is a fresh timestamp.
    lora = sample(idle, "vllm:lora_requests_info", max_lora="3", running_lora_adapters="",
                  waiting_lora_adapters="", **m)
    assert abs(lora - time.time()) < 60
    config = re.search(r'^vllm:cache_config_info\{([^}]*)\} 1\.0$', idle, re.M).group(1)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', config))
    assert labels["block_size"] == "16" and int(labels["num_gpu_blocks"]) > 0
    assert labels["model_name"] == "tiny"
