"""MAX's `max.pipelines.pipeline`: the model contract. `PipelineModel` is what an architecture
implements and the worker's ModelRunner drives; a user's own model (--custom-architectures)
imports only from here. (Imports torch: `pipelines/__init__.py` does not import it, so the API
process never pays for it.)

- `PipelineModel(pipeline_config, session)`: the whole configuration and the torch device
  standing in for MAX's InferenceSession.
- `prepare_initial_token_inputs(context_batch, kv_cache_inputs, return_n_logits)`: the inputs
  of one step, each TextContext feeding its window start_idx..active_idx (a prefill chunk, or
  the one token to decode); `prepare_next_token_inputs(next_tokens, prev)`: the following
  decode step of the same contexts, for multi-step generation.
- `execute(inputs) -> ModelOutputs`: `next_token_logits`, one row per context (its last), and
  `logits` of every row when asked (echo).
- `compute_log_probabilities(...)`: per context, the sampled token's log probabilities and
  top-n alternatives from the raw logits (and its window's with echo). A prompt's rows span
  prefill chunks, so the runner carries prompt log probabilities across steps itself
  (worker/logprobs.py).
- `KVCacheMixin`, the one KV sizing path: `estimate_memory_footprint()` (the bytes this worker
  has for its cache), `estimate_kv_cache_size(available_cache_memory)` (the bytes the paged
  cache takes of them: whole blocks) and `load_kv_manager(session, available_cache_memory)`
  (the `PagedKVCacheManager` on the session's device). The runner sets `kv_params` first.
  The manager's `fetch(context_batch, block_tables)` gives the step's `KVCacheInputs`, whose
  `attend(layer_idx, q, k, v)` is Loom's paged attention for a model's attention layers.
- `release(request_id)`: a request finished; drop whatever the model keeps for it across
  steps (a vision model's image embeddings). Most models keep nothing.

Loom's decoder-only architectures share `PagedCausalLM` (worker/models/), whose decode steps
run the fused native step or CUDA graphs inside the same contract.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import torch

from pipelines.checkpoint.gguf_file import dequantize, open_gguf
from pipelines.checkpoint.gguf_tokenizer import is_gguf
from pipelines.checkpoint.model_config import (
    ModelConfig,
    load_model_config,
    resolve_max_model_len,
)
from pipelines.config import PipelineConfig
from pipelines.context import TextContext
from pipelines.response import LogProbabilities
from pipelines.status import PipelineTask
from worker.attention import (
    AttentionMetadata,
    build_attention_metadata,
    paged_attention,
    store_kv,
)
from worker.device import gpu_kv_cache_budget
from worker.kv_cache import allocate_kv_cache, bytes_per_block, estimate_kv_cache_size
from worker.logprobs import token_logprobs
from worker.weights import load_checkpoint_weights

__all__ = [
    "KVCacheInputs",
    "KVCacheMixin",
    "ModelInputs",
    "ModelOutputs",
    "PagedKVCacheManager",
    "PipelineModel",
    "SupportedArchitecture",
    "hf_config",
    "load_weights",
]


class ModelInputs:
    """What `prepare_*_token_inputs` give `execute` (MAX's ModelInputs): a model's own fields,
    and the KV cache inputs of the batch when it has a cache. The default
    `compute_log_probabilities` reads `kv_cache_inputs` for echo."""

    kv_cache_inputs: KVCacheInputs | None  # (set it; a model without a cache need not)


@dataclass
class KVCacheInputs:
    """What the KV manager hands a model for one batch (MAX's kv_cache_inputs): the paged
    cache and where each context's fed tokens go in it. `attend` is all a model's attention
    layer needs: it stores the fed tokens' K/V and attends over each sequence's blocks."""

    kv_cache: torch.Tensor  # [layers, 2, num_blocks, page_size, kv_heads, head_dim]
    attention: AttentionMetadata  # built once per batch, shared by every layer
    seq_lens: np.ndarray  # each context's length with the tokens fed now (its active_idx)
    query_lens: np.ndarray  # the tokens fed now (its active_idx - start_idx)
    block_tables: np.ndarray  # [contexts, blocks] the scheduler's, -1 padded
    page_size: int
    context_batch: Sequence[TextContext] = ()  # (the default echo log probabilities read them)

    @property
    def positions(self) -> torch.Tensor:
        """[T] int64: each fed token's position in its sequence."""
        return self.attention.positions

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] of the fed tokens (rotary applied): stores k/v in
        layer `layer_idx`'s cache and returns causal attention [T, H, D] of each query over
        its sequence's cached and new tokens (grouped-query attention when KVH < H)."""
        k_cache, v_cache = self.kv_cache[layer_idx, 0], self.kv_cache[layer_idx, 1]
        store_kv(k, v, k_cache, v_cache, self.attention.slot_mapping)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return paged_attention(q, k, v, k_cache, v_cache, self.attention, scale)

    def next_step(self) -> KVCacheInputs:
        """The same contexts one token further, each feeding one (the token it sampled):
        the cache inputs of `prepare_next_token_inputs`. Raises if a context's next token
        needs a block its table does not have."""
        seq_lens = self.seq_lens.astype(np.int64) + 1
        needed = -(-seq_lens // self.page_size)
        tables = self.block_tables
        if (needed > tables.shape[1]).any() or (tables[np.arange(len(seq_lens)), needed - 1] < 0).any():
            raise ValueError("a sequence's next token needs a KV block its table does not have")
        ones = np.ones_like(seq_lens)
        meta = build_attention_metadata(ones, seq_lens, tables, self.page_size)
        return KVCacheInputs(self.kv_cache, meta, seq_lens, ones, tables,
                             self.page_size).to(self.kv_cache.device)

    def to(self, device: torch.device) -> KVCacheInputs:
        """The attention metadata on the cache's device (built on the host)."""
        if device.type == "cpu":
            return self
        return replace(self, attention=self.attention.to(device))


@dataclass
class PagedModelInputs(ModelInputs):
    """Loom's built-in models' inputs: the flat token ids of the batch, its cache inputs, and
    the rows whose logits are computed. The runner narrows those rows (`narrow`) to the ones
    it reads: the sampling contexts' last rows, then prompt rows asked for with echo."""

    input_ids: torch.Tensor  # [T] int64, every fed token of every context in order
    kv_cache_inputs: KVCacheInputs
    logits_rows: torch.Tensor  # rows of T whose logits are computed: next-token rows first
    num_sampled: int  # how many of logits_rows are next_token_logits

    @property
    def attention(self) -> AttentionMetadata:
        return self.kv_cache_inputs.attention

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.kv_cache_inputs.kv_cache

    @property
    def seq_lens(self) -> np.ndarray:
        return self.kv_cache_inputs.seq_lens

    @property
    def query_lens(self) -> np.ndarray:
        return self.kv_cache_inputs.query_lens

    def narrow(self, rows: np.ndarray, num_sampled: int) -> None:
        """Compute the logits of `rows` only, the first `num_sampled` as next_token_logits."""
        self.logits_rows = torch.from_numpy(rows).to(self.input_ids.device, non_blocking=True)
        self.num_sampled = num_sampled


# A decode step reads every row's logits. Its logits_rows are then one tensor per row count,
# 0..T-1 on the CPU, which a model's forward tells by identity (`selected_rows`): it skips the
# gather, and the inputs skip making the rows. Each was a torch call of ~0.05-0.1 ms in a
# small model's step (its weights have just streamed every cache out: cold code and data).
_EVERY_ROW: dict[int, torch.Tensor] = {}


def every_row(count: int) -> torch.Tensor:
    """Rows 0..count-1 (int64, CPU), the same tensor for every call with `count`; nothing
    may write it."""
    rows = _EVERY_ROW.get(count)
    if rows is None:
        with torch.inference_mode(False):  # (a normal tensor: any forward may read it)
            rows = _EVERY_ROW[count] = torch.arange(count)
    return rows


def selected_rows(hidden: torch.Tensor, logits_rows: torch.Tensor) -> torch.Tensor:
    """hidden[logits_rows]: `hidden` itself where they are its every row (`every_row`)."""
    return hidden if logits_rows is _EVERY_ROW.get(len(hidden)) else hidden[logits_rows]


class PagedKVCacheManager:
    """The paged KV cache a model's `load_kv_manager` gives (MAX's KVCacheManager). Its blocks
    are the scheduler's to hand out: `fetch` takes the block tables it chose."""

    def __init__(self, cache: torch.Tensor, page_size: int) -> None:
        self.cache = cache
        self.device = cache.device
        self.page_size = page_size
        self.num_blocks = cache.shape[2]

    def fetch(self, context_batch: Sequence[TextContext],
              block_tables: np.ndarray) -> KVCacheInputs:
        """The batch's cache inputs: each context feeds its window start_idx..active_idx,
        its sequence then active_idx long, over its row of `block_tables`."""
        seq_lens = np.fromiter((ctx.active_idx for ctx in context_batch), np.int64,
                               len(context_batch))
        query_lens = seq_lens - np.fromiter((ctx.start_idx for ctx in context_batch),
                                            np.int64, len(context_batch))
        return self.inputs(seq_lens, query_lens, block_tables, context_batch)

    def inputs(self, seq_lens: np.ndarray, query_lens: np.ndarray, block_tables: np.ndarray,
               context_batch: Sequence[TextContext] = ()) -> KVCacheInputs:
        """The cache inputs of windows given as lengths (what `fetch` reads off contexts)."""
        meta = build_attention_metadata(query_lens, seq_lens, block_tables, self.page_size)
        return KVCacheInputs(self.cache, meta, seq_lens, query_lens, block_tables,
                             self.page_size, context_batch).to(self.device)


@dataclass
class ModelOutputs:
    next_token_logits: torch.Tensor | None = None  # [contexts, V] float32: each one's last row
    logits: torch.Tensor | None = None  # [T, V] float32: every row, when asked (echo)
    # Requests whose inputs the model could not take (an image that failed to encode), with
    # why: their rows' logits are meaningless and the runner fails them alone.
    failed_requests: dict[str, str] = field(default_factory=dict)

    def to_host(self) -> ModelOutputs:
        """The logits on the CPU (sampling, grammars and log probabilities run there)."""
        first, every = self.next_token_logits, self.logits
        if (first is None or first.is_cpu) and (every is None or every.is_cpu):
            return self
        return ModelOutputs(first.cpu() if first is not None else None,
                            every.cpu() if every is not None else None, self.failed_requests)


@dataclass(frozen=True)
class SupportedArchitecture:
    """A model class and the checkpoints it serves (MAX's SupportedArchitecture): those whose
    config.json `architectures[0]` is `name`. A package lists its own in `ARCHITECTURES`."""

    name: str
    pipeline_model: type[PipelineModel]
    task: PipelineTask = PipelineTask.TEXT_GENERATION


def load_weights(path: str) -> dict[str, torch.Tensor]:
    """A checkpoint's weights by their Hugging Face names (a GGUF file's widened to float32)."""
    if is_gguf(path):
        return {name: dequantize(t) for name, t in open_gguf(path).tensors.items()}
    return load_checkpoint_weights(path)


def hf_config(path: str) -> ModelConfig:
    """A checkpoint's config.json (or GGUF header), as transformers' names."""
    return load_model_config(path)


def checkpoint_config(pipeline_config: PipelineConfig, shard=None) -> tuple[ModelConfig, int]:
    """A Loom model's config (this tensor-parallel rank's part, with `shard`, a
    worker.tensor_parallel.ShardPlan) and its rotary tables' length, the resolved max_length."""
    config = hf_config(pipeline_config.model_config.model_path)
    max_positions = resolve_max_model_len(config, pipeline_config.model_config.max_length)
    return (shard.config(config) if shard is not None else config), max_positions


def log_probabilities(logits: torch.Tensor, tokens: torch.Tensor,
                      top_n: int) -> LogProbabilities:
    """Each row's `tokens` log probability and its `top_n` likeliest tokens', from raw
    logits [n, V]."""
    lp = token_logprobs(logits, tokens, top_n)
    return LogProbabilities(
        lp.token_logprobs.tolist(),
        [dict(zip(ids, values)) for ids, values in zip(lp.top_token_ids.tolist(),
                                                       lp.top_logprobs.tolist())])


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
                        available_cache_memory: int) -> PagedKVCacheManager:
        """The paged cache, as many blocks as `available_cache_memory` holds, on `session`
        (the torch device standing in for MAX's InferenceSession)."""
        p = self.kv_params
        cache = allocate_kv_cache(p.shard, p.dtype,
                                  self.estimate_kv_cache_size(available_cache_memory)
                                  // self.kv_block_bytes, p.page_size, session)
        return PagedKVCacheManager(cache, p.page_size)

    def _profile_forward(self) -> None:
        """The largest step's forward (a full max_batch_input_tokens chunk with logits for
        max_batch_size rows), over a scratch cache, for its peak activation memory."""
        p = self.kv_params
        tokens = min(p.max_batch_input_tokens, p.max_length)
        blocks = -(-tokens // p.page_size)
        scratch = PagedKVCacheManager(
            allocate_kv_cache(p.shard, p.dtype, blocks, p.page_size, self.session), p.page_size)
        ctx = TextContext(tokens=np.zeros(tokens, np.int64), max_length=p.max_length)
        kv = scratch.fetch([ctx], np.arange(blocks, dtype=np.int32)[None, :])
        inputs = self.prepare_initial_token_inputs([ctx], kv_cache_inputs=kv)
        if isinstance(inputs, PagedModelInputs):  # (as many rows as a step samples at most)
            inputs.narrow(np.arange(tokens - min(tokens, p.max_batch_size), tokens), 1)
        with torch.inference_mode():
            self.execute(inputs)
        del scratch, kv, inputs


class PipelineModel(KVCacheMixin, ABC):
    """What the runner asks of an architecture (MAX's `PipelineModel`), built as
    `cls(pipeline_config, session)`: the whole configuration, and the torch device standing
    in for MAX's InferenceSession. The model reads its checkpoint from
    `pipeline_config.model_config.model_path` (`load_weights`, `hf_config`)."""

    # Whether `--tensor-parallel-size` may split it: its row-parallel projections all-reduce
    # (worker/tensor_parallel.py). A property of the class, as MAX's architectures declare it.
    supports_tensor_parallel: ClassVar[bool] = False

    def __init__(self, pipeline_config: PipelineConfig, session: torch.device) -> None:
        self.pipeline_config = pipeline_config
        self.session = session

    @abstractmethod
    def prepare_initial_token_inputs(self, context_batch: Sequence[TextContext],
                                     kv_cache_inputs: KVCacheInputs | None = None,
                                     return_n_logits: int = 1) -> ModelInputs:
        """The inputs of one step of `context_batch`, each context feeding its window
        start_idx..active_idx. `return_n_logits`: 1, each context's last row
        (`next_token_logits`); -1, every row too (`logits`, for echo); 0, none."""

    @abstractmethod
    def prepare_next_token_inputs(self, next_tokens: torch.Tensor,
                                  prev_model_inputs: ModelInputs) -> ModelInputs:
        """The following decode step of the same contexts: one new token each."""

    @abstractmethod
    def execute(self, model_inputs: ModelInputs) -> ModelOutputs: ...

    def compute_log_probabilities(self, model_inputs: ModelInputs, model_outputs: ModelOutputs,
                                  next_tokens: torch.Tensor, batch_top_n: list[int],
                                  batch_echo: list[bool]) -> list[LogProbabilities | None] | None:
        """Per context, the log probabilities of its sampled token (`next_tokens`) and its
        `batch_top_n` likeliest alternatives, from the raw `next_token_logits`; with
        `batch_echo`, first those of its window's tokens after the first, from `logits`
        (each row predicts the next token). None where top_n is 0; None if all are."""
        if not any(batch_top_n):
            return None
        logits = model_outputs.next_token_logits
        kv = getattr(model_inputs, "kv_cache_inputs", None) if any(batch_echo) else None
        if any(batch_echo) and (kv is None or model_outputs.logits is None):
            raise ValueError("echo log probabilities need the model inputs' kv_cache_inputs "
                             "and every row's logits (return_n_logits=-1)")
        first_rows = np.cumsum(kv.query_lens) - kv.query_lens if kv is not None else None
        results: list[LogProbabilities | None] = []
        for i, (n, echo) in enumerate(zip(batch_top_n, batch_echo)):
            if not n:
                results.append(None)
                continue
            rows, tokens = logits[i : i + 1], next_tokens[i : i + 1]
            if echo:
                ctx, first = kv.context_batch[i], int(first_rows[i])
                fed = torch.from_numpy(ctx.tokens[ctx.start_idx + 1 : ctx.active_idx])
                rows = torch.cat([model_outputs.logits[first : first + len(fed)], rows])
                tokens = torch.cat([fed.to(tokens.dtype), tokens])
            results.append(log_probabilities(rows, tokens, n))
        return results

    def release(self, request_id: str) -> None:  # noqa: B027 (a hook: most models keep none)
        """Forget per-request state kept across steps (none by default)."""


def _decodes_only(meta: AttentionMetadata) -> bool:
    """Whether the step's sequences all feed one token (one group, of single queries)."""
    return len(meta.groups) == 1 and meta.groups[0].single_query


class PagedCausalLM(PipelineModel):
    """PipelineModel for Loom's decoder-only modules, whose `forward(input_ids, meta,
    kv_cache, logits_rows)` returns float32 logits of the wanted rows (Llama family, Gemma 3;
    the vision-language models add their images). Their decode steps run the fused native
    step (or replay CUDA graphs, worker/cuda_graphs.py) under the same contract."""

    def prepare_initial_token_inputs(self, context_batch, kv_cache_inputs=None,
                                     return_n_logits=1):
        if kv_cache_inputs is None:
            raise ValueError(f"{type(self).__name__} runs over the paged KV cache: pass the "
                             f"KV manager's kv_cache_inputs")
        ids = np.concatenate([ctx.next_tokens for ctx in context_batch])
        input_ids = torch.from_numpy(ids).to(self.session, non_blocking=True)
        q = kv_cache_inputs.query_lens
        if return_n_logits == 1 and len(ids) == len(context_batch) \
                and self.session.type == "cpu" and _decodes_only(kv_cache_inputs.attention):
            # (every context feeds one token: each row is a context's last, in order)
            return PagedModelInputs(input_ids, kv_cache_inputs, every_row(len(ids)), len(ids))
        last = np.cumsum(q) - 1
        if return_n_logits == -1:
            rows = np.concatenate([last, np.arange(int(q.sum()))])
        else:
            rows = last if return_n_logits else last[:0]
        inputs = PagedModelInputs(input_ids, kv_cache_inputs, torch.empty(0), len(last))
        inputs.narrow(rows, len(last) if return_n_logits else 0)
        return inputs

    def prepare_next_token_inputs(self, next_tokens, prev_model_inputs):
        prev = prev_model_inputs.kv_cache_inputs
        seq_lens = prev.seq_lens.astype(np.int64) + 1
        tables = prev.block_tables
        needed = -(-seq_lens // prev.page_size)
        if (needed > tables.shape[1]).any() or (tables[np.arange(len(seq_lens)), needed - 1] < 0).any():
            raise ValueError("a sequence's next token needs a KV block its table does not have")
        n = len(seq_lens)
        kv = PagedKVCacheManager(prev.kv_cache, prev.page_size).inputs(
            seq_lens, np.ones(n, dtype=np.int64), tables)
        return PagedModelInputs(next_tokens.reshape(-1).long(), kv,
                                torch.arange(n, device=next_tokens.device), n)

    def execute(self, model_inputs):
        m = model_inputs
        logits = self(m.input_ids, m.attention, m.kv_cache, m.logits_rows)
        # (The rows after the next-token ones: every row with return_n_logits=-1, the echo
        # rows once the runner narrowed them.)
        if len(logits) == m.num_sampled:  # (every decode step: no slicing)
            return ModelOutputs(next_token_logits=logits)
        rest = logits[m.num_sampled :] if len(logits) > m.num_sampled else None
        return ModelOutputs(next_token_logits=logits[: m.num_sampled], logits=rest)
