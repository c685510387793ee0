"""The decode step's static layout for CUDA graphs (worker/cuda_graphs.py), checked on the CPU:
the same buffers run eagerly give the logits of the ordinary step, at batch sizes between the
captured ones (padded rows) and after a larger step left its rows behind. The captured graphs
themselves are checked on a GPU (tests/test_cuda.py)."""

import numpy as np
import torch

from pipelines.config import PipelineConfig
from pipelines.context import TextContext
from serialization.messages import StepBatch
from worker.cuda_graphs import DecodeGraphs, capture_sizes, is_decode_only
from worker.model_runner import ModelRunner

BLOCK = 16


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]


def _step(ids: list[int], seq_lens: list[int], tables: np.ndarray, sample=None) -> StepBatch:
    n = len(ids)
    return StepBatch(step_id=1, request_ids=[f"r{i}" for i in range(n)],
                     input_ids=np.array(ids, np.int32), query_lens=np.ones(n, np.int32),
                     seq_lens=np.array(seq_lens, np.int32), block_tables=tables,
                     sample=np.ones(n, bool) if sample is None else sample)


def _decode_contexts(ids: list[int], seq_lens: list[int]) -> list[TextContext]:
    """Contexts feeding one token each, `ids[i]` at position seq_lens[i] - 1."""
    contexts = []
    for token, n in zip(ids, seq_lens):
        ctx = TextContext(tokens=np.full(n, token), max_length=n + 1)
        ctx.set_token_indices(start_idx=n - 1)
        contexts.append(ctx)
    return contexts


def test_only_steps_of_one_sampled_token_per_sequence_are_decode_only():
    tables = np.zeros((2, 1), np.int32)
    assert is_decode_only(_step([1, 2], [3, 4], tables))
    assert not is_decode_only(_step([1, 2], [3, 4], tables, sample=np.array([True, False])))
    prefill = StepBatch(step_id=1, request_ids=["a"], input_ids=np.array([1, 2], np.int32),
                        query_lens=np.array([2], np.int32), seq_lens=np.array([2], np.int32),
                        block_tables=tables[:1], sample=np.ones(1, bool))
    assert not is_decode_only(prefill)


def test_static_decode_buffers_give_the_ordinary_steps_logits(untied_tiny_model_dir):
    runner = ModelRunner(PipelineConfig.for_model(
        untied_tiny_model_dir, kv_cache_page_size=BLOCK, kv_cache_memory=8 << 20, max_length=256))
    model, cache = runner.model, runner.kv_cache
    sink = runner.num_blocks - 1  # (never in a table below)
    graphs = DecodeGraphs(model, cache, BLOCK, runner.max_model_len, max_num_seqs=16,
                          sink_block=sink)
    rng = np.random.default_rng(0)
    # 12 sequences with contexts of 5-60 tokens already in the cache (random K/V: the
    # attention reads them the same either way), each owning 4 disjoint blocks.
    cache[:, :, :sink].normal_()
    tables = np.arange(12 * 4, dtype=np.int32).reshape(12, 4)
    for n in (9, 3, 1, 12, 5):  # (3 after 9: rows 3..3 of the padded size are stale)
        seqs = rng.choice(12, n, replace=False)
        lens = rng.integers(5, 60, n)
        width = int(-(-lens.max() // BLOCK))
        table = np.where(np.arange(width)[None, :] < -(-lens[:, None] // BLOCK),
                         tables[seqs, :width], -1).astype(np.int32)
        ids = rng.integers(0, 49152, n).tolist()
        step = _step(ids, lens.tolist(), table)
        static = graphs.run(step, np.array(ids)).clone()
        with torch.inference_mode():
            contexts = _decode_contexts(ids, lens.tolist())
            inputs = model.prepare_initial_token_inputs(
                contexts, kv_cache_inputs=runner.kv_manager.fetch(contexts, table))
            expected = model.execute(inputs).next_token_logits
        assert static.shape == expected.shape == (n, 49152)
        torch.testing.assert_close(static, expected, rtol=1e-5, atol=1e-5)
    # Padded rows wrote only the sink block.
    assert graphs.slots[12:].eq(sink * BLOCK).all()
