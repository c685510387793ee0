"""Loom's Gemma 3 text model against Hugging Face transformers on the same weights, in process:
a tiny random Gemma3ForCausalLM with local (sliding-window) and global layers, prompts longer
than the window, alone, batched, in chunks, with prefix-cache hits and steps built ahead."""


import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelines import TextContext
from pipelines.checkpoint.model_config import (
    UnsupportedModelError,
    load_model_config,
    model_config_from_dict,
    resolve_max_model_len,
)
from pipelines.config import PipelineConfig
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler
from tests.helpers import hf_greedy, save_with_tokenizer
from tests.test_model_oracle import run_engine as oracle_run_engine
from tests.test_model_oracle import run_engine_overlapped
from worker.attention import build_attention_metadata, sliding_window_metadata
from worker.model_runner import ModelRunner
from worker.models.gemma3 import Gemma3ForCausalLM
from worker.models.llama import LlamaForCausalLM
from worker.models.registry import model_class

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention", "full_attention"]
PROMPTS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch",
    "In 1492, Columbus sailed the ocean blue, and in the years that followed",
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return",
    "Translate to French: good morning, my friend, how are you today? I hope that",
    "Zebras live in Africa",  # shorter than the window
]
NEW_TOKENS = 16


def make_tiny_gemma3(target: str, tokenizer_dir: str, seed: int = 0, **overrides) -> str:
    """A small random Gemma 3 (seeded) with the SmolLM2 tokenizer. The norms' weights are
    random too (transformers starts them at zero: 1 + w = 1, which would hide a norm applied
    in the wrong place or without its + 1)."""
    import transformers

    fields = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        max_position_embeddings=1024, sliding_window=WINDOW, layer_types=LAYER_TYPES,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
        initializer_range=0.05,
    )
    fields.update(overrides)
    config = transformers.Gemma3TextConfig(**fields)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    return save_with_tokenizer(model, target, tokenizer_dir)


def gemma_runner(path: str, **options) -> ModelRunner:
    cfg = PipelineConfig.for_model(
        path, **{"kv_cache_page_size": 4, "kv_cache_memory": 8 << 20, **options})
    runner = ModelRunner(cfg)
    assert isinstance(runner.model, Gemma3ForCausalLM)
    return runner


def run_engine(runner, prompts_ids, budget=512):
    """tests/test_model_oracle.py's, with NEW_TOKENS of this module's."""
    return oracle_run_engine(runner, prompts_ids, budget, new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def gemma(smollm2_dir, tmp_path_factory):
    path = make_tiny_gemma3(str(tmp_path_factory.mktemp("gemma3")), smollm2_dir, seed=1)
    runner = gemma_runner(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok.encode(p) for p in PROMPTS]
    assert sum(len(p) > WINDOW for p in ids) >= 4
    expected = [hf_greedy(hf, tok, p, NEW_TOKENS) for p in ids]
    return runner, hf, tok, ids, expected


def test_config(gemma):
    runner, hf, _, _, _ = gemma
    config = runner.config
    assert config.architecture == "Gemma3ForCausalLM"
    assert config.layer_types == LAYER_TYPES and config.sliding_window == WINDOW
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
    assert config.query_pre_attn_scalar == 24 and config.head_dim == 16
    assert config.hidden_act == "gelu_pytorch_tanh" and config.tie_word_embeddings
    # The window is honoured per layer: the context is not clamped to it.
    assert runner.max_model_len == 1024 == resolve_max_model_len(config, None)
    assert model_class(config) is Gemma3ForCausalLM
    assert model_class(load_model_config(hf.name_or_path)) is Gemma3ForCausalLM


def test_config_of_older_checkpoints():
    """The config.json Google shipped (transformers 4.5x): rope_theta, rope_local_base_freq,
    rope_scaling, a sliding_window_pattern instead of layer_types."""
    raw = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
           "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
           "vocab_size": 262144, "max_position_embeddings": 32768, "sliding_window": 512,
           "rope_theta": 1e6, "rope_local_base_freq": 1e4, "_sliding_window_pattern": 6,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 256,
           "hidden_activation": "gelu_pytorch_tanh", "eos_token_id": [1, 106]}
    config = model_config_from_dict(raw)
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert config.rope_local_theta == 1e4 and config.tie_word_embeddings
    assert config.eos_token_ids == [1, 106] and config.bos_token_id == 2
    assert resolve_max_model_len(config, None) == 32768
    with pytest.raises(UnsupportedModelError):
        model_config_from_dict({**raw, "use_bidirectional_attention": True})
    llama = model_config_from_dict({**raw, "architectures": ["MistralForCausalLM"]})
    assert model_class(llama) is LlamaForCausalLM
    # Mistral honours its window on every layer, so it no longer caps the context; the rest
    # of the Llama family (a Llama config with a window) attends over everything: it still clamps.
    assert resolve_max_model_len(llama, None) == 32768
    plain = model_config_from_dict({**raw, "architectures": ["LlamaForCausalLM"]})
    assert resolve_max_model_len(plain, None) == 512


def test_greedy_matches_transformers_alone(gemma):
    runner, _, _, ids, expected = gemma
    for prompt, want in zip(ids, expected):
        got, _ = run_engine(runner, [prompt])
        assert got[0] == want


def test_greedy_matches_transformers_batched_and_chunked(gemma):
    runner, _, _, ids, expected = gemma
    ours, _ = run_engine(runner, ids)
    assert ours == expected
    # Chunks of 5 tokens: every prompt's prefill spans several steps beside others' decodes,
    # chunks starting inside and past the window.
    ours, _ = run_engine(runner, ids, budget=5)
    assert ours == expected


def test_prefix_hits_and_overlap_scheduling_match(gemma):
    runner, hf, tok, _, _ = gemma
    shared = "A long shared system preamble that many requests start with. " * 2
    ids = [tok.encode(shared + p) for p in PROMPTS]
    expected = [hf_greedy(hf, tok, p, NEW_TOKENS) for p in ids]
    ours, sched = run_engine_overlapped(runner, ids, budget=24, new_tokens=NEW_TOKENS)
    assert sched.blocks.prefix_hits > 0
    assert ours == expected


def first_step_logits(runner, ids, block_size=4):
    blocks = BlockManager(runner.num_blocks, block_size)
    sched = Scheduler(PipelineConfig().replace(max_batch_input_tokens=512,
                                      max_length=runner.max_model_len), blocks)
    for p in ids:
        sched.add_request(TextContext(max_length=len(p) + 1, tokens=np.array(p)))
    step = sched.schedule().batch
    meta = build_attention_metadata(step.query_lens, step.seq_lens, step.block_tables,
                                    block_size)
    rows = torch.from_numpy(np.cumsum(step.query_lens) - 1)
    with torch.inference_mode():
        return runner.model(torch.from_numpy(step.input_ids.astype(np.int64)), meta,
                            runner.kv_cache, rows)


def test_first_step_logits_match(gemma):
    runner, hf, _, ids, _ = gemma
    ours = first_step_logits(runner, ids)
    with torch.no_grad():
        for i, p in enumerate(ids):
            ref = hf(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(ours[i], ref, atol=1e-4, rtol=1e-4)


def test_sliding_window_metadata_limits_keys_to_the_window():
    """Decodes and a chunk past the window: each query sees exactly its last WINDOW
    positions, and the block tables start at the first block in reach."""
    block_size = 4
    query_lens = np.array([1, 1, 6, 3])
    seq_lens = np.array([3, 30, 20, 3])
    tables = np.arange(4 * 8).reshape(4, 8)
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    local = sliding_window_metadata(meta, WINDOW, block_size)
    assert local.positions is meta.positions
    for group, full in zip(local.groups, meta.groups):
        assert group.window == WINDOW
        for b in range(group.block_tables.shape[0]):
            s, q = int(group.seq_lens[b]), int(group.q_lens[b])
            first = max(s - q - WINDOW + 1, 0) // block_size
            row = full.block_tables[b].tolist()
            n = min(len(row) - first, group.block_tables.shape[1])
            assert group.block_tables[b, :n].tolist() == row[first:first + n]
            for t in range(q):
                pos = s - q + t
                keys = np.flatnonzero(group.mask[b, 0, t].numpy()) + (
                    0 if group.fresh else first * block_size)
                assert keys.tolist() == list(range(max(pos - WINDOW + 1, 0), pos + 1))


def test_soft_capping_matches_transformers(smollm2_dir, tmp_path):
    """final_logit_softcapping caps the logits; attn_logit_softcapping is ignored, as
    transformers' Gemma 3 ignores it (eager attention, which would take it, included)."""
    attn_softcap, final_softcap = 2.0, 0.5
    path = make_tiny_gemma3(str(tmp_path), smollm2_dir, seed=3,
                            attn_logit_softcapping=attn_softcap,
                            final_logit_softcapping=final_softcap)
    runner = gemma_runner(path)
    assert runner.config.attn_logit_softcapping == attn_softcap
    assert runner.config.final_logit_softcapping == final_softcap
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    ours = first_step_logits(runner, ids)
    with torch.no_grad():
        for i, p in enumerate(ids):
            ref = hf(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(ours[i], ref, atol=1e-4, rtol=1e-4)
    got, _ = run_engine(runner, ids, budget=7)
    assert got == [hf_greedy(hf, tok, p, NEW_TOKENS) for p in ids]


def test_bfloat16_matches_float32_on_bf16_weights(smollm2_dir, tmp_path):
    """bfloat16 weights and KV cache (computing in float32 where the packed kernel runs):
    transformers in float32 on the same bf16-rounded weights, but for the cache's rounding."""
    path = make_tiny_gemma3(str(tmp_path), smollm2_dir, seed=5)
    runner = gemma_runner(path, dtype="bfloat16", kv_cache_page_size=16, kv_cache_memory=16 << 20)
    assert runner.kv_cache.dtype == torch.bfloat16
    if runner.model.compute_dtype != torch.float32:
        pytest.skip("no packed kernel here: bfloat16 computes in bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).float().eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok.encode(p) for p in PROMPTS]
    ours = first_step_logits(runner, ids, block_size=16)
    with torch.no_grad():
        for i, p in enumerate(ids):
            ref = hf(torch.tensor([p])).logits[0, -1]
            # (the native prefill kernel, global and sliding layers alike, reads K/V rounded
            # to bf16 by the cache, which transformers does not: up to ~1.2e-2 here, where
            # the float32 cache's test above agrees to 1e-4)
            torch.testing.assert_close(ours[i], ref, atol=2e-2, rtol=0)
