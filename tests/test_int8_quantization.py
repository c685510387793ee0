"""`--quantization int8`: a Hugging Face checkpoint's linear layers quantized to 8 bits (Q8_0
blocks: one float16 scale per 32 weights) at load time, against transformers on the original
float32 weights.

Agreement criterion (the weights themselves change, by up to half a step of 1/127 of each
block's largest weight, and decode steps quantize activations to 8 bits as well): the oracle
is teacher-forced on Loom's greedy output; every Loom token must be the oracle's greedy choice
or within TIE_NATS of its log probability (a near tie), and >= 90% must be exactly its choice.
"""

import numpy as np
import torch

from api_server.cli import build_parser, serve_config_from_args
from api_server.launcher import StartupError
from pipelines.config import PipelineConfig
from tests.test_model_oracle import run_engine
from worker.model_runner import ModelRunner
from worker.quant_linear import QuantEmbedding, QuantLinear

TIE_NATS = 0.5
PROMPTS = ["The capital of France is", "def fibonacci(n):\n   ", "Once upon a time, there was",
           "The three primary colors are", "Water boils at a temperature of"]


def test_int8_checkpoint_agrees_with_the_float32_oracle(smollm2_dir, smollm2_hf):
    runner = ModelRunner(PipelineConfig.for_model(
        smollm2_dir, quantization_encoding="int8", kv_cache_page_size=16,
        kv_cache_memory=64 << 20, max_length=512))
    layers = runner.model.layers
    projections = [m for layer in layers for m in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
        layer.mlp.down_proj)]
    assert all(isinstance(m, QuantLinear) and m.qtype.name == "Q8_0" for m in projections)
    # 34 bytes per 32 weights: the projections' 106,168,320 weights in 8.5 bits, not 32.
    assert sum(m.weight.numel() for m in projections) == 106_168_320 // 32 * 34
    assert isinstance(runner.model.embed_tokens, QuantEmbedding)
    head = runner.model.lm_head
    assert head.weight.data_ptr() == runner.model.embed_tokens.table.weight.data_ptr()

    hf, tok = smollm2_hf
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    outputs, _ = run_engine(runner, prompts, new_tokens=16)
    exact = total = 0
    for prompt, generated in zip(prompts, outputs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1]
        logprobs = logits.float().log_softmax(-1)
        for j, token in enumerate(generated):
            gap = float(logprobs[j].max() - logprobs[j, token])
            assert gap <= TIE_NATS, f"{PROMPTS[prompts.index(prompt)]!r} token {j}: {gap:.3f}"
            exact += int(token == int(logprobs[j].argmax()))
            total += 1
    assert exact >= 0.9 * total, (exact, total)
    assert np.isfinite(np.array(outputs, dtype=float)).all()


def _config(*args):
    return serve_config_from_args(build_parser().parse_args(["serve", *args])).model_config


def test_weight_flags_resolve_as_documented(smollm2_dir, tmp_path):
    gguf = str(tmp_path / "m.gguf")
    # (No --dtype: the worker's device decides, float32 on the CPU and bfloat16 on a GPU.)
    plain = _config("--model", smollm2_dir)
    assert (plain.dtype, plain.quantization_encoding) == (None, None)
    assert _config("--model", smollm2_dir, "--quantization", "int8").quantization_encoding == "int8"
    assert _config("--model", gguf).quantization_encoding == "gguf"  # kept as the file stores it
    widened = _config("--model", gguf, "--dtype", "bfloat16")
    assert (widened.dtype, widened.quantization_encoding) == ("bfloat16", None)
    for bad in (["--model", gguf, "--quantization", "int8"],
                ["--model", smollm2_dir, "--quantization", "gguf"],
                ["--model", smollm2_dir, "--quantization", "int8", "--dtype", "bfloat16"]):
        try:
            _config(*bad)
        except StartupError as exc:
            assert str(exc).startswith("--"), exc
        else:
            raise AssertionError(f"{bad} was accepted")
