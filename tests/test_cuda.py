"""The worker on a CUDA device (`--device cuda`): greedy output against transformers on the
same GPU, with the decode step's CUDA graphs and without (--enforce-eager), the graphs' logits
against the eager forward's, the openai client streaming, /health. Skipped where PyTorch sees
no GPU; on CPU-only machines the refusal of `--device cuda` is checked instead.

The model: $LOOM_CUDA_MODEL_DIR when set (bench/gpu_check.sh builds a random one there: the
default model cannot travel to a GPU machine), else the default model."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import ROOT, start_server

HAS_CUDA = torch.cuda.is_available()
CUDA_MODEL_DIR = os.environ.get("LOOM_CUDA_MODEL_DIR")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device visible to PyTorch")

PROMPTS = [
    "The capital of France is",
    "Here is a Python function that reverses a string:\n",
    "Once upon a time, in a small village,",
    "Q: What is 12 times 12?\nA:",
]
NEW_TOKENS = 24


def gpu_oracle(model_dir: str, dtype: torch.dtype) -> dict[str, list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
    out = {}
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([tok(p)["input_ids"]], device="cuda")
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, pad_token_id=tok.eos_token_id)
            out[p] = gen[0, ids.shape[1]:].tolist()
    del model
    torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def cuda_model_dir(request) -> str:
    return CUDA_MODEL_DIR or request.getfixturevalue("smollm2_dir")


def loom_choice(url: str, prompt: str, **extra) -> dict:
    r = httpx.post(url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def loom_ids(url: str, prompt: str) -> list[int]:
    choice = loom_choice(url, prompt, logprobs=0, return_tokens_as_token_ids=True)
    return token_ids(choice)


def token_ids(choice: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


@needs_cuda
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "enforce-eager"])
def test_float32_on_the_gpu_equals_transformers_token_for_token(cuda_model_dir, graphs):
    expected = gpu_oracle(cuda_model_dir, torch.float32)
    srv = start_server(cuda_model_dir, "--device", "cuda", "--dtype", "float32",
                       *([] if graphs else ["--enforce-eager"]))
    try:
        texts = {}
        for p in PROMPTS:
            choice = loom_choice(srv.url, p, logprobs=0, return_tokens_as_token_ids=True)
            assert token_ids(choice) == expected[p], p
            texts[p] = choice["text"]
        # Alone, with no log probabilities: every step's row is plain greedy (with graphs,
        # its argmax is taken on the device); the text is the verified ids' text.
        for p in PROMPTS:
            assert loom_choice(srv.url, p)["text"] == texts[p], p
        # Batched and mixed: a replayed step whose rows are all plain greedy takes their
        # argmax on the device; rows asking log probabilities, and a sampled row, take the
        # host's path. Each plain row's text equals its twin's that asked log probabilities.
        with ThreadPoolExecutor(2 * len(PROMPTS) + 1) as pool:
            with_ids = {p: pool.submit(loom_choice, srv.url, p, logprobs=0) for p in PROMPTS}
            plain = {p: pool.submit(loom_choice, srv.url, p) for p in PROMPTS}
            sampled = pool.submit(loom_choice, srv.url, PROMPTS[0], temperature=1.0, seed=1)
        for p in PROMPTS:
            assert plain[p].result()["text"] == with_ids[p].result()["text"], p
        assert sampled.result()["text"]
        assert "cuda" in srv.log()
        assert "steps of up to 2048 tokens" in srv.log()  # (a GPU's default budget)
        assert ("CUDA graphs of the decode step captured" in srv.log()) == graphs
    finally:
        assert srv.stop() == 0


@needs_cuda
def test_graph_replays_give_the_eager_forwards_logits(cuda_model_dir):
    """In one process: each decode batch size's replay against the eager forward of the same
    step, float32 (the graphs' padded rows and static tables change nothing)."""
    import numpy as np

    from pipelines.config import PipelineConfig
    from tests.test_cuda_graphs import _decode_contexts, _step
    from worker.model_runner import ModelRunner

    runner = ModelRunner(PipelineConfig.for_model(
        cuda_model_dir, devices="cuda", dtype="float32", kv_cache_page_size=16, max_length=512,
        max_batch_size=16, kv_cache_memory=64 << 20))
    assert runner.graphs is not None and sorted(runner.graphs.graphs) == [1, 2, 4, 8, 16]
    cache = runner.kv_cache
    cache[:, :, : runner.num_blocks].normal_()
    rng = np.random.default_rng(1)
    tables = np.arange(16 * 8, dtype=np.int32).reshape(16, 8)
    for n in (16, 3, 1, 7, 9):
        lens = rng.integers(2, 120, n)
        width = int(-(-lens.max() // 16))
        table = np.where(np.arange(width)[None, :] < -(-lens[:, None] // 16),
                         tables[:n, :width], -1).astype(np.int32)
        ids = rng.integers(0, runner.config.vocab_size, n)
        step = _step(ids.tolist(), lens.tolist(), table)
        replayed = runner.graphs.run(step, ids).clone()
        with torch.inference_mode():
            contexts = _decode_contexts(ids.tolist(), lens.tolist())
            inputs = runner.model.prepare_initial_token_inputs(
                contexts, kv_cache_inputs=runner.kv_manager.fetch(contexts, table))
            expected = runner.model.execute(inputs).next_token_logits
        torch.testing.assert_close(replayed, expected, rtol=1e-4, atol=1e-4)


@needs_cuda
def test_bfloat16_on_the_gpu_agrees_with_transformers_bf16(cuda_model_dir):
    """Criterion: every greedy token Loom picks in bfloat16 is, at its position (teacher
    forced through transformers' bf16 model on Loom's own continuation), transformers' top
    token or within 2% of the top logit's magnitude of it; and the first tokens agree exactly.
    Why not all exactly: bfloat16 keeps 8 bits of mantissa and the paged attention reduces in
    another order than transformers' SDPA, so where two tokens nearly tie either may win, and
    the continuations part there (random test models have many near-ties). A wrong kernel
    picks tokens far below the top."""
    srv = start_server(cuda_model_dir, "--device", "cuda")  # bfloat16: the GPU's default
    try:
        got = {p: loom_ids(srv.url, p) for p in PROMPTS}
        assert "bfloat16" in srv.log()
    finally:
        assert srv.stop() == 0
    expected = gpu_oracle(cuda_model_dir, torch.bfloat16)
    assert all(got[p][0] == expected[p][0] for p in PROMPTS), (got, expected)
    tok = AutoTokenizer.from_pretrained(cuda_model_dir)
    model = AutoModelForCausalLM.from_pretrained(cuda_model_dir, dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    with torch.no_grad():
        for p in PROMPTS:
            prompt = tok(p)["input_ids"]
            ids = torch.tensor([prompt + got[p]], device="cuda")
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            top = logits.max(dim=-1).values
            picked = logits.gather(1, torch.tensor(got[p], device="cuda")[:, None])[:, 0]
            gap = (top - picked) / top.abs().clamp(min=1.0)
            assert (gap <= 0.02).all(), (p, gap.tolist())


@needs_cuda
def test_openai_client_streams_and_health_from_the_gpu(cuda_model_dir):
    from openai import OpenAI

    srv = start_server(cuda_model_dir, "--device", "cuda", "--dtype", "float32")
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        client = OpenAI(base_url=srv.url + "/v1", api_key="none")
        body = dict(model=client.models.list().data[0].id, prompt=PROMPTS[0], max_tokens=16,
                    temperature=0)
        whole = client.completions.create(**body).choices[0].text
        streamed = "".join(c.choices[0].text
                           for c in client.completions.create(**body, stream=True)
                           if c.choices)
        assert streamed == whole and whole
    finally:
        assert srv.stop() == 0


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without a GPU")
def test_device_cuda_without_a_gpu_is_refused_in_one_line(smollm2_dir):
    out = subprocess.run([sys.executable, "-m", "api_server.cli", "serve", "--no-speech",
                          "--port", "0", "--model", smollm2_dir, "--device", "cuda"],
                         capture_output=True, text=True, cwd=ROOT, timeout=180,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if line.startswith("loom: error")]
    assert len(errors) == 1 and "no CUDA device is visible" in errors[0], out.stderr
    assert "Traceback" not in out.stderr


def test_device_names_are_checked_before_start_up():
    out = subprocess.run([sys.executable, "-m", "api_server.cli", "serve", "--device", "tpu"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 1
    assert out.stderr.strip() == "loom: error: --device tpu: not auto, cpu, cuda or cuda:N"


@needs_cuda
def test_fused_layer_ops_round_as_pytorchs_ops_in_bfloat16_on_the_gpu():
    """worker/gpu_layer_ops.py compiled for the GPU (rounding to nearest, unlike Triton's
    interpreter): its results are PyTorch's separate bf16 ops' to one bfloat16 step (the
    norm's sum order, the exponential's last float32 bit can move a rounding)."""
    import torch.nn.functional as F

    from worker import gpu_layer_ops
    from worker.attention import store_kv
    from worker.models.llama import RMSNorm, apply_rotary

    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(bf16)

    one_step = dict(rtol=2 ** -7, atol=1e-6)
    norm = RMSNorm(2048, 1e-5).to(bf16).cuda()
    with torch.no_grad():
        norm.weight.copy_(randn(2048))
        x, residual = randn(7, 2048), randn(7, 2048)
        torch.testing.assert_close(gpu_layer_ops.rms_norm(x, norm.weight, 1e-5),
                                   norm._norm(x), **one_step)
        summed = residual + x
        got = gpu_layer_ops.add_rms_norm(residual, x, norm.weight, 1e-5)
        torch.testing.assert_close(residual, summed, **one_step)
        torch.testing.assert_close(got, norm._norm(summed), **one_step)
        gate_up = randn(7, 2 * 8192)
        gate, up = gate_up.split(8192, -1)
        torch.testing.assert_close(gpu_layer_ops.silu_mul(gate_up), F.silu(gate) * up,
                                   **one_step)

        heads, kv_heads, d = 32, 8, 64
        qkv = randn(7, (heads + 2 * kv_heads) * d)
        positions = torch.tensor([0, 5, 9, 100, 7, 3, 2047], device="cuda")
        slots = torch.tensor([3, 17, 40, 41, 8, 0, 63], device="cuda")
        angles = torch.rand(2048, d // 2, generator=gen, device="cuda") * 100
        cos = torch.cat([angles.cos(), angles.cos()], -1)
        sin = torch.cat([angles.sin(), angles.sin()], -1)
        k_cache = torch.zeros(4, 16, kv_heads, d, dtype=bf16, device="cuda")
        v_cache, k_want, v_want = k_cache.clone(), k_cache.clone(), k_cache.clone()
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
        c, s = cos[positions].to(bf16), sin[positions].to(bf16)
        q_want = apply_rotary(q.reshape(7, heads, d), c, s)
        k_rot = apply_rotary(k.reshape(7, kv_heads, d), c, s)
        store_kv(k_rot, v.reshape(7, kv_heads, d), k_want, v_want, slots)
        fused = qkv.clone()
        gpu_layer_ops.rope_store_kv(fused, heads, kv_heads, d, positions, cos, sin, k_cache,
                                    v_cache, slots)
        # (Where the two products nearly cancel, one product's rounding is a whole step of
        # the products' size, not of the result's: absolute, at the inputs' scale.)
        torch.testing.assert_close(fused[:, : heads * d].reshape(q_want.shape), q_want,
                                   rtol=2 ** -7, atol=2 ** -7)
        torch.testing.assert_close(k_cache, k_want, rtol=2 ** -7, atol=2 ** -7)
        assert torch.equal(v_cache, v_want)
