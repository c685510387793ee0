"""The native kernels trust block ids, positions and lengths: the worker checks each step
before any kernel runs, so a scheduler bug fails that step (an error result) instead of
corrupting memory, and the worker serves the next step as if nothing happened. And the kernels
report a failed allocation (MemoryError) instead of writing through a NULL pointer."""

import os
import subprocess
import sys
import textwrap

import msgspec
import numpy as np
import pytest

from pipelines import SamplingParams, TextContext
from pipelines.config import PipelineConfig
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler
from serialization.messages import StepBatch, StepResult
from tests.helpers import ROOT
from worker.model_runner import ModelRunner
from worker.pipeline import ScheduledSteps, TextGenerationPipeline, run_step
from worker.process import answer_step

BLOCK = 16  # the native prefill kernel's block size, so both attention kernels run


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(PipelineConfig.for_model(tiny_model_dir, kv_cache_page_size=BLOCK,
                                                kv_cache_memory=4 << 20))


def worker_pipeline(runner) -> TextGenerationPipeline:
    """What the worker process runs the steps through (its own contexts, none yet)."""
    return TextGenerationPipeline(runner, ScheduledSteps(runner.max_model_len))


def new_scheduler(runner) -> Scheduler:
    return Scheduler(PipelineConfig().replace(max_batch_size=8, max_batch_input_tokens=256,
                                     max_length=runner.max_model_len),
                     BlockManager(runner.num_blocks, BLOCK, False))


def add_prompts(sched, seed: int = 0, lengths=(5, 23, 40)) -> list[TextContext]:
    rng = np.random.default_rng(seed)
    ctxs = [TextContext(max_length=n + 6, tokens=rng.integers(5, 400, n), eos_token_ids=set(),
                        sampling_params=SamplingParams(temperature=0.0)) for n in lengths]
    for ctx in ctxs:
        sched.add_request(ctx)
    return ctxs


def with_arrays(step: StepBatch, **arrays) -> StepBatch:
    return msgspec.structs.replace(step, **arrays)


def widened(tables: np.ndarray, columns: int, fill: int) -> np.ndarray:
    return np.pad(tables, ((0, 0), (0, columns)), constant_values=fill)


def set_at(array: np.ndarray, index, value) -> np.ndarray:
    out = np.array(array)  # (a writable copy: arrays from the wire are read-only views)
    out[index] = value
    return out


# Each turns a valid step into one a buggy scheduler could send; all must be refused.
CORRUPTIONS = {
    "block id = num_blocks": lambda st, r: with_arrays(
        st, block_tables=set_at(st.block_tables, (0, 0), r.num_blocks)),
    "block id 2^31-1": lambda st, r: with_arrays(
        st, block_tables=set_at(st.block_tables, (-1, 0), 2 ** 31 - 1)),
    "padding in a used block": lambda st, r: with_arrays(
        st, block_tables=set_at(st.block_tables, (-1, 0), -1)),
    "negative padding below -1": lambda st, r: with_arrays(
        st, block_tables=set_at(widened(st.block_tables, 1, -1), (0, -1), -7)),
    "sequence longer than its table": lambda st, r: with_arrays(
        st, seq_lens=set_at(st.seq_lens, 0, st.block_tables.shape[1] * BLOCK + 1)),
    "sequence longer than max_model_len": lambda st, r: with_arrays(
        st, seq_lens=set_at(st.seq_lens, 0, r.max_model_len + 1),
        block_tables=widened(st.block_tables, r.max_model_len // BLOCK + 1, 0)),
    "query longer than its sequence": lambda st, r: with_arrays(
        st, seq_lens=set_at(st.seq_lens, -1, st.query_lens[-1] - 1)),
    "zero query length": lambda st, r: with_arrays(
        st, query_lens=set_at(st.query_lens, 0, 0), input_ids=st.input_ids[1:]),
    "query lengths not summing to the ids": lambda st, r: with_arrays(
        st, input_ids=st.input_ids[:-1]),
    "token id = vocab size": lambda st, r: with_arrays(
        st, input_ids=set_at(st.input_ids, 0, r.config.vocab_size)),
    "token id -5": lambda st, r: with_arrays(st, input_ids=set_at(st.input_ids, 0, -5)),
    "arrays of different lengths": lambda st, r: with_arrays(st, seq_lens=st.seq_lens[:-1]),
    "float lengths": lambda st, r: with_arrays(st, seq_lens=st.seq_lens.astype(np.float32)),
    "2-D input ids": lambda st, r: with_arrays(st, input_ids=st.input_ids[None, :]),
}


@pytest.fixture(scope="module")
def steps(runner):
    """A prefill step of three prompts, then a decode step of the same three sequences."""
    sched = new_scheduler(runner)
    add_prompts(sched, seed=1)
    prefill = sched.schedule()
    sched.update(prefill, run_step(runner, prefill))
    decode = sched.schedule()
    assert (decode.batch.query_lens == 1).all() and (prefill.batch.query_lens > 1).all()
    return {"prefill": prefill.batch, "decode": decode.batch}


@pytest.mark.parametrize("kind", ["prefill", "decode"])
@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_a_corrupted_step_raises_a_value_error(runner, steps, kind, corrupt):
    bad = corrupt(steps[kind], runner)
    with pytest.raises(ValueError, match=f"step {bad.step_id}"):
        runner.check(bad)
    result = answer_step(worker_pipeline(runner), None, bad, started=0.0)
    assert isinstance(result, StepResult) and result.error.startswith("ValueError")
    assert (result.sampled_token_ids == -1).all()


def generate(runner, corrupt=None) -> tuple[list[list[int]], int, int]:
    """Greedy generation through the worker's step function; with `corrupt`, each step is
    first sent corrupted (a scheduler bug), and must be answered with an error."""
    sched = new_scheduler(runner)
    ctxs = add_prompts(sched, seed=2)
    pipeline = worker_pipeline(runner)
    errors = steps = 0
    while sched.has_work:
        step = sched.schedule()
        steps += 1
        if corrupt is not None:
            bad = corrupt(step.batch, runner)
            errors += answer_step(pipeline, None, bad, 0.0).error is not None
        result = answer_step(pipeline, None, step.batch, 0.0)
        assert result.error is None
        sched.update(step, result)
    return [c.generated_tokens.tolist() for c in ctxs], errors, steps


def test_the_worker_serves_the_next_good_step_as_if_nothing_happened(runner):
    expected, _, _ = generate(runner)
    for name in ("block id = num_blocks", "sequence longer than its table", "token id -5"):
        tokens, errors, steps = generate(runner, CORRUPTIONS[name])
        assert errors == steps > 1  # every corrupted step was refused...
        assert tokens == expected, name  # ...before it wrote anything to the KV cache


def test_legitimate_padding_and_placeholders_pass(runner, steps):
    """-1 padding past a sequence's blocks, and the overlap scheduler's -1 placeholder ids."""
    step = steps["decode"]
    padded = with_arrays(step, block_tables=widened(step.block_tables, 5, -1),
                         input_ids=set_at(step.input_ids, 0, -1))
    runner.check(padded)


# -- allocation failures in the kernels ------------------------------------------------------

_CHILD = textwrap.dedent("""
    import resource, sys, torch
    sys.path.insert(0, {root!r})
    from worker import decode_attention, prefill_attention

    def address_space_left_after_this(extra):
        with open("/proc/self/status") as f:
            size = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (size + extra, resource.RLIM_INFINITY))

    kind = sys.argv[1]
    k_cache = torch.zeros(4, 16, 8, 64)
    table = torch.zeros(1, 1 << 14, dtype=torch.int32)  # every entry: block 0
    if kind == "decode":
        if not decode_attention.native_decode_available(torch.float32):
            sys.exit(77)
        q = torch.zeros(1, 1024, 8)
        cache = torch.zeros(1, 16, 1, 8)
        decode_attention.paged_decode_attention(q, cache, cache, table[:, :4].contiguous(),
                                                torch.tensor([40], dtype=torch.int32), 1.0)
        address_space_left_after_this(256 << 20)
        # Two sequences (as many as threads: one task per sequence, all its heads), each
        # 1024 heads x 2^18 keys of scores: 1 GiB scratch buffers
        q2, tables = q.expand(2, -1, -1).contiguous(), table.expand(2, -1).contiguous()
        call = lambda: decode_attention.paged_decode_attention(
            q2, cache, cache, tables, torch.tensor([1 << 18] * 2, dtype=torch.int32), 1.0)
    else:
        q = torch.zeros(1, 8, 64)
        if not prefill_attention.native_prefill_available(q, k_cache):
            sys.exit(77)
        one = torch.ones(1, dtype=torch.int32)
        out = torch.zeros(1, 8, 64)
        prefill_attention.paged_prefill_attention(q, k_cache, k_cache, table, one, one,
                                                  one - 1, out, 1.0)
        address_space_left_after_this(128 << 20)
        # 2^27 query rows x 8 kv heads: 2^26 tasks, two 256 MiB task lists
        rows = torch.tensor([1 << 27], dtype=torch.int32)
        call = lambda: prefill_attention.paged_prefill_attention(
            q, k_cache, k_cache, table, rows, rows, one - 1, out, 1.0)
    try:
        call()
    except MemoryError as exc:
        print("MemoryError:", exc)
        sys.exit(0)
    sys.exit(3)
""")


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_a_failed_allocation_raises_memory_error(kind, tmp_path):
    """In a child process whose address space is capped: the kernel's scratch allocation fails,
    and it must return an error rather than write through NULL (a segfault: rc -11)."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(root=ROOT))
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True,
                          timeout=120, env=env)
    if proc.returncode == 77:
        pytest.skip("no native kernels here")
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "could not allocate" in proc.stdout


def test_prefill_kernel_refuses_groups_its_stack_buffers_cannot_hold():
    import torch

    from worker.prefill_attention import _lib, native_prefill_available

    if _lib is None:
        pytest.skip("no native kernels here")
    cache = torch.zeros(2, 16, 1, 64)
    assert native_prefill_available(torch.zeros(3, 16, 64), cache)  # 16 heads per kv head
    assert not native_prefill_available(torch.zeros(3, 32, 64), cache)  # 32: the PyTorch path
