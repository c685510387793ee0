"""PipelineModel: the per-architecture model interface of Modular MAX's `max.pipelines`, in the
batched, paged form the server runs. `ModelRunner` drives models only through it.

How MAX's names map here:
- `context_batch` is the scheduler's `StepBatch`: per sequence, the tokens scheduled this step
  (a prefill chunk or one decode token), its length with them, and its KV block table.
- `prepare_initial_token_inputs(step, ...)` gives `ModelInputs`: the flat token ids, the
  attention metadata over the paged cache, the cache, and the rows whose logits are wanted.
- `prepare_next_token_inputs(next_tokens, prev)`: the following decode step of the same
  sequences (one new token each, every length + 1), for multi-step generation.
- `execute(inputs)` gives `ModelOutputs`: `next_token_logits` of the sequences that sample,
  `logits` of every wanted row (those, then prompt rows asked for with echo).
- `compute_log_probabilities(...)`: the sampled tokens' log probabilities and top-n
  alternatives, from the raw logits. Prompt (echo) log probabilities are not here: a prompt's
  rows span prefill chunks, so the runner carries them across steps (worker/logprobs.py).
- MAX's `KVCacheMixin`, the one KV sizing path: `estimate_memory_footprint()` (the bytes this
  worker has for its cache), `estimate_kv_cache_size(available_cache_memory)` (the bytes the
  paged cache takes of them: whole blocks) and `load_kv_manager(session, available_cache_memory)`
  (the cache itself, on the session's device). The runner sets the model's `kv_params` first.
- `release(request_id)`: a request finished; drop whatever the model keeps for it across
  steps (a vision model's image embeddings). Most models keep nothing.

The decoder-only architectures share `PagedCausalLM`, since their inputs are the same; each
architecture's module inherits it and brings its own `forward`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pipelines.checkpoint.model_config import ModelConfig
from serialization.messages import StepBatch, TokenLogprobs
from worker.attention import AttentionMetadata, build_attention_metadata
from worker.device import gpu_kv_cache_budget
from worker.kv_cache import allocate_kv_cache, bytes_per_block, estimate_kv_cache_size
from worker.logprobs import token_logprobs


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64, every scheduled token of every sequence in order
    attention: AttentionMetadata
    kv_cache: torch.Tensor  # [layers, 2, num_blocks, block_size, KVH, D]
    logits_rows: torch.Tensor  # rows of T whose logits are computed: sampled ones first
    num_sampled: int  # how many of logits_rows are sampling sequences' last rows
    # The step's paged layout, kept for `prepare_next_token_inputs`.
    seq_lens: np.ndarray
    block_tables: np.ndarray
    block_size: int

    def to(self, device: torch.device) -> "ModelInputs":
        """The inputs on the model's device (the host arrays stay; nothing moves on a CPU)."""
        if device.type == "cpu":
            return self
        return replace(self, input_ids=self.input_ids.to(device, non_blocking=True),
                       attention=self.attention.to(device),
                       logits_rows=self.logits_rows.to(device, non_blocking=True))


@dataclass
class ModelOutputs:
    next_token_logits: torch.Tensor | None = None  # [num_sampled, V] float32
    logits: torch.Tensor | None = None  # [len(logits_rows), V] float32
    # Requests whose inputs the model could not take (an image that failed to encode), with
    # why: their rows' logits are meaningless and the runner fails them alone.
    failed_requests: dict[str, str] = field(default_factory=dict)

    def to_host(self) -> "ModelOutputs":
        """The logits on the CPU, in one copy (sampling, grammars and log probabilities run
        there); as they are when already there."""
        if self.logits is None or self.logits.device.type == "cpu":
            return self
        logits = self.logits.cpu()
        return ModelOutputs(logits[: len(self.next_token_logits)], logits,
                            self.failed_requests)


@dataclass(frozen=True)
class KVCacheParams:
    """What sizes a model's paged KV cache (MAX's KVCacheParams): the settings and the values
    the runner resolved."""

    dtype: torch.dtype
    page_size: int  # tokens per block
    max_length: int  # the longest sequence
    max_batch_size: int  # (caps the default CPU cache: that many full-length sequences)
    max_batch_input_tokens: int  # (a GPU's profiling step)
    memory: int | None  # --kv-cache-memory, the whole cache's; None: from the device
    gpu_memory_utilization: float
    shard: ModelConfig  # this rank's part of the checkpoint's config
    whole: ModelConfig  # the checkpoint's (the ranks split its cache by heads)
    largest_shard: ModelConfig  # rank 0's part, which holds the most heads


class KVCacheMixin:
    """MAX's KVCacheMixin over the paged cache of worker/kv_cache.py, on a model whose
    `kv_params` and `session` (its torch device) are set."""

    kv_params: KVCacheParams
    session: torch.device

    @property
    def kv_block_bytes(self) -> int:
        p = self.kv_params
        return bytes_per_block(p.shard, p.dtype, p.page_size)

    def estimate_memory_footprint(self) -> int:
        """The bytes this worker has for its KV cache. On a GPU: --kv-cache-memory, or what
        --gpu-memory-utilization leaves after the weights and a profiling forward. On the CPU:
        --kv-cache-memory, or a share of the free RAM, at most what max_batch_size full-length
        sequences need. Split over ranks, each holds its heads' part of the cache the whole
        model would have, with the block count of the rank holding the most heads."""
        p = self.kv_params
        if self.session.type == "cuda" and p.memory is None:
            return gpu_kv_cache_budget(self.session, p.gpu_memory_utilization,
                                       self._profile_forward)
        blocks = estimate_kv_cache_size(p.whole, p.dtype, p.page_size, p.max_length,
                                        p.max_batch_size, p.memory)
        if p.shard is p.whole:
            return blocks * self.kv_block_bytes
        return blocks * bytes_per_block(p.largest_shard, p.dtype, p.page_size)

    def estimate_kv_cache_size(self, available_cache_memory: int) -> int:
        """The bytes the paged cache takes of `available_cache_memory`: whole blocks."""
        per_block = self.kv_block_bytes
        return available_cache_memory // per_block * per_block

    def load_kv_manager(self, session: torch.device,
                        available_cache_memory: int) -> torch.Tensor:
        """The paged cache, as many blocks as `available_cache_memory` holds, on `session`
        (the torch device standing in for MAX's InferenceSession)."""
        p = self.kv_params
        return allocate_kv_cache(p.shard, p.dtype,
                                 self.estimate_kv_cache_size(available_cache_memory)
                                 // self.kv_block_bytes, p.page_size, session)

    def _profile_forward(self) -> None:
        """The largest step's forward (a full max_batch_input_tokens chunk with logits for
        max_batch_size rows), over a scratch cache, for its peak activation memory."""
        p = self.kv_params
        tokens = min(p.max_batch_input_tokens, p.max_length)
        blocks = -(-tokens // p.page_size)
        scratch = allocate_kv_cache(p.shard, p.dtype, blocks, p.page_size, self.session)
        step = StepBatch(step_id=-1, request_ids=["profile"],
                         input_ids=np.zeros(tokens, np.int32),
                         query_lens=np.array([tokens], np.int32),
                         seq_lens=np.array([tokens], np.int32),
                         block_tables=np.arange(blocks, dtype=np.int32)[None, :],
                         sample=np.array([True]))
        rows = torch.arange(tokens - min(tokens, p.max_batch_size), tokens)
        inputs = self.prepare_initial_token_inputs(
            step, torch.zeros(tokens, dtype=torch.long), rows, len(rows), scratch,
            p.page_size).to(self.session)
        with torch.inference_mode():
            self.execute(inputs)
        del scratch


class PipelineModel(KVCacheMixin, ABC):
    """What the runner asks of an architecture (MAX's `PipelineModel`)."""

    @abstractmethod
    def prepare_initial_token_inputs(self, step: StepBatch, input_ids: torch.Tensor,
                                     logits_rows: torch.Tensor, num_sampled: int,
                                     kv_cache: torch.Tensor, block_size: int) -> ModelInputs: ...

    @abstractmethod
    def prepare_next_token_inputs(self, next_tokens: torch.Tensor,
                                  prev_model_inputs: ModelInputs) -> ModelInputs: ...

    @abstractmethod
    def execute(self, model_inputs: ModelInputs) -> ModelOutputs: ...

    @abstractmethod
    def compute_log_probabilities(self, model_inputs: ModelInputs, model_outputs: ModelOutputs,
                                  next_tokens: torch.Tensor,
                                  batch_top_n: list[int]) -> TokenLogprobs | None: ...

    def release(self, request_id: str) -> None:  # noqa: B027 (a hook: most models keep none)
        """Forget per-request state kept across steps (none by default)."""


class PagedCausalLM(PipelineModel):
    """PipelineModel for a decoder-only module whose `forward(input_ids, meta, kv_cache,
    logits_rows)` returns float32 logits of the wanted rows (Llama family, Gemma 3)."""

    def prepare_initial_token_inputs(self, step, input_ids, logits_rows, num_sampled, kv_cache,
                                     block_size):
        meta = build_attention_metadata(step.query_lens, step.seq_lens, step.block_tables,
                                        block_size)
        return ModelInputs(input_ids, meta, kv_cache, logits_rows, num_sampled,
                           step.seq_lens, step.block_tables, block_size)

    def prepare_next_token_inputs(self, next_tokens, prev_model_inputs):
        prev = prev_model_inputs
        seq_lens = prev.seq_lens.astype(np.int64) + 1
        tables = prev.block_tables
        needed = -(-seq_lens // prev.block_size)
        if (needed > tables.shape[1]).any() or (tables[np.arange(len(seq_lens)), needed - 1] < 0).any():
            raise ValueError("a sequence's next token needs a KV block its table does not have")
        n = len(seq_lens)
        meta = build_attention_metadata(np.ones(n, dtype=np.int64), seq_lens, tables,
                                        prev.block_size)
        return ModelInputs(next_tokens.reshape(-1).long(), meta, prev.kv_cache,
                           torch.arange(n), n, seq_lens, tables, prev.block_size)

    def execute(self, model_inputs):
        m = model_inputs
        logits = self(m.input_ids, m.attention, m.kv_cache, m.logits_rows)
        return ModelOutputs(next_token_logits=logits[: m.num_sampled], logits=logits)

    def compute_log_probabilities(self, model_inputs, model_outputs, next_tokens, batch_top_n):
        rows = [i for i, n in enumerate(batch_top_n) if n > 0]
        if not rows:
            return None
        return token_logprobs(model_outputs.next_token_logits[rows], next_tokens[rows],
                              max(batch_top_n))
