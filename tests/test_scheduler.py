"""Scheduling policy, driven without processes: a fake model returns token 1000+step."""

import numpy as np
import pytest

from pipelines import GenerationStatus, SamplingParams, TextContext
from pipelines.config import PipelineConfig
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler
from serialization.messages import StepResult


def make_scheduler(num_blocks=64, block_size=4, budget=16, max_seqs=8, max_len=256, prefix=True,
                   **settings):
    return Scheduler(PipelineConfig().replace(max_batch_size=max_seqs,
                                              max_batch_input_tokens=budget, max_length=max_len,
                                              **settings),
                     BlockManager(num_blocks, block_size, prefix))


def ctx(n, max_new, start=0, rid=None):
    kw = {"request_id": rid} if rid else {}
    return TextContext(max_length=n + max_new, tokens=np.arange(start + 3, start + 3 + n),
                       eos_token_ids={2}, sampling_params=SamplingParams(), **kw)


def run_step(s):
    step = s.schedule()
    if step is None:
        return None, []
    sampled = np.where(step.batch.sample, 1000 + step.batch.step_id, -1).astype(np.int32)
    outputs = s.update(step, StepResult(step_id=step.batch.step_id, sampled_token_ids=sampled))
    return step, outputs


def test_long_prompt_is_chunked_and_decodes_keep_running():
    s = make_scheduler(budget=8)
    short = ctx(3, 20, rid="short")
    s.add_request(short)
    run_step(s)  # short prefilled, sampled its first token
    long = ctx(20, 5, start=100, rid="long")
    s.add_request(long)
    seen = []
    for _ in range(4):
        step, _ = run_step(s)
        seen.append(dict(zip(step.batch.request_ids, step.batch.query_lens.tolist())))
    # Every step: the decode (1 token) plus a prefill chunk filling the rest of the budget.
    assert seen[0] == {"short": 1, "long": 7}
    assert seen[1] == {"short": 1, "long": 7}
    assert seen[2] == {"short": 1, "long": 6}  # last chunk: long samples its first token
    assert seen[3] == {"short": 1, "long": 1}
    assert long.generated_tokens.tolist() == [1003, 1004]
    assert long.prompt_tokens.tolist() == list(range(103, 123))


def test_without_chunked_prefill_a_prompt_waits_for_a_step_it_fits_whole():
    s = make_scheduler(budget=20, enable_chunked_prefill=False)
    short = ctx(3, 20, rid="short")
    s.add_request(short)
    run_step(s)
    s.add_request(ctx(20, 5, start=100, rid="long"))
    step, _ = run_step(s)  # 1 decode + 20 prompt tokens exceed the budget: the decode alone
    assert step.batch.request_ids == ["short"]
    s.abort("short")
    step, _ = run_step(s)
    assert dict(zip(step.batch.request_ids, step.batch.query_lens.tolist())) == {"long": 20}


def test_step_tensors_describe_positions_and_blocks():
    s = make_scheduler(budget=64, block_size=4)
    a = ctx(6, 4, rid="a")
    s.add_request(a)
    step, _ = run_step(s)
    b = step.batch
    assert b.input_ids.tolist() == a.prompt_tokens.tolist()
    assert b.query_lens.tolist() == [6] and b.seq_lens.tolist() == [6] and b.sample.tolist() == [True]
    assert b.block_tables.shape == (1, 2) and len(b.new_requests) == 1
    step, _ = run_step(s)
    assert step.batch.input_ids.tolist() == [1000] and step.batch.seq_lens.tolist() == [7]
    assert step.batch.new_requests == []


def test_finish_on_max_tokens_frees_blocks_and_tells_worker():
    s = make_scheduler()
    a = ctx(5, 3, rid="a")
    s.add_request(a)
    outs = []
    for _ in range(3):
        outs += run_step(s)[1]
    assert [o.tokens for o in outs] == [[1000], [1001], [1002]]
    assert outs[-1].final_status is GenerationStatus.MAXIMUM_LENGTH
    assert not s.has_work and s.blocks.num_free_blocks == s.blocks.num_blocks
    s.add_request(ctx(5, 3, rid="b"))
    step, _ = run_step(s)
    assert step.batch.finished_request_ids == ["a"]


def test_max_num_seqs_and_budget_bound_each_step():
    s = make_scheduler(budget=12, max_seqs=3)
    for i in range(6):
        s.add_request(ctx(4, 10, start=10 * i, rid=f"r{i}"))
    step, _ = run_step(s)
    assert len(step.batch.request_ids) == 3 and step.batch.query_lens.sum() <= 12
    step, _ = run_step(s)
    assert len(step.batch.request_ids) == 3


def test_preemption_when_blocks_run_out_then_recompute():
    # 6 blocks of 4 tokens; two requests each growing to 12 tokens need 3+3 blocks at the end,
    # three need 9: the newest gets preempted, later resumes, and everything finishes.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    reqs = [ctx(4, 8, start=10 * i, rid=f"r{i}") for i in range(3)]
    for r in reqs:
        s.add_request(r)
    for _ in range(200):
        if not s.has_work:
            break
        run_step(s)
    assert s.num_preemptions > 0
    assert all(r.status is GenerationStatus.MAXIMUM_LENGTH for r in reqs)
    assert all(len(r.generated_tokens) == 8 for r in reqs)
    assert s.blocks.num_free_blocks == 6


def test_abort_frees_blocks_immediately():
    s = make_scheduler()
    s.add_request(ctx(10, 50, rid="a"))
    run_step(s)
    assert s.blocks.num_free_blocks < s.blocks.num_blocks
    assert s.abort("a")
    assert not s.has_work and s.blocks.num_free_blocks == s.blocks.num_blocks


def test_prefix_cache_hit_skips_computed_blocks():
    s = make_scheduler(budget=64, block_size=4)
    s.add_request(ctx(13, 1, rid="a"))
    run_step(s)
    b = ctx(13, 1, rid="b")
    s.add_request(b)
    step, _ = run_step(s)
    # 12 of 13 tokens were cached (3 full blocks): only the last one is fed.
    assert step.batch.query_lens.tolist() == [1] and step.batch.seq_lens.tolist() == [13]
    assert s.blocks.prefix_hits == 12


def test_fair_share_splits_the_worker_between_text_and_the_rest():
    from scheduler.fair_share import FairShare

    share = FairShare()
    assert share.next_kind(text_waiting=False, waiting=["speech"]) == "speech"
    assert share.next_kind(text_waiting=True, waiting=[]) is None
    turns = []
    for _ in range(12):  # both waiting: text steps of 10 ms, speech chunks of 30 ms
        kind = share.next_kind(True, ["speech"]) or "text"
        share.record(kind, 0.03 if kind == "speech" else 0.01)
        turns.append(kind)
    assert turns.count("text") == 3 * turns.count("speech")  # equal time, not equal turns
    share.next_kind(False, ["speech"])  # text done: the account starts again
    assert share.busy == {"text": 0.0, "speech": 0.0, "pixels": 0.0}
    turns = []
    for _ in range(20):  # images: a quarter; text steps of 1 unit, denoising steps of 6
        kind = share.next_kind(True, ["pixels"]) or "text"
        share.record(kind, 6.0 if kind == "pixels" else 1.0)
        turns.append(kind)
    assert turns == ["pixels"] + ["text"] * 18 + ["pixels"]  # 3 x 6 units of text each
    # All three waiting: speech and images each get their share (speech first when both due).
    share = FairShare()
    turns = []
    for _ in range(24):
        kind = share.next_kind(True, ["speech", "pixels"]) or "text"
        share.record(kind, {"text": 1.0, "speech": 1.0, "pixels": 6.0}[kind])
        turns.append(kind)
    assert turns[:3] == ["speech", "pixels", "text"]
    assert 0.2 < 6 * turns.count("pixels") / sum(
        {"text": 1.0, "speech": 1.0, "pixels": 6.0}[k] for k in turns) < 0.5


def test_arbiter_queues_a_text_step_ahead_unless_speech_waits():
    """Overlap scheduling: behind a running text step the next one is already queued, and
    the worker's idle time between them is measured from its own clock; speech waiting
    stops it (turns are decided when the worker is free)."""
    from pipelines.speech_context import TTSContext
    from scheduler.arbiter import Arbiter
    from scheduler.speech_queue import SpeechQueue
    from scheduler.text_source import TextSource

    text, speech = TextSource(make_scheduler()), SpeechQueue()
    arbiter = Arbiter(text, [text, speech], speech)
    arbiter.add(ctx(3, 20, rid="a"))
    first = arbiter.next_step()
    ahead = arbiter.next_step()
    assert ahead is not None and ahead.step_id == first.step_id + 1
    assert arbiter.next_step() is None  # one running, one queued
    for step, started, finished in ((first, 10.0, 10.5), (ahead, 10.75, 11.0)):
        sampled = np.where(step.sample, 7, -1).astype(np.int32)
        arbiter.after_step(StepResult(step_id=step.step_id, sampled_token_ids=sampled,
                                      started_at=started, finished_at=finished))
        if step is first:
            arbiter.add(TTSContext.from_phoneme_segments([np.arange(3)], request_id="s"))
            assert arbiter.next_step() is None  # speech waits: nothing queued ahead
    assert arbiter.take_stats().step_overheads == [0.25]  # started 10.75, after 10.5
    assert not arbiter.busy
    assert type(arbiter.next_step()).__name__ == "AudioStep"  # speech's turn


def test_a_cancelled_speech_token_request_frees_its_kv_blocks():
    """Orpheus: the text batch runs the speech request's language model; aborting it (a
    closed stream) frees its KV blocks and leaves nothing to decode."""
    from pipelines import orpheus
    from pipelines.speech_context import TTSContext
    from scheduler.arbiter import Arbiter
    from scheduler.speech_queue import SpeechQueue
    from scheduler.text_source import TextSource

    text = TextSource(make_scheduler(prefix=False))
    speech = SpeechQueue(text)
    arbiter = Arbiter(text, [text, speech], speech)
    free = text.scheduler.blocks.num_free_blocks
    arbiter.add(TTSContext(request_id="s", tokens=np.arange(3, 13), max_length=200))
    step = arbiter.next_step()
    assert type(step).__name__ == "StepBatch" and step.request_ids == ["s"]
    batch = arbiter.after_step(StepResult(step_id=step.step_id, sampled_token_ids=np.array(
        [orpheus.AUDIO_TOKEN_OFFSET], np.int32), started_at=1.0, finished_at=1.1))
    assert batch.outputs == []  # its tokens come back as audio, not text
    assert text.scheduler.blocks.num_free_blocks < free
    arbiter.abort({"s"})
    assert text.scheduler.blocks.num_free_blocks == free
    assert not text.has_work and not speech.has_work and not speech.owns("s")


@pytest.mark.parametrize("given,device_default,expected", [
    (None, 512, 512), (None, 2048, 2048), (300, 2048, 300)])
def test_an_unset_step_budget_is_the_workers_device_default(tmp_path, given, device_default,
                                                              expected):
    """--max-num-batched-tokens unset: the default of the device the worker runs on (512 on
    a CPU, 2048 on a GPU), which the worker reports in WorkerReady and the scheduler loop
    steps by; given: the flag's, whatever the device."""
    import zmq

    from processes.sockets import Endpoints, make_socket
    from scheduler.process import SchedulerLoop
    from serialization.messages import WorkerReady

    config = PipelineConfig().replace(max_length=4096, max_batch_input_tokens=given)
    assert config.batch_input_tokens_on("cpu") == (given or 512)
    assert config.batch_input_tokens_on("cuda") == (given or 2048)
    endpoints = Endpoints.ipc(str(tmp_path))
    loop = SchedulerLoop(config, endpoints)
    api = zmq.Context()  # (SchedulerReady needs a reader)
    responses = make_socket(api, zmq.PULL, endpoints.responses, bind=False)
    try:
        loop.start(WorkerReady(num_blocks=512, block_size=16, max_model_len=4096,
                               eos_token_ids=[2], max_batch_input_tokens=device_default))
        assert responses.poll(5000)  # (SchedulerReady)
        scheduler = loop.arbiter.text.scheduler
        assert scheduler.max_batch_input_tokens == expected
        scheduler.add_request(ctx(3000, 8, rid="long"))
        step = scheduler.schedule()
        assert step.batch.query_lens.tolist() == [expected]  # (the prompt's first chunk)
    finally:
        loop.close()
        api.destroy(linger=0)
