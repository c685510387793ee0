"""Prefix caching: requests sharing a 1,024-token prefix reuse its KV blocks, and greedy output
stays what transformers produces for the full prompt."""

import re

import httpx

from tests.helpers import hf_greedy, start_server


def counter(url, name):
    text = httpx.get(url + "/metrics").text
    return float(re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))


def test_shared_prefix_is_reused_and_output_unchanged(smollm2_dir, smollm2_hf):
    model, tok = smollm2_hf
    sentences = [f"Fact {i}: the number {i * 7} is {'even' if i % 2 == 0 else 'odd'}. "
                 for i in range(200)]
    prefix_ids = tok("".join(sentences))["input_ids"][:1024]
    suffixes = [tok(" Question: what is fact 3 about? Answer:", add_special_tokens=False)["input_ids"],
                tok(" Summarise the facts in one line:", add_special_tokens=False)["input_ids"]]
    srv = start_server(smollm2_dir, "--max-model-len", "2048")
    try:
        hits = []
        for suffix in suffixes:
            ids = prefix_ids + suffix
            r = httpx.post(srv.url + "/v1/completions", json={
                "prompt": ids, "max_tokens": 12, "temperature": 0}, timeout=120).json()
            want = hf_greedy(model, tok, ids, 12)
            assert r["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
            hits.append(counter(srv.url, "loom:prefix_cache_hits_total"))
        # The second request found (at least) the 64 full blocks of the shared prefix.
        assert hits[0] == 0 and hits[1] >= 1024
    finally:
        srv.stop()
