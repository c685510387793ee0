"""Tensor parallelism: one model split over several worker processes (`--tensor-parallel-size`).

Megatron's split, as vLLM and SGLang do it. Each rank holds a contiguous run of key/value head
groups (with their query heads) and a contiguous slice of the MLP's intermediate columns:
- q/k/v and gate/up are column-parallel: a rank computes its own heads and columns, alone;
- o_proj and down_proj are row-parallel: a rank multiplies its heads' (columns') part of the
  input by the matching columns of the weight, and one all-reduce sums the parts over ranks.
So a layer costs two all-reduces of [tokens, hidden]. The embedding table, the norms and the LM
head are replicated: after each all-reduce every rank holds the whole hidden state. The KV
cache is split by heads with it: every rank caches its own key/value heads under the same block
ids (the scheduler's block tables are the same for all ranks).

Splits may be uneven (SmolLM2 has 3 key/value heads: two ranks hold 2 and 1; its 1536 MLP
columns split 768/768); a sum over ranks does not mind. A rank needs at least one key/value
head, so the size is at most the model's key/value head count.

Only rank 0 samples: the others run the same forward passes and take rank 0's sampled tokens by
a broadcast (a later step's FUTURE_TOKEN inputs are those tokens on every rank).

The process group is gloo on CPUs and NCCL between GPUs (rank r on GPU r), rendezvous through
a file in the server's private IPC directory, gloo's connections on the loopback interface.
On CPUs the layers' all-reduces go through shared memory instead (worker/shm_allreduce.py):
gloo's loopback TCP took 285 us each for one token.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from pipelines.checkpoint.gguf_file import GGUFTensor
from pipelines.checkpoint.model_config import ModelConfig, check_tensor_parallel_size
from worker import shm_allreduce
from worker.shm_allreduce import SharedMemoryAllReduce

logger = logging.getLogger(__name__)

# Long enough for the slowest rank to load its weights before the first collective.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)

_world_size = 1  # of the process group this process joined (1: not split, no collectives)
_device = torch.device("cpu")  # where the group's collectives take their tensors
_rank = 0
_rendezvous_file = ""
_shared: SharedMemoryAllReduce | None = None  # CPU ranks: the all-reduce through shared memory


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `size` holds: head and column index ranges of the whole model."""

    rank: int
    size: int
    kv_heads: range
    heads: range
    intermediate: range

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int, size: int) -> "ShardPlan":
        check_tensor_parallel_size(config, size)
        kv = config.num_key_value_heads
        group = config.num_attention_heads // kv
        kv_heads = even_share(kv, size, rank)
        return cls(rank, size, kv_heads,
                   range(kv_heads.start * group, kv_heads.stop * group),
                   even_share(config.intermediate_size, size, rank))

    def config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's shard: its heads and columns (head_dim is explicit)."""
        return replace(config, num_attention_heads=len(self.heads),
                       num_key_value_heads=len(self.kv_heads),
                       intermediate_size=len(self.intermediate))


def even_share(n: int, parts: int, index: int) -> range:
    """Part `index` of range(n) cut into `parts` contiguous runs differing by at most one, the
    longer ones first (so rank 0 holds the largest shard)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def shard_hf_weights(weights: dict, config: ModelConfig, plan: ShardPlan) -> dict:
    """This rank's part of a Hugging Face state dict (names as transformers' Llama, Qwen2/3,
    Mistral and Gemma 3 use them), of torch tensors or of GGUF blocks (GGUFTensor: a block
    format splits by whole rows, and by columns at multiples of its block's width). A
    row-parallel bias is kept by rank 0 only: the all-reduce would add it once per rank."""
    d = config.head_dim
    heads = slice(plan.heads.start * d, plan.heads.stop * d)
    kv = slice(plan.kv_heads.start * d, plan.kv_heads.stop * d)
    mlp = slice(plan.intermediate.start, plan.intermediate.stop)
    rows = {"self_attn.q_proj": heads, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
            "mlp.gate_proj": mlp, "mlp.up_proj": mlp}
    columns = {"self_attn.o_proj": heads, "mlp.down_proj": mlp}
    out = {}
    for name, tensor in weights.items():
        module, _, kind = name.rpartition(".")
        part = module.rpartition("layers.")[2].partition(".")[2]  # "self_attn.q_proj", ...
        if isinstance(tensor, GGUFTensor):
            out[name] = _shard_blocks(name, tensor, rows.get(part), columns.get(part),
                                      kind == "weight", plan.rank)
            continue
        if part in rows:
            tensor = tensor[rows[part]]
        elif part in columns and kind == "weight":
            tensor = tensor[:, columns[part]]
        elif part in columns and plan.rank != 0:  # a row-parallel bias
            tensor = torch.zeros_like(tensor)
        out[name] = tensor.contiguous()
    return out


def _shard_blocks(name: str, t: GGUFTensor, rows: slice | None, columns: slice | None,
                  is_weight: bool, rank: int) -> GGUFTensor:
    """A GGUF tensor's part: its data is [rows, row bytes] for a block format, the values
    otherwise."""
    if rows is not None:
        return GGUFTensor(t.qtype, (rows.stop - rows.start, *t.shape[1:]), t.data[rows])
    if columns is None:
        return t
    if not is_weight:  # a row-parallel bias: rank 0's alone
        return t if rank == 0 else GGUFTensor(t.qtype, t.shape, np.zeros_like(t.data))
    width = columns.stop - columns.start
    if not t.is_quantized:
        return GGUFTensor(t.qtype, (t.shape[0], width),
                          np.ascontiguousarray(t.data[:, columns]))
    per_block, block_bytes = block_geometry(t.qtype)
    if columns.start % per_block or columns.stop % per_block:
        raise ValueError(f"--tensor-parallel-size: {name} is stored in {t.qtype} blocks of "
                         f"{per_block} columns, which this split would cut (at column "
                         f"{columns.start if columns.start % per_block else columns.stop}); "
                         f"pass --dtype float32 to split its widened weights")
    cut = slice(columns.start // per_block * block_bytes, columns.stop // per_block * block_bytes)
    return GGUFTensor(t.qtype, (t.shape[0], width), np.ascontiguousarray(t.data[:, cut]))


def block_geometry(qtype: str) -> tuple[int, int]:
    """(columns per block, bytes per block) of a GGUF block format."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]


def init_process_group(rank: int, size: int, rendezvous_file: str,
                       device: torch.device) -> None:
    """Join the ranks' group (all ranks call this before loading the model): gloo on CPUs,
    NCCL between GPUs, `device` being this rank's."""
    global _world_size, _device, _rank, _rendezvous_file
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # connections between ranks: loopback
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{rendezvous_file}", rank=rank,
                            world_size=size, timeout=COLLECTIVE_TIMEOUT)
    _world_size, _device, _rank, _rendezvous_file = size, device, rank, rendezvous_file


def use_shared_memory(max_floats: int) -> bool:
    """CPU ranks: all-reduce tensors of up to `max_floats` float32s through shared memory
    (worker/shm_allreduce.py) instead of gloo's loopback TCP. Collective: every rank calls it,
    and all use it or none does (the kernel must have been built on each)."""
    global _shared
    if _world_size == 1 or _device.type != "cpu":
        return False
    if not agree_on_min(int(shm_allreduce.available(_world_size))):
        return False
    _shared = SharedMemoryAllReduce(_rendezvous_file + ".shm", _rank, _world_size, max_floats,
                                    dist.barrier)
    if _rank == 0:
        logger.info("all-reduce between the %d ranks: shared memory", _world_size)
    return True


def world_size() -> int:
    return _world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum a row-parallel layer's output over the ranks, in place (nothing when not split)."""
    if _world_size > 1 and not (_shared is not None and _shared(x)):
        dist.all_reduce(x)
    return x


def agree_on_min(value: int) -> int:
    """The smallest of every rank's `value` (the KV block count all ranks can hold)."""
    if _world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_tokens(tokens: np.ndarray) -> None:
    """Rank 0's sampled tokens to every rank, in place (int32, the same length everywhere)."""
    if _device.type == "cpu":
        dist.broadcast(torch.from_numpy(tokens), src=0)
        return
    t = torch.from_numpy(tokens).to(_device)  # (NCCL moves device tensors only)
    dist.broadcast(t, src=0)
    tokens[:] = t.cpu().numpy()


def barrier() -> None:
    if _world_size > 1:
        dist.barrier()
