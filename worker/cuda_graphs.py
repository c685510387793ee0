"""CUDA graphs of the decode-only step: the whole forward replayed as one launch.

A decode step of a 1B model is a few hundred small kernels; launched one by one from Python
the GPU waits on the host between them, and at batch 1 the step takes several times the time
of reading the weights once. A captured graph replays them all without the host (vLLM V1 and
SGLang do the same).

A graph fixes its shapes and addresses, so the inputs live in static device buffers and a
graph is captured per batch size in `capture_sizes` (1, 2, 4, 8, then every 8 up to
max_num_seqs); a step of n sequences replays the smallest graph of at least n rows, the rows
past n padded. Padded rows are sequences of one token in a block no request owns (the cache
gets one block more than the scheduler knows of, `SINK_BLOCKS`): they write their K/V there
and attend to it alone, and their logits are dropped. Block tables are as wide as
max_model_len needs; the Triton decode kernel reads only the blocks below each sequence's
length, so the columns past a step's table are never read.

Only steps where every sequence decodes one token, with no prompt log probabilities to
return, replay a graph; prefill chunks and mixed steps run eagerly. Architectures whose
forward is free of host synchronisation and data-dependent shapes are captured
(`GRAPH_SAFE_ARCHITECTURES`: Gemma 3's sliding-window metadata is built on the host per
step), on one GPU (tensor-parallel ranks run eagerly).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from serialization.messages import StepBatch
from worker.attention import AttentionGroup, AttentionMetadata

logger = logging.getLogger(__name__)

GRAPH_SAFE_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                            "Qwen3ForCausalLM"}
SINK_BLOCKS = 1  # KV blocks past the scheduler's, written by padded rows only


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to max_num_seqs (which is last)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def is_decode_only(step: StepBatch) -> bool:
    """Every sequence of the step feeds exactly one token and samples."""
    n = len(step.request_ids)
    return n > 0 and len(step.input_ids) == n and bool(np.all(step.sample))


class DecodeGraphs:
    """The model's decode-only forward over static buffers, one CUDA graph per batch size.

    `run(step, input_ids)` fills the buffers and replays (or, with capture off, calls the
    model on the same buffers: how the CPU tests check the padding and the static layout).
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
                 max_model_len: int, max_num_seqs: int, sink_block: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sizes = capture_sizes(max_num_seqs)
        self.sink_block = sink_block
        device = kv_cache.device
        rows, width = self.sizes[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), sink_block * block_size, dtype=torch.long,
                                device=device)
        self.block_tables = torch.full((rows, width), sink_block, dtype=torch.int32,
                                       device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def fits(self, step: StepBatch) -> bool:
        return is_decode_only(step) and len(step.request_ids) <= self.sizes[-1]

    def _metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata over the buffers' first `size` rows (the decode group the
        Triton kernel reads: rows, tables, lengths; the mask is the PyTorch path's and unused)."""
        device = self.input_ids.device
        rows = torch.arange(size, device=device)
        group = AttentionGroup(
            query_index=rows[:, None], query_valid=torch.ones(size, 1, dtype=torch.bool,
                                                              device=device),
            valid_rows=rows, block_tables=self.block_tables[:size],
            mask=torch.ones(size, 1, 1, 1, dtype=torch.bool, device=device),
            single_query=True, seq_lens=self.seq_lens[:size],
            q_lens=torch.ones(size, dtype=torch.int32, device=device),
            first_rows=rows.to(torch.int32), fresh=False)
        return AttentionMetadata(self.positions[:size], self.slots[:size], [group])

    def _forward(self, size: int) -> torch.Tensor:
        rows = torch.arange(size, device=self.input_ids.device)
        return self.model(self.input_ids[:size], self._metadata(size), self.kv_cache, rows)

    def capture(self) -> None:
        """Capture a graph per size, the largest first, all in one memory pool (a step
        replays one graph at a time, so their activations may share memory). Each size runs
        twice eagerly first (Triton's compilation, cuBLAS's workspaces: outside the graph)."""
        started = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode():
            for size in reversed(self.sizes):
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._forward(size)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(size)
                self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("CUDA graphs of the decode step captured for batch sizes %s in %.1fs",
                    ",".join(map(str, self.sizes)), time.monotonic() - started)

    def run(self, step: StepBatch, input_ids: np.ndarray) -> torch.Tensor:
        """The logits [n, V] of a decode-only step of n sequences (float32, on the device;
        valid until the next run)."""
        n = len(step.request_ids)
        size = next(s for s in self.sizes if s >= n)
        seq_lens = step.seq_lens.astype(np.int64)
        positions = seq_lens - 1
        tables = step.block_tables
        slots = tables[np.arange(n), positions // self.block_size].astype(np.int64) \
            * self.block_size + positions % self.block_size
        # Rows n..size: padding, reset each time (an earlier, larger step left its rows).
        host = np.empty((4, size), np.int64)
        host[0, :n], host[0, n:] = input_ids, 0
        host[1, :n], host[1, n:] = positions, 0
        host[2, :n], host[2, n:] = slots, self.sink_block * self.block_size
        host[3, :n], host[3, n:] = seq_lens, 1
        packed = torch.from_numpy(host).to(self.input_ids.device, non_blocking=True)
        self.input_ids[:size].copy_(packed[0])
        self.positions[:size].copy_(packed[1])
        self.slots[:size].copy_(packed[2])
        self.seq_lens[:size].copy_(packed[3])
        # (Columns past the static width are padding: no sequence is longer than it.)
        width = min(tables.shape[1], self.block_tables.shape[1])
        table_rows = np.empty((size, width), np.int32)
        table_rows[:n] = tables[:, :width]
        table_rows[n:] = self.sink_block
        self.block_tables[:size, :width].copy_(
            torch.from_numpy(table_rows).to(self.input_ids.device, non_blocking=True))
        graph = self.graphs.get(size)
        if graph is None:  # (capture off: the same buffers, run eagerly)
            with torch.inference_mode():
                return self._forward(size)[:n]
        graph.replay()
        return self.outputs[size][:n]
