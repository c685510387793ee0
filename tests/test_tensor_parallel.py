"""One model split over two worker processes (`--tensor-parallel-size 2`, gloo on the CPU):
greedy output equals transformers' generate() on the same weights, token for token, alone,
batched, chunk-prefilled and under preemption; a killed rank is handled like a killed worker;
what cannot be split is refused with one line."""

import asyncio
import dataclasses
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelines.checkpoint.model_config import load_model_config
from tests.helpers import ROOT, hf_greedy, make_tiny_checkpoint, start_server, wait_gone
from tests.test_operations import stream_until_end
from tests.test_server_oracle import (  # noqa: F401 (oracle: a fixture)
    PROMPTS,
    check_results,
    oracle,
    sent_together_once,
)
from tests.tp_child import sum_through_shared_memory
from worker.tensor_parallel import (
    ShardPlan,
    even_share,
    shard_hf_weights,
)

TP2 = ("--tensor-parallel-size", "2")


# ---- the split itself ---------------------------------------------------------------------
def test_even_share_covers_the_range_once_longest_first():
    for n in (1, 3, 9, 1536, 1537):
        for parts in range(1, min(n, 5) + 1):
            shares = [even_share(n, parts, i) for i in range(parts)]
            assert [i for s in shares for i in s] == list(range(n))
            lengths = [len(s) for s in shares]
            assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)


def test_smollm2_splits_by_key_value_group(smollm2_dir):
    config = load_model_config(smollm2_dir)  # 9 query heads in 3 groups, 1536 MLP columns
    plans = [ShardPlan.for_rank(config, r, 2) for r in range(2)]
    assert [p.kv_heads for p in plans] == [range(0, 2), range(2, 3)]
    assert [p.heads for p in plans] == [range(0, 6), range(6, 9)]
    assert [p.intermediate for p in plans] == [range(0, 768), range(768, 1536)]
    shard = plans[1].config(config)
    assert (shard.num_attention_heads, shard.num_key_value_heads, shard.head_dim) == (3, 1, 64)
    with pytest.raises(ValueError, match="between 1 and the model's 3 key/value heads"):
        ShardPlan.for_rank(config, 0, 4)


def test_row_parallel_parts_sum_to_the_whole_layer(smollm2_dir):
    """The shards of a layer, each applied to its own heads' (columns') inputs, add up to the
    unsplit layer: the all-reduce's sum is the model's output (with Qwen2's biases)."""
    config = load_model_config(smollm2_dir)
    torch.manual_seed(0)
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    p = "model.layers.0."
    names = {"self_attn.q_proj": (9 * d, h), "self_attn.k_proj": (3 * d, h),
             "self_attn.v_proj": (3 * d, h), "self_attn.o_proj": (h, 9 * d),
             "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    weights = {f"{p}{n}.weight": torch.randn(shape) for n, shape in names.items()}
    weights[f"{p}self_attn.q_proj.bias"] = torch.randn(9 * d)
    weights[f"{p}self_attn.o_proj.bias"] = torch.randn(h)
    weights["model.norm.weight"] = torch.randn(h)
    x = torch.randn(5, h)

    def layer(w):  # q projection, then o_proj of it; gate/up then down_proj
        q = x @ w[f"{p}self_attn.q_proj.weight"].T + w[f"{p}self_attn.q_proj.bias"]
        attn = q @ w[f"{p}self_attn.o_proj.weight"].T + w[f"{p}self_attn.o_proj.bias"]
        mlp = (x @ w[f"{p}mlp.gate_proj.weight"].T) * (x @ w[f"{p}mlp.up_proj.weight"].T)
        return attn, mlp @ w[f"{p}mlp.down_proj.weight"].T

    shards = [shard_hf_weights(weights, config, ShardPlan.for_rank(config, r, 2))
              for r in range(2)]
    parts = [layer(w) for w in shards]
    whole = layer(weights)
    for k in range(2):  # (float32 sums of ~1e4-sized terms: the tolerance scales with them)
        torch.testing.assert_close(parts[0][k] + parts[1][k], whole[k], rtol=1e-4,
                                   atol=1e-6 * float(whole[k].abs().max()))
    assert torch.equal(shards[1]["model.norm.weight"], weights["model.norm.weight"])
    assert shards[1][f"{p}self_attn.k_proj.weight"].shape == (d, h)  # its one kv head


def test_shared_memory_all_reduce_sums_every_call(tmp_path):
    """Two processes, 201 all-reduces of varied sizes back to back (the two phases of slots
    reused many times): each result is the sum of both ranks' inputs, the same on both."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=sum_through_shared_memory,
                         args=(r, str(tmp_path / "rdv"), results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert len(got[0]) == len(got[1]) == 201
    for (a, sum_a), (b, sum_b) in zip(got[0], got[1]):
        assert np.array_equal(sum_a, sum_b)
        np.testing.assert_allclose(sum_a, a + b, rtol=1e-6, atol=1e-6)


def test_gguf_blocks_split_by_rows_and_whole_blocks_of_columns():
    """The default file's Q4_1 layer split for two ranks: each part, dequantized, is the
    matching rows or columns of the whole; a cut inside a block is refused by name."""
    from pipelines.checkpoint.default_model import find_gguf
    from pipelines.checkpoint.gguf_file import GGUFTensor, dequantize, open_gguf

    gguf = open_gguf(find_gguf())
    config = gguf.config
    layer = {n: t for n, t in gguf.tensors.items() if n.startswith("model.layers.0.")}
    assert layer["model.layers.0.self_attn.o_proj.weight"].is_quantized
    for rank in range(2):
        plan = ShardPlan.for_rank(config, rank, 2)
        part = shard_hf_weights(layer, config, plan)
        d = config.head_dim
        heads = slice(plan.heads.start * d, plan.heads.stop * d)
        mlp = slice(plan.intermediate.start, plan.intermediate.stop)
        for name, rows, cols in [("self_attn.q_proj", heads, None), ("mlp.up_proj", mlp, None),
                                 ("self_attn.o_proj", None, heads), ("mlp.down_proj", None, mlp)]:
            whole = dequantize(layer[f"model.layers.0.{name}.weight"])
            want = whole[rows] if rows is not None else whole[:, cols]
            assert torch.equal(dequantize(part[f"model.layers.0.{name}.weight"]), want), name
    # 12 heads of 64 in Q4_K blocks of 256 columns: two ranks would cut at column 384.
    wide = dataclasses.replace(config, num_attention_heads=12, num_key_value_heads=12)
    k_quant = GGUFTensor("Q4_K", (576, 768), np.zeros((576, 3 * 144), np.uint8))
    with pytest.raises(ValueError, match="Q4_K blocks of 256 columns, which this split would "
                                         "cut \\(at column 384\\)"):
        shard_hf_weights({"model.layers.0.self_attn.o_proj.weight": k_quant}, wide,
                         ShardPlan.for_rank(wide, 0, 2))


def test_the_default_gguf_split_agrees_with_transformers(gguf_oracle):
    """-tp 2 on the default Q4_1 file kept in its blocks, batched, under test_gguf_serving's
    criterion (its docstring says why quantized activations need one)."""
    from pipelines.checkpoint.default_model import find_gguf
    from tests.gguf_oracle import check_against_oracle, generate, oracle_choices
    from tests.test_gguf_serving import LOGPROB_NATS, MAX_TOKENS, TIE_NATS
    from tests.test_gguf_serving import PROMPTS as GGUF_PROMPTS

    tok = gguf_oracle.tokenizer
    srv = start_server(find_gguf(), *TP2, "--max-model-len", "2048", "--kv-cache-memory",
                       "256MiB")
    try:
        assert "kept in block formats" in srv.log()
        prompts_ids = [tok(p)["input_ids"] for p in GGUF_PROMPTS]
        stats = {"exact": 0, "total": 0}
        for ids, (generated, logprobs) in zip(prompts_ids, generate(srv.url, prompts_ids, True,
                                                                       MAX_TOKENS)):
            assert len(generated) == MAX_TOKENS
            check_against_oracle(oracle_choices(gguf_oracle, ids, generated), ids, generated,
                                 logprobs, stats, TIE_NATS, LOGPROB_NATS)
        assert stats["exact"] >= 0.9 * stats["total"], stats
    finally:
        assert srv.stop() == 0


# ---- through the server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def split_server(smollm2_dir):
    """The module's one split SmolLM2 (a two-rank start costs seconds): its whole cache (all
    ranks) holds 8 blocks x 16 tokens, as in test_server_oracle's preemption test, and
    prompts are prefilled 5 tokens a step, so every test here also runs through chunked
    prefill, and concurrent ones through preemption."""
    kv_bytes = 8 * 16 * 2 * 30 * 3 * 64 * 4
    srv = start_server(smollm2_dir, *TP2, "--max-model-len", "128", "--kv-cache-memory",
                       str(kv_bytes), "--max-num-batched-tokens", "5")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def split_runs(split_server):
    """A few prompts alone (each step is two all-reduces a layer), then all of them together,
    once for the tests below: ({prompt: text alone}, (results together, preemptions))."""
    alone = {}
    for prompt in PROMPTS[:3]:
        r = httpx.post(split_server.url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": 24, "temperature": 0}, timeout=120).json()
        alone[prompt] = r["choices"][0]["text"]
    return alone, sent_together_once(split_server.url)


def test_split_model_equals_transformers_alone_and_batched(split_server, split_runs,
                                                           oracle):  # noqa: F811
    alone, (together, _) = split_runs
    for prompt, text in alone.items():
        assert text == oracle[prompt][0], prompt
    check_results(together, oracle)
    log = split_server.log()
    assert "worker rank 1 of 2" in log
    assert "all-reduce between the 2 ranks: shared memory" in log
    assert re.search(r"KV cache .* = (\d+) blocks", log)


def test_split_model_streams_to_the_openai_client(split_server, oracle):  # noqa: F811
    from openai import OpenAI

    client = OpenAI(base_url=split_server.url + "/v1", api_key="none")
    prompt = PROMPTS[1]
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                       max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == oracle[prompt][0]


def test_split_model_chunked_prefill_and_preemption(split_server, split_runs,
                                                   oracle):  # noqa: F811
    results, preempted = split_runs[1]
    check_results(results, oracle)
    assert preempted > 0
    assert re.search(r"= 8 blocks x 16 = 128 tokens; steps of up to 5 tokens", split_server.log())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_split_uneven_heads_with_biases_and_qk_norm(smollm2_dir, tmp_path, arch):
    """3 key/value heads over 2 ranks (2 and 1), Qwen2's q/k/v biases, Qwen3's q/k norms."""
    path = make_tiny_checkpoint(str(tmp_path), smollm2_dir, architecture=arch, seed=7,
                                num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                                hidden_size=96, intermediate_size=100,
                                tie_word_embeddings=False)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = PROMPTS[:4]
    expected = [tok.decode(hf_greedy(model, tok, tok(p)["input_ids"], 16),
                           skip_special_tokens=True) for p in prompts]
    srv = start_server(path, *TP2, "--max-num-batched-tokens", "7")

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            rs = await asyncio.gather(*(client.post(srv.url + "/v1/completions", json={
                "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
                for p in prompts))
            return [r.json()["choices"][0]["text"] for r in rs]

    try:
        assert asyncio.run(go()) == expected
    finally:
        assert srv.stop() == 0


def test_a_killed_rank_is_handled_like_a_killed_worker(tiny_model_dir):
    srv = start_server(tiny_model_dir, *TP2, "--max-num-seqs", "4")
    rank1 = int(re.search(r"worker rank 1 of 2 is pid (\d+)", srv.log()).group(1))
    body = {"prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            streams = [asyncio.create_task(stream_until_end(client, srv.url, body))
                       for _ in range(6)]
            await asyncio.sleep(0.5)
            os.kill(rank1, signal.SIGKILL)
            killed = time.monotonic()
            health = None
            while time.monotonic() - killed < 2.0:
                health = (await client.get(srv.url + "/health")).status_code
                if health == 503:
                    break
                await asyncio.sleep(0.05)
            fresh = (await client.post(srv.url + "/v1/completions",
                                       json={"prompt": "x", "max_tokens": 2})).status_code
            results = await asyncio.wait_for(asyncio.gather(*streams), 10)
            return health, fresh, results

    health, fresh, results = asyncio.run(scenario())
    assert health == 503
    assert fresh == 503
    assert all(r in ("error-event", 503) for r in results), results
    assert srv.proc.wait(timeout=15) != 0
    assert "loom-worker-1" in srv.log()  # the dead rank is named
    assert wait_gone(srv.children)


# ---- refused with one line ------------------------------------------------------------------
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "api_server.cli", "serve", "--no-speech",
                           "--port", "0", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=180, env=dict(os.environ, PYTHONPATH=ROOT))


def test_more_ranks_than_key_value_heads_is_refused(smollm2_dir):
    out = run_cli("--model", smollm2_dir, "--tensor-parallel-size", "4")
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.startswith("loom: error")]
    assert len(lines) == 1 and "between 1 and the model's 3 key/value heads" in lines[0], \
        out.stderr
    assert "Traceback" not in out.stderr


def test_split_model_constrains_and_samples_with_a_seed(split_server):
    """Only rank 0 samples and holds grammars: a json_schema answer still validates, and a
    seeded sampled request repeats (the other rank follows rank 0's tokens)."""
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    r = httpx.post(split_server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Name a city in France as JSON."}],
        "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "city", "schema": schema}}}, timeout=120)
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"city"}
    body = {"prompt": PROMPTS[2], "max_tokens": 20, "temperature": 1.0, "seed": 7}
    texts = [httpx.post(split_server.url + "/v1/completions", json=body, timeout=120)
             .json()["choices"][0]["text"] for _ in range(2)]
    assert texts[0] == texts[1] and texts[0]
