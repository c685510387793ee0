"""Speculative decoding served (issue 28): the scheduler proposes (n-gram, suffix) or makes
room for a draft model's proposals, the worker verifies the proposals in one forward, and the
output is exactly what it would be without them. The tiny tied model repeats its last token,
so the proposals are mostly accepted; the penalties make it change its mind, so some are
rejected."""

import re
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from pipelines import GenerationStatus, SamplingParams, TextContext
from pipelines.config import PipelineConfig
from tests.helpers import check_windows

RUNNERS: dict = {}


def run_through_the_wire(model_dir: str, prompts: list, method: str, budget: int = 9,
                         num_blocks: int | None = None, draft: str | None = None) -> tuple:
    """The worker process's path in-process (as test_pipeline's wire test): the scheduler's
    overlap-built steps, msgpack-encoded, through `TextGenerationPipeline.next_token` over the
    worker's own contexts. Returns the scheduler's contexts, the worker's, the scheduler.
    `draft`: the draft model's directory (its runner serves the method "none" too). A
    prompt is (ids, SamplingParams, whether it speculates[, its JSON schema])."""
    from scheduler.block_manager import BlockManager
    from scheduler.scheduler import Scheduler
    from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
    from serialization.messages import ResultMessage, StepMessage
    from worker.model_runner import ModelRunner
    from worker.pipeline import ScheduledSteps, TextGenerationPipeline
    from worker.process import answer_step

    if (model_dir, draft) not in RUNNERS:  # (one model for every run: its requests end in each)
        RUNNERS[model_dir, draft] = ModelRunner(PipelineConfig.for_model(
            model_dir, kv_cache_memory=4 << 20,
            **(dict(speculative_method="draft", draft_model_path=draft) if draft else {})))
    runner = RUNNERS[model_dir, draft]
    check_windows(runner)
    pipeline = TextGenerationPipeline(runner, ScheduledSteps(runner.max_model_len))
    encode, decode = msgpack_numpy_encoder(), msgpack_numpy_decoder(StepMessage)
    blocks = BlockManager(num_blocks or runner.num_blocks, runner.block_size, True)
    config = PipelineConfig.for_model(model_dir, max_batch_input_tokens=budget,
                                      max_length=runner.max_model_len)
    sched = Scheduler(config.replace(speculative_method=method,
                                     speculative_disable_by_batch_size=8,
                                     draft_model_path=draft if method == "draft" else None),
                      blocks)
    ours = [TextContext(max_length=len(ids) + 16, tokens=np.array(ids), sampling_params=params,
                        speculative_decoding=speculates, json_schema=(schema or [None])[0])
            for ids, params, speculates, *schema in prompts]
    for ctx in ours:
        sched.add_request(ctx)
    workers: dict[str, TextContext] = {}

    def run(step):
        result = answer_step(pipeline, None, decode(encode(step.batch)), 0.0)
        assert result.error is None, result.error
        workers.update(pipeline.steps.contexts)
        sched.update(step, msgpack_numpy_decoder(ResultMessage)(encode(result)))

    inflight: deque = deque()
    for _ in range(1000):  # (the server's overlap: a step is built while the one before runs)
        step = sched.schedule(ahead=bool(inflight)) if sched.has_work else None
        if step is not None:
            inflight.append(step)
        if not inflight:
            break
        if step is None or len(inflight) == 2:
            run(inflight.popleft())
    assert not sched.has_work
    assert blocks.num_free_blocks == blocks.num_blocks  # (rejected proposals' blocks too)
    return ours, workers, sched


def test_proposals_verified_in_one_step_change_no_token(tiny_model_dir):
    """Greedy requests get exactly the tokens they get without speculation, through the
    worker's wire path: with penalties, logit_bias and min_tokens (each verified row sees the
    proposals before it as generated), max_tokens cutting an accepted run, a stop token id
    among the accepted tokens, chunked prefill (a 9-token budget that proposals count
    against), prefix-cache hits (the same prompt twice), a request that opts out beside
    them, and a cache so small that requests are preempted. The worker's contexts end where
    the scheduler's do."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "The quick brown fox jumps over the lazy dog. " * 3
    a, b = tok.encode(text), tok.encode("Copy this: one two three four five six")
    cases = [(a, SamplingParams(), True), (a, SamplingParams(), True),
             (b, SamplingParams(frequency_penalty=0.1), True),
             (b, SamplingParams(repetition_penalty=1.6, presence_penalty=0.3), True),
             (a, SamplingParams(logit_bias={42: 4.0}, max_new_tokens=11), True),
             (b, SamplingParams(), False)]
    plain, _, _ = run_through_the_wire(tiny_model_dir, cases[2:3], "none")
    later = list(dict.fromkeys(plain[0].generated_tokens.tolist()))[2]  # (after two runs)
    cases += [(b, SamplingParams(frequency_penalty=0.1, stop_token_ids=[later]), True),
              (b, SamplingParams(frequency_penalty=0.1, stop_token_ids=[later],
                                 min_new_tokens=14), True)]
    plain, _, _ = run_through_the_wire(tiny_model_dir, cases, "none")
    ours, workers, sched = run_through_the_wire(tiny_model_dir, cases, "ngram")
    for want, ctx in zip(plain, ours):
        assert ctx.generated_tokens.tolist() == want.generated_tokens.tolist()
        assert ctx.status is want.status
        assert workers[ctx.request_id].generated_tokens.tolist() == \
            want.generated_tokens.tolist()
    spec = sched.speculation
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # (some rejected)
    assert spec.accepted_per_position[0] >= spec.accepted_per_position[1] > 0
    assert len(ours[4].generated_tokens) == 11  # (max_tokens: the accepted run cut)
    assert ours[6].status is GenerationStatus.END_OF_SEQUENCE
    # Suffix decoding, and requests preempted (a cache of one request and a half).
    need = -(-(len(a) + 16) // 16) + 1
    ours, _, sched = run_through_the_wire(tiny_model_dir, cases[:3], "suffix", num_blocks=need)
    spec = sched.speculation
    assert sched.num_preemptions > 0 and 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    for want, ctx in zip(plain, ours):
        assert ctx.generated_tokens.tolist() == want.generated_tokens.tolist()


@pytest.fixture(scope="module")
def draft_model_dir(smollm2_dir, tmp_path_factory) -> str:
    """A smaller tiny model (1 layer, half the width) with the same tokenizer: tied too, it
    mostly proposes what the tiny model says."""
    from tests.helpers import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-draft")), smollm2_dir,
                                hidden_size=32, intermediate_size=64, num_hidden_layers=1)


def test_draft_model_proposals_change_no_token(tiny_model_dir, draft_model_dir,
                                               untied_tiny_model_dir):
    """A draft model's proposals (--speculative-method draft), made by the worker in the
    step that verifies them: greedy requests get exactly their tokens without speculation,
    beside one that opts out, with penalties, chunked prefill and prefix-cache hits, under
    a JSON schema (the grammar cuts what it refuses; a string's repeats pass), and when
    preempted (the draft's cache re-filled with the recomputed prompt). A draft that is
    deliberately different (random, untied: it proposes other tokens) changes nothing but
    acceptance."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    a = tok.encode("The quick brown fox jumps over the lazy dog. " * 3)
    b = tok.encode("Copy this: one two three four five six")
    schema = '{"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}'
    cases = [(a, SamplingParams(), True), (a, SamplingParams(), True),
             (b, SamplingParams(frequency_penalty=0.1), True), (b, SamplingParams(), False),
             (b, SamplingParams(), True, schema)]
    plain, _, _ = run_through_the_wire(tiny_model_dir, cases, "none")
    assert tok.decode(plain[4].generated_tokens).lstrip().startswith('{"s": "')
    accepted = {}
    # (The different draft on two requests: each of its steps verifies little.)
    for draft, first in ((draft_model_dir, 0), (untied_tiny_model_dir, 2)):
        ours, workers, sched = run_through_the_wire(tiny_model_dir, cases[first:], "draft",
                                                    draft=draft)
        for want, ctx in zip(plain[first:], ours):
            assert ctx.generated_tokens.tolist() == want.generated_tokens.tolist()
            assert ctx.status is want.status
            assert workers[ctx.request_id].generated_tokens.tolist() == \
                want.generated_tokens.tolist()
        spec = sched.speculation
        assert spec.num_draft_tokens > 0
        accepted[draft] = spec.num_accepted_tokens / spec.num_draft_tokens
    assert accepted[draft_model_dir] > 0.3 > accepted[untied_tiny_model_dir]
    need = -(-(len(a) + 16) // 16) + 1  # (a cache of one request and a half)
    ours, _, sched = run_through_the_wire(tiny_model_dir, cases[:3], "draft", num_blocks=need,
                                          draft=draft_model_dir)
    assert sched.num_preemptions > 0 and sched.speculation.num_accepted_tokens > 0
    for want, ctx in zip(plain, ours):
        assert ctx.generated_tokens.tolist() == want.generated_tokens.tolist()


def test_verified_rows_are_processed_as_the_one_token_steps_would():
    """Row j of a verification is penalized as if the first j proposals were generated, and
    a sampled request keeps its distribution: over many draws, the first new token follows
    the processed row 0 whatever was proposed (chi-square, p > 0.001)."""
    from tests.test_spec_rejection import chi_square
    from worker.model_runner import verify_proposals
    from worker.sampler import RequestSamplingState

    logits = torch.tensor([[2.0, 1.5, 0.5, 0.0]] * 3)
    penalized = RequestSamplingState.create(SamplingParams(frequency_penalty=1.0))
    # Greedy: row 0 picks 0 (accepting the proposal 0), row 1 sees it and picks 1.
    tokens, _ = verify_proposals(logits.clone(), [0, 0], penalized, 0)
    assert tokens == [0, 1]
    params = SamplingParams(top_k=0, temperature=1.0, seed=3)
    state = RequestSamplingState.create(params)
    counts = np.zeros(4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (tiny tensors: no thread pool to wake per operation)
    try:
        for _ in range(3000):
            tokens, _ = verify_proposals(logits.clone(), [1, 2], state, 0)
            counts[tokens[0]] += 1
    finally:
        torch.set_num_threads(threads)
    assert chi_square(counts, torch.softmax(logits[0], -1)) < 16.266  # (3 dof, 0.001)


@pytest.fixture(scope="module")
def server(shared_server, tiny_model_dir, draft_model_dir):
    """The tiny model served with a draft model's speculation (its own start: about 4 s).
    (The scheduler and the worker verify any proposer's proposals alike; the wire tests
    above run n-gram and suffix proposals through them.)"""
    return shared_server(tiny_model_dir, "--served-model-name", "tiny",
                         "--speculative-method", "draft", "--draft-model-path",
                         draft_model_dir, "--max-model-len", "512")


PROMPT = "Repeat after me: the quick brown fox jumps over the lazy dog. " * 4


def complete(server, **body) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 24, **body}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(v) for v in re.findall(re.escape(name) + r"\{[^}]*\}\s+(\S+)", text))


def test_served_tokens_and_logprobs_equal_those_without_speculation(server, tiny_model_dir):
    """The same request with and without speculation (the `speculative_decoding: false`
    extension): the same tokens, as transformers' greedy ones, the same log probabilities of
    them (the verify step's rows come from the prefill path: equal to float rounding), the
    same usage, with the proposals counted in the spec one's usage and in /metrics."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers import hf_greedy

    accepted_before = metric(server, "loom:spec_decode_num_accepted_tokens_total")
    ask = dict(logprobs=2, return_tokens_as_token_ids=True)
    spec, plain = complete(server, **ask), complete(server, speculative_decoding=False, **ask)
    lp, want = spec["choices"][0]["logprobs"], plain["choices"][0]["logprobs"]
    assert lp["tokens"] == want["tokens"] and spec["choices"][0]["text"] == \
        plain["choices"][0]["text"]
    assert np.allclose(lp["token_logprobs"], want["token_logprobs"], atol=1e-4)
    for got, expected in zip(lp["top_logprobs"], want["top_logprobs"]):
        assert got.keys() == expected.keys()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = [int(t.split(":")[1]) for t in lp["tokens"]]
    assert ids == hf_greedy(hf, tok, tok.encode(PROMPT), 24)
    usage = spec["usage"]
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"] == 24
    assert "speculative_decoding" not in plain["usage"]
    proposed = usage["speculative_decoding"]
    assert 0 < proposed["num_accepted_tokens"] <= proposed["num_draft_tokens"]
    assert metric(server, "loom:spec_decode_num_accepted_tokens_total") - accepted_before \
        >= proposed["num_accepted_tokens"]
    assert metric(server, "loom:spec_decode_num_accepted_tokens_per_pos_total") > 0


def test_stop_strings_max_tokens_and_a_busy_batch(server):
    """Several tokens a step stream back as one would: a stop string ends the text and the
    count at the token completing it, max_tokens cuts an accepted run; requests that opt
    out run beside speculating ones unchanged, and one constrained by a JSON schema
    speculates too (the proposals its grammar refuses cut before verification), its output
    unchanged."""
    text = complete(server, speculative_decoding=False)["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    for body in (dict(stop=[stop]), dict(max_tokens=7), dict(max_tokens=13, stream=False)):
        spec, plain = complete(server, **body), complete(server, speculative_decoding=False,
                                                          **body)
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
        assert spec["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
        assert spec["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    bodies = [{}, {"prompt": PROMPT[:40]}, {"speculative_decoding": False},
              {"response_format": schema, "max_tokens": 16}]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: complete(server, **b), bodies))
    for body, got in zip(bodies, together):
        alone = complete(server, **{**body, "speculative_decoding": False})
        assert got["choices"][0]["text"] == alone["choices"][0]["text"], body
    assert together[3]["usage"]["speculative_decoding"]["num_draft_tokens"] > 0


def test_cancelled_speculating_streams_leak_no_blocks(server):
    """Streams closed mid-way (their steps verifying proposals) free every KV block."""
    def cancel_early(_):
        body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 200,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=60) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 3:
                    break

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(cancel_early, range(8)))
    deadline = time.monotonic() + 30
    while metric(server, "loom:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "loom:kv_cache_usage_perc") == 0
    assert complete(server)["usage"]["completion_tokens"] == 24  # (still serving)
