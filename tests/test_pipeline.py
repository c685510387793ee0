"""The in-process TokenGenerator (MAX's next_token / release) against transformers."""

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelines import SamplingParams, TextContext, TokenGenerator
from tests.helpers import hf_greedy
from worker.model_config import RunnerConfig
from worker.pipeline import TextGenerationPipeline


def test_next_token_matches_transformers_and_release_frees(tiny_model_dir):
    pipeline = TextGenerationPipeline(RunnerConfig(tiny_model_dir, kv_cache_memory=4 << 20))
    assert isinstance(pipeline, TokenGenerator)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts = ["Hello there", "A much longer prompt with more words in it", "x"]
    ctxs = {}
    for p in prompts:
        ids = tok.encode(p)
        c = TextContext(max_length=len(ids) + 8, tokens=np.array(ids), sampling_params=SamplingParams())
        ctxs[c.request_id] = c
    steps = pipeline.next_token(ctxs, num_steps=3) + pipeline.next_token(ctxs, num_steps=10)
    assert len(steps) == 8  # every context hits max_length after 8 tokens
    for c in ctxs.values():
        got = [s[c.request_id].next_token for s in steps]
        assert got == hf_greedy(hf, tok, c.prompt_tokens.tolist(), 8) == c.generated_tokens.tolist()
        pipeline.release(c)
    assert pipeline.blocks.num_free_blocks == pipeline.blocks.num_blocks
