"""One request's failure in the worker (its sampling state, logits processing, draw, grammar)
ends that request with an error, never the step: the others of its batch finish with
transformers' greedy tokens."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelines import SamplingParams, TextContext
from pipelines.config import PipelineConfig
from pipelines.status import GenerationStatus
from tests.helpers import hf_greedy
from worker import logits_processors, sampler
from worker.pipeline import TextGenerationPipeline
from worker.structured_output import GrammarCompiler

NEW_TOKENS = 8
PROMPTS = ["Hello there", "A much longer prompt with more words in it", "x"]


@pytest.fixture(scope="module")
def oracle(untied_tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(untied_tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(untied_tiny_model_dir, dtype=torch.float32)
    prompts = [tok.encode(p) for p in PROMPTS]
    return prompts, [hf_greedy(hf, tok, ids, NEW_TOKENS) for ids in prompts]


def _penalty_fails_at_third_token(values, state):
    if len(state.output_tokens) == 2:
        raise RuntimeError("injected fault")
    return PENALISE(values, state)


PENALISE = logits_processors._penalise


def _filter_fails_for_top_p(values, weights, params):
    if params.top_p < 1.0:
        raise RuntimeError("injected fault")
    return KEPT_FLOOR(values, weights, params)


KEPT_FLOOR = sampler._kept_floor


def _schema_does_not_compile(self, json_schema):
    raise ValueError("injected compile failure")


# Each fault, and the culprit's sampling parameters (and JSON schema).
FAULTS = {
    # Its filters raise in the batched draw (issue 26's probe, a top_k past int64, raised
    # there until the CPU's filters became per-row thresholds, where it means no top-k).
    "draw": (SamplingParams(top_k=0, top_p=0.9, temperature=1.0), None,
             (sampler, "_kept_floor", _filter_fails_for_top_p)),
    # The generator cannot take the seed: the request's sampling state is never built.
    "seed past uint64": (SamplingParams(top_k=0, seed=2**65), None, None),
    # Its penalty raises mid-generation, after two good tokens.
    "logits processing": (SamplingParams(repetition_penalty=1.2), None,
                          (logits_processors, "_penalise", _penalty_fails_at_third_token)),
    # Its schema does not compile in the worker: never silently unconstrained.
    "grammar": (SamplingParams(), '{"type": "object"}',
                (GrammarCompiler, "matcher_for", _schema_does_not_compile)),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_failing_request_fails_alone(untied_tiny_model_dir, oracle, monkeypatch, fault):
    params, schema, patch = FAULTS[fault]
    if patch is not None:
        monkeypatch.setattr(*patch)
    prompts, expected = oracle
    pipeline = TextGenerationPipeline.in_process(PipelineConfig.for_model(untied_tiny_model_dir,
                                                               kv_cache_memory=4 << 20))
    honest = [TextContext(max_length=len(ids) + NEW_TOKENS, tokens=np.array(ids),
                          log_probabilities=2 if i == 0 else 0)
              for i, ids in enumerate(prompts)]
    culprit = TextContext(max_length=len(prompts[1]) + NEW_TOKENS, tokens=np.array(prompts[1]),
                          sampling_params=params, json_schema=schema)
    batch = {c.request_id: c for c in [honest[0], culprit, *honest[1:]]}
    steps = pipeline.next_token(batch, num_steps=NEW_TOKENS + 2)

    assert culprit.status is GenerationStatus.ERROR
    culprit_tokens = [s[culprit.request_id].next_token for s in steps if culprit.request_id in s]
    assert len(culprit_tokens) == (2 if fault == "logits processing" else 0)
    for ctx, want in zip(honest, expected):
        got = [s[ctx.request_id].next_token for s in steps if ctx.request_id in s]
        assert got == want == ctx.generated_tokens.tolist()
        assert ctx.status is GenerationStatus.MAXIMUM_LENGTH
    assert all(s[honest[0].request_id].log_probabilities is not None for s in steps
               if honest[0].request_id in s)
    for ctx in batch.values():
        pipeline.release(ctx)
    assert pipeline.steps.blocks.num_free_blocks == pipeline.steps.blocks.num_blocks
    assert pipeline.runner.requests == {} and pipeline.runner.failing == set()
