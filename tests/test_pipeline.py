"""The in-process TokenGenerator (MAX's next_token / release) against transformers."""

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelines import SamplingParams, TextContext, TokenGenerator
from pipelines.config import PipelineConfig
from tests.helpers import hf_greedy
from worker.pipeline import TextGenerationPipeline


def test_next_token_matches_transformers_and_release_frees(tiny_model_dir):
    pipeline = TextGenerationPipeline(PipelineConfig.for_model(tiny_model_dir,
                                                               kv_cache_memory=4 << 20))
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


def test_chunked_prefill_and_a_context_left_out(tiny_model_dir):
    # The pipeline runs the server's scheduler: a 5-token budget splits the prompt over
    # steps that return nothing for it, and a context still running must be in every batch.
    import pytest

    pipeline = TextGenerationPipeline(PipelineConfig.for_model(
        tiny_model_dir, kv_cache_memory=4 << 20, max_batch_input_tokens=5))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = tok.encode("A prompt long enough to need several chunks of five tokens each, at least")
    assert len(ids) > 10
    a = TextContext(max_length=len(ids) + 4, tokens=np.array(ids), sampling_params=SamplingParams())
    b = TextContext(max_length=len(ids) + 4, tokens=np.array(ids), sampling_params=SamplingParams())
    steps = pipeline.next_token({a.request_id: a}, num_steps=40)
    assert steps[0] == {}  # the first chunk samples nothing
    got = [s[a.request_id].next_token for s in steps if a.request_id in s]
    assert got == hf_greedy(hf, tok, ids, 4) and a.is_done
    pipeline.next_token({b.request_id: b}, num_steps=1)
    with pytest.raises(ValueError, match="still generating"):
        pipeline.next_token({}, num_steps=1)
    pipeline.release(b)
    assert pipeline.next_token({}, num_steps=1) == []
    assert pipeline.blocks.num_free_blocks == pipeline.blocks.num_blocks
    assert pipeline.runner.requests == {}
