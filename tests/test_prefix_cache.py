"""Prefix caching: requests sharing a 1,024-token prefix reuse its KV blocks, and greedy output
stays what transformers produces for the full prompt. On the session's shared SmolLM2 server:
its counters are read as what these requests added."""

import re

import httpx
from transformers import AutoTokenizer

from tests.helpers import hf_greedy
from tests.oracle_cache import cached_oracle


def counter(url, name):
    text = httpx.get(url + "/metrics").text
    return float(re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))


def test_shared_prefix_is_reused_and_output_unchanged(request, smollm2_dir, shared_server):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    sentences = [f"Fact {i}: the number {i * 7} is {'even' if i % 2 == 0 else 'odd'}. "
                 for i in range(200)]
    prefix_ids = tok("".join(sentences))["input_ids"][:1024]
    suffixes = [tok(" Question: what is fact 3 about? Answer:", add_special_tokens=False)["input_ids"],
                tok(" Summarise the facts in one line:", add_special_tokens=False)["input_ids"]]
    prompts = [prefix_ids + suffix for suffix in suffixes]

    def oracle():
        model, _ = request.getfixturevalue("smollm2_hf")
        return [hf_greedy(model, tok, ids, 12) for ids in prompts]

    wants = cached_oracle("smollm2-prefix-greedy", smollm2_dir, [prompts, 12], oracle)
    srv = shared_server(smollm2_dir)
    before = counter(srv.url, "loom:prefix_cache_hits_total")
    hits = []
    for ids, want in zip(prompts, wants):
        r = httpx.post(srv.url + "/v1/completions", json={
            "prompt": ids, "max_tokens": 12, "temperature": 0}, timeout=120).json()
        assert r["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
        hits.append(counter(srv.url, "loom:prefix_cache_hits_total") - before)
    # The second request found (at least) the 64 full blocks of the shared prefix.
    assert hits[0] == 0 and hits[1] >= 1024
