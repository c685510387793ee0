"""A model written from the documents alone (docs/examples/tiny_llama_model.py: a Llama-style
PipelineModel importing only from `pipelines`) served through `--custom-architectures`: greedy
tokens and log probabilities equal transformers' on the same weights, alone and batched,
streamed, chunk-prefilled and from the prefix cache. A bad spec fails `loom serve` at start."""

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.helpers import ROOT, start_server, write_json

EXAMPLE = "docs/examples/tiny_llama_model.py:TinyLlama"  # (relative: not on sys.path)
CHUNK = 16  # --max-num-batched-tokens: longer prompts are prefilled in chunks
MAX_TOKENS = 10
TOP_N = 3
TOL = 1e-4
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
           "def reverse(s):\n    return", "Mercury, Venus, Earth,"]
LONG = ("Here is a long prompt that the server cannot take in one step: it is prefilled in "
        "chunks of sixteen tokens while the other requests decode, and its full blocks stay "
        "in the prefix cache for the next request that starts the same way.")


@pytest.fixture(scope="module")
def custom_dir(untied_tiny_model_dir, tmp_path_factory) -> str:
    """The untied tiny Llama under an architecture name of its own: Loom has no built-in
    class for it, so only the example can serve it."""
    target = tmp_path_factory.mktemp("tiny-custom-arch")
    for name in os.listdir(untied_tiny_model_dir):
        if name != "config.json":
            os.symlink(os.path.join(untied_tiny_model_dir, name), target / name)
    with open(os.path.join(untied_tiny_model_dir, "config.json")) as f:
        config = json.load(f)
    write_json(str(target / "config.json"), dict(config, architectures=["TinyLlamaForCausalLM"]))
    return str(target)


@pytest.fixture(scope="module")
def server(custom_dir):
    srv = start_server(custom_dir, "--custom-architectures", EXAMPLE,
                       "--max-num-batched-tokens", str(CHUNK))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def oracle(untied_tiny_model_dir):
    """prompt ids -> (greedy tokens, each token's log probability and top-N) of transformers'
    LlamaForCausalLM on the same weights (float32), and its prompt's log probabilities."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(untied_tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(untied_tiny_model_dir)

    def run(ids: list[int]) -> dict:
        seq = list(ids)
        with torch.no_grad():
            for _ in range(MAX_TOKENS):  # (greedy, EOS ignored as the requests ask)
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            rows = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)
        tokens = seq[len(ids):]
        picked = [rows[len(ids) - 1 + k] for k in range(MAX_TOKENS)]
        return {"tokens": tokens,
                "logprobs": [row[t].item() for row, t in zip(picked, tokens)],
                "top": [dict(zip(row.topk(TOP_N).indices.tolist(), row.topk(TOP_N).values.tolist()))
                        for row in picked],
                "prompt_logprobs": [rows[k - 1][ids[k]].item() for k in range(1, len(ids))]}

    prompts = {p: tok(p)["input_ids"] for p in [*PROMPTS, LONG]}
    assert len(prompts[LONG]) > 2 * CHUNK
    return {p: (ids, run(ids)) for p, ids in prompts.items()}


def request(ids: list[int], **extra) -> dict:
    return {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": TOP_N, "return_tokens_as_token_ids": True, **extra}


def token_ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


async def complete(client: httpx.AsyncClient, url: str, ids: list[int]) -> dict:
    r = await client.post(url + "/v1/completions", json=request(ids), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]


def check(got: dict, want: dict) -> None:
    assert token_ids(got["tokens"]) == want["tokens"]
    for k, (lp, top) in enumerate(zip(got["token_logprobs"], got["top_logprobs"])):
        assert abs(lp - want["logprobs"][k]) < TOL
        top = {int(t.removeprefix("token_id:")): v for t, v in top.items()}
        assert top.keys() == want["top"][k].keys()
        assert all(abs(top[t] - v) < TOL for t, v in want["top"][k].items())


def complete_all(url: str, prompts: list[str], oracle) -> list[dict]:
    async def go():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(complete(client, url, oracle[p][0]) for p in prompts))

    return asyncio.run(go())


def test_alone_equals_transformers(server, oracle):
    for p in PROMPTS:
        check(complete_all(server.url, [p], oracle)[0], oracle[p][1])


def test_batched_and_chunk_prefilled_equal_transformers(server, oracle):
    """Concurrent requests share steps; the long prompt takes several chunks meanwhile."""
    prompts = [*PROMPTS, LONG]
    for p, got in zip(prompts, complete_all(server.url, prompts, oracle)):
        check(got, oracle[p][1])


def prefix_cache_hits(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(r"^loom:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M)[1])


def test_prefix_cache_hit_equals_transformers(server, oracle):
    complete_all(server.url, [LONG], oracle)  # (its blocks cached, whatever ran before)
    before = prefix_cache_hits(server.url)
    check(complete_all(server.url, [LONG], oracle)[0], oracle[LONG][1])
    assert prefix_cache_hits(server.url) - before >= 2 * CHUNK  # (whole 16-token blocks)


def test_streaming(server, oracle):
    ids, want = oracle[PROMPTS[1]]
    tokens, events = [], 0
    with httpx.stream("POST", server.url + "/v1/completions", json=request(ids, stream=True),
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events += 1
                tokens += json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]
    assert token_ids(tokens) == want["tokens"] and events >= MAX_TOKENS // 2


def test_echo_prompt_logprobs(server, oracle):
    """Every prompt row's log probability (the logits of every row: return_n_logits=-1),
    across the long prompt's chunks."""
    ids, want = oracle[LONG]
    r = httpx.post(server.url + "/v1/completions",
                   json=request(ids, max_tokens=0, echo=True, logprobs=1), timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    assert all(abs(g - w) < TOL for g, w in zip(got[1:], want["prompt_logprobs"]))


def test_missing_module_fails_serve_at_start(custom_dir):
    out = subprocess.run(
        [sys.executable, "-m", "api_server.cli", "serve", "--model", custom_dir, "--port", "0",
         "--custom-architectures", "no_such_models:TinyLlama"],
        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 1
    assert "--custom-architectures no_such_models:TinyLlama: no module named" in out.stderr


def test_specs_are_checked_when_imported(tmp_path):
    """A class that is not a PipelineModel, or a package without ARCHITECTURES, is refused
    by name (the worker imports the specs: its error ends `loom serve`'s start); a module
    name and a package listing its architectures MAX's way are taken."""
    from pipelines.custom_architectures import CustomArchitectureError, load_architectures

    example = os.path.join(ROOT, "docs/examples/tiny_llama_model.py")
    with pytest.raises(CustomArchitectureError, match="rms_norm is not a subclass of pipelines"):
        load_architectures((f"{example}:rms_norm",))
    [arch] = load_architectures(("docs.examples.tiny_llama_model:TinyLlama",))
    assert arch.name == "TinyLlamaForCausalLM"
    package = tmp_path / "my_models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    with pytest.raises(CustomArchitectureError, match="has no ARCHITECTURES"):
        load_architectures((str(package),))
    shutil.copy(example, package / "tiny.py")
    (package / "__init__.py").write_text(
        "from pipelines.pipeline import SupportedArchitecture\n"
        "from .tiny import TinyLlama\n"
        "ARCHITECTURES = [SupportedArchitecture(name='TinyLlamaForCausalLM', "
        "pipeline_model=TinyLlama)]\n")
    [arch] = load_architectures((str(package),))
    assert arch.name == "TinyLlamaForCausalLM" and arch.pipeline_model.__name__ == "TinyLlama"
