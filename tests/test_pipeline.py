"""The in-process TokenGenerator (MAX's next_token / release) against transformers."""

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelines import SamplingParams, TextContext, TokenGenerator
from pipelines.config import PipelineConfig
from tests.helpers import check_windows, hf_greedy
from worker.pipeline import TextGenerationPipeline


def test_next_token_matches_transformers_and_release_frees(tiny_model_dir):
    pipeline = TextGenerationPipeline.in_process(PipelineConfig.for_model(tiny_model_dir,
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
    assert pipeline.steps.blocks.num_free_blocks == pipeline.steps.blocks.num_blocks


def test_chunked_prefill_and_a_context_left_out(tiny_model_dir):
    # The pipeline runs the server's scheduler: a 5-token budget splits the prompt over
    # steps that return nothing for it, and a context still running must be in every batch.
    import pytest

    pipeline = TextGenerationPipeline.in_process(PipelineConfig.for_model(
        tiny_model_dir, kv_cache_memory=4 << 20, max_batch_input_tokens=5))
    check_windows(pipeline.runner)
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
    assert pipeline.steps.blocks.num_free_blocks == pipeline.steps.blocks.num_blocks
    assert pipeline.runner.requests == {}


def test_the_worker_runs_the_scheduler_steps_through_the_pipeline(tiny_model_dir):
    """The worker process's path, in-process: the scheduler's steps (overlap-built, chunked,
    with preemption and prefix hits), msgpack-encoded as on the wire, go through
    `TextGenerationPipeline.next_token` over the worker's own contexts, made from each step's
    NewRequest and kept current from the step deltas. The worker's contexts end where the
    scheduler's do, their own status enforcing max_new_tokens and stop token ids."""
    from collections import deque

    from pipelines import GenerationStatus
    from scheduler.block_manager import BlockManager
    from scheduler.scheduler import Scheduler
    from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
    from serialization.messages import ResultMessage, StepBatch, StepMessage
    from worker.model_runner import ModelRunner
    from worker.pipeline import ScheduledSteps
    from worker.process import answer_step

    runner = ModelRunner(PipelineConfig.for_model(tiny_model_dir, kv_cache_memory=4 << 20))
    checked = check_windows(runner)  # (each step's windows are exactly what it feeds)
    pipeline = TextGenerationPipeline(runner, ScheduledSteps(runner.max_model_len))
    encode, decode = msgpack_numpy_encoder(), msgpack_numpy_decoder(StepMessage)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    a = tok.encode("The worker keeps a context for every request it runs")
    b = tok.encode("A prompt long enough to need several chunks of nine tokens, and long "
                   "enough that two of them never fit in the cache at once")
    greedy = hf_greedy(hf, tok, a, 8)
    stop = greedy[2]
    cases = [(b, SamplingParams(), hf_greedy(hf, tok, b, 8), GenerationStatus.MAXIMUM_LENGTH),
             (b, SamplingParams(), hf_greedy(hf, tok, b, 8), GenerationStatus.MAXIMUM_LENGTH),
             (a, SamplingParams(max_new_tokens=5), hf_greedy(hf, tok, a, 5),
              GenerationStatus.MAXIMUM_LENGTH),
             (a, SamplingParams(stop_token_ids=[stop]), greedy[: greedy.index(stop) + 1],
              GenerationStatus.END_OF_SEQUENCE)]
    # Blocks for one request and a half: the others are preempted or wait.
    blocks = BlockManager(-(-(len(b) + 8) // runner.block_size) + 1, runner.block_size, True)
    sched = Scheduler(PipelineConfig.for_model(tiny_model_dir, max_batch_input_tokens=9,
                                               max_length=runner.max_model_len), blocks)
    ours = [TextContext(max_length=len(ids) + 8, tokens=np.array(ids), sampling_params=params)
            for ids, params, _, _ in cases]
    for ctx in ours:
        sched.add_request(ctx)
    workers: dict[str, TextContext] = {}

    def run(step):
        result = answer_step(pipeline, None, decode(encode(step.batch)), 0.0)
        assert result.error is None, result.error
        workers.update(pipeline.steps.contexts)
        sched.update(step, msgpack_numpy_decoder(ResultMessage)(encode(result)))

    inflight: deque = deque()
    for _ in range(500):  # (the server's overlap: a step is built while the one before runs)
        step = sched.schedule(ahead=bool(inflight)) if sched.has_work else None
        if step is not None:
            inflight.append(step)
        if not inflight:
            break
        if step is None or len(inflight) == 2:
            run(inflight.popleft())
    assert not sched.has_work and sched.num_preemptions > 0 and checked[0] > 10
    for ctx, (_, _, want, status) in zip(ours, cases):
        worker = workers[ctx.request_id]
        assert ctx.generated_tokens.tolist() == want == worker.generated_tokens.tolist()
        assert ctx.status is status and worker.status is status
    # The steps name the finished requests: the worker forgets them.
    finished = StepBatch(step_id=-1, request_ids=[], input_ids=np.zeros(0, np.int32),
                         query_lens=np.zeros(0, np.int32), seq_lens=np.zeros(0, np.int32),
                         block_tables=np.zeros((0, 0), np.int32), sample=np.zeros(0, bool),
                         finished_request_ids=list(workers))
    answer_step(pipeline, None, finished, 0.0)
    assert pipeline.steps.contexts == {} and runner.requests == {}
