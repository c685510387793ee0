"""Attention over the paged KV cache for one mixed step (prefill chunks + decodes).

The KV cache of a layer is a tensor [num_blocks, block_size, num_kv_heads, head_dim] for K and
one for V. Each step the new tokens' K/V are written into their slots, then every sequence
attends over its blocks, gathered through its block table. Sequences are handled in two
batched groups, never one at a time: decodes (one query token each) and prefill chunks (padded
to the longest chunk). The metadata is built once per step and shared by all layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from worker.decode_attention import native_decode_available, paged_decode_attention
from worker.prefill_attention import native_prefill_available, paged_prefill_attention


@dataclass
class AttentionGroup:
    """Sequences attended together: queries padded to [B, max_q], keys to [B, L]."""

    query_index: torch.Tensor  # [B, max_q] rows of the step's flat token array (padding: 0)
    query_valid: torch.Tensor  # [B, max_q] bool
    valid_rows: torch.Tensor  # [n] flat rows, the valid entries of query_index in order
    block_tables: torch.Tensor  # [B, num_blocks] (padding: block 0, masked out)
    mask: torch.Tensor  # [B, 1, max_q, L] bool, True where the query may attend
    single_query: bool  # every sequence has exactly one query token (decode)
    seq_lens: torch.Tensor  # [B] int32, keys each sequence attends to
    q_lens: torch.Tensor  # [B] int32, query rows of each sequence
    first_rows: torch.Tensor  # [B] int32, each sequence's first row of the step's tokens
    fresh: bool  # no sequence has earlier context in the cache: attend to this step's K/V
    # A sliding window (`sliding_window_metadata`): each query sees only the last `window`
    # positions (itself included), and each block table starts at its sequence's first block
    # in reach of the step's first query. None: the whole context, tables from block 0.
    window: int | None = None
    # With a window: the tables from block 0 (the CPU kernels take them and the window, and
    # skip the blocks out of reach themselves).
    whole_block_tables: torch.Tensor | None = None

    def to(self, device: torch.device) -> "AttentionGroup":
        return replace(self, **{name: value.to(device, non_blocking=True)
                                for name, value in vars(self).items()
                                if isinstance(value, torch.Tensor)})


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, flat slot of each token's K/V
    groups: list[AttentionGroup]

    def to(self, device: torch.device) -> "AttentionMetadata":
        """The step's metadata on the model's device (built once per step on the host)."""
        return AttentionMetadata(self.positions.to(device, non_blocking=True),
                                 self.slot_mapping.to(device, non_blocking=True),
                                 [group.to(device) for group in self.groups])


def build_attention_metadata(
    query_lens: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int
) -> AttentionMetadata:
    if len(query_lens) and (query_lens == 1).all():
        return _decode_metadata(seq_lens, block_tables, block_size)
    query_lens = query_lens.astype(np.int64)
    seq_lens = seq_lens.astype(np.int64)
    starts = seq_lens - query_lens
    total = int(query_lens.sum())
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    token_offsets = np.arange(total) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
    positions = starts[seq_of_token] + token_offsets
    tables = block_tables.astype(np.int64)
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    first_row = np.cumsum(query_lens) - query_lens
    groups = []
    decode = np.flatnonzero(query_lens == 1)
    prefill = np.flatnonzero(query_lens > 1)
    for members in (decode, prefill):
        if len(members):
            groups.append(
                _build_group(members, query_lens, seq_lens, first_row, tables, block_size)
            )
    return AttentionMetadata(
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots),
        groups=groups,
    )


def _decode_metadata(seq_lens: np.ndarray, block_tables: np.ndarray,
                     block_size: int) -> AttentionMetadata:
    """`build_attention_metadata` of a step whose sequences all feed one token (every decode
    step): the same arrays, built without the general case's padding and masking steps,
    which cost a decode step of a small model ~0.15 ms of Python."""
    s_lens = seq_lens.astype(np.int64)
    rows, query_index, query_valid, valid_rows, q_lens, first_rows = _decode_rows(len(s_lens))
    positions = s_lens - 1
    slots = block_tables[rows, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size
    num_blocks = -(-int(s_lens.max()) // block_size)
    table = np.maximum(block_tables[:, :num_blocks], 0).astype(np.int32)
    mask = np.arange(num_blocks * block_size) < s_lens[:, None, None, None]
    group = AttentionGroup(
        query_index=query_index,
        query_valid=query_valid,
        valid_rows=valid_rows,
        block_tables=torch.from_numpy(table),
        mask=torch.from_numpy(mask),
        single_query=True,
        seq_lens=torch.from_numpy(s_lens.astype(np.int32)),
        q_lens=q_lens,
        first_rows=first_rows,
        fresh=False,
    )
    return AttentionMetadata(positions=torch.from_numpy(positions),
                             slot_mapping=torch.from_numpy(slots), groups=[group])


@functools.lru_cache(maxsize=64)
def _decode_rows(batch: int) -> tuple:
    """The decode group's fields that depend on the batch size alone (the rows, then
    query_index, query_valid, valid_rows, q_lens, first_rows), made once per size: building
    them was a third of `_decode_metadata`'s time. Shared by every step of that size:
    nothing writes them. (Normal tensors, not inference ones, whichever mode builds them
    first: a forward that autograd tracks may read them too.)"""
    rows = np.arange(batch)
    with torch.inference_mode(False):
        return (rows, torch.from_numpy(rows[:, None]), torch.ones(batch, 1, dtype=torch.bool),
                torch.from_numpy(rows), torch.ones(batch, dtype=torch.int32),
                torch.from_numpy(rows.astype(np.int32)))


def _build_group(members, query_lens, seq_lens, first_row, tables, block_size) -> AttentionGroup:
    q_lens = query_lens[members]
    s_lens = seq_lens[members]
    max_q = int(q_lens.max())
    num_blocks = int((s_lens.max() + block_size - 1) // block_size)
    kv_len = num_blocks * block_size

    offsets = np.arange(max_q)
    valid = offsets[None, :] < q_lens[:, None]
    index = np.where(valid, first_row[members][:, None] + offsets[None, :], 0)

    # Query t of a sequence sits at position (seq_len - q_len + t) and sees keys up to it.
    q_pos = (s_lens - q_lens)[:, None] + offsets[None, :]
    key_pos = np.arange(kv_len)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]
    # Padded query rows attend to key 0 so their softmax stays finite; they are discarded.
    mask[~valid] = False
    mask[..., 0] |= ~valid
    table = tables[members, :num_blocks]
    table = np.where(table < 0, 0, table).astype(np.int32)
    fresh = bool(np.all(q_lens == s_lens)) and max_q > 1
    if fresh:  # keys are exactly this step's tokens: a causal mask over max_q
        mask = mask[:, :, :max_q]
    return AttentionGroup(
        query_index=torch.from_numpy(index),
        query_valid=torch.from_numpy(valid),
        valid_rows=torch.from_numpy(index[valid]),
        block_tables=torch.from_numpy(np.ascontiguousarray(table)),
        mask=torch.from_numpy(np.ascontiguousarray(mask[:, None, :, :])),
        single_query=max_q == 1,
        seq_lens=torch.from_numpy(s_lens.astype(np.int32)),
        q_lens=torch.from_numpy(q_lens.astype(np.int32)),
        first_rows=torch.from_numpy(first_row[members].astype(np.int32)),
        fresh=fresh,
    )


def sliding_window_metadata(meta: AttentionMetadata, window: int,
                           block_size: int) -> AttentionMetadata:
    """The step's metadata for layers that attend only to the last `window` positions (a
    query at position p sees keys p - window < k <= p, as Hugging Face's sliding-window mask).
    Built once per step from `meta` and shared by those layers; the block tables are cut to
    the blocks in reach, so a layer reads O(window) keys per sequence, not the whole context.
    On the CPU the native kernels take the whole tables and the window (and read only the
    blocks in reach); the PyTorch path the cut tables and the mask."""
    return AttentionMetadata(
        positions=meta.positions, slot_mapping=meta.slot_mapping,
        groups=[_window_group(g, window, block_size) for g in meta.groups])


def _window_group(group: AttentionGroup, window: int, block_size: int) -> AttentionGroup:
    s_lens = group.seq_lens.cpu().numpy().astype(np.int64)  # (on a GPU: small copies)
    q_lens = group.q_lens.cpu().numpy().astype(np.int64)
    valid = group.query_valid.cpu().numpy()
    max_q = valid.shape[1]
    q_start = s_lens - q_lens  # position of each sequence's first query this step
    first_block = np.maximum(q_start - window + 1, 0) // block_size
    end_block = (s_lens + block_size - 1) // block_size
    num_blocks = int((end_block - first_block).max())
    # Block j of row b is the sequence's block first_block[b] + j; past its table: masked.
    table = group.block_tables.cpu().numpy()
    cols = first_block[:, None] + np.arange(num_blocks)[None, :]
    tables = np.take_along_axis(table, np.minimum(cols, table.shape[1] - 1), axis=1)
    key_pos = first_block[:, None] * block_size + np.arange(num_blocks * block_size)[None, :]
    q_pos = q_start[:, None] + np.arange(max_q)[None, :]
    mask = (key_pos[:, None, :] <= q_pos[:, :, None]) \
        & (key_pos[:, None, :] > q_pos[:, :, None] - window)
    mask[~valid] = False
    mask[..., 0] |= ~valid
    if group.fresh:  # keys are this step's tokens (first_block is 0): positions 0..max_q-1
        mask = mask[:, :, :max_q]
    device = group.block_tables.device
    return replace(
        group,
        block_tables=torch.from_numpy(np.ascontiguousarray(tables, dtype=np.int32)).to(device),
        mask=torch.from_numpy(np.ascontiguousarray(mask[:, None, :, :])).to(device),
        window=window,
        whole_block_tables=group.block_tables,
    )


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes the step's new K/V ([T, KVH, D]) into their cache slots."""
    _, _, kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _decode_only_on_gpu(q: torch.Tensor, k_cache: torch.Tensor,
                        meta: AttentionMetadata) -> bool:
    """A step on a GPU whose only group is the decodes: its rows are the step's rows, in
    order (one query token per sequence), so the kernel reads q and writes its output whole."""
    if not q.is_cuda or len(meta.groups) != 1:
        return False
    group = meta.groups[0]
    if not group.single_query or group.window is not None:
        return False
    from worker import triton_attention

    return triton_attention.available(k_cache, prefill=False)


def _gpu_kernels(group: AttentionGroup, q, k_cache, v_cache, out, scale) -> bool:
    """The group's attention by the Triton kernels (worker/triton_attention.py), written into
    `out`; False if they do not apply (no Triton, blocks under 16 tokens for a prefill)."""
    from worker import triton_attention  # (imports Triton: on a GPU only)

    if not triton_attention.available(k_cache, prefill=not group.single_query):
        return False
    if group.single_query:
        out[group.valid_rows] = triton_attention.paged_decode_attention(
            q[group.valid_rows], k_cache, v_cache, group.block_tables, group.seq_lens, scale)
    else:
        triton_attention.paged_prefill_attention(
            q, k_cache, v_cache, group.block_tables, group.seq_lens, group.q_lens,
            group.first_rows, out, scale, group.query_index.shape[1])
    return True


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of q over the cache, which already holds this step's k and v (`store_kv`);
    k and v themselves are read only by prompts with nothing cached before them."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    if _decode_only_on_gpu(q, k_cache, meta):  # (every row decodes: no gather, no scatter)
        from worker import triton_attention

        group = meta.groups[0]
        return triton_attention.paged_decode_attention(q, k_cache, v_cache,
                                                       group.block_tables, group.seq_lens, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for group in meta.groups:
        batch = group.block_tables.shape[0]
        # (The CPU kernels: whole contexts, or a sliding window over the whole tables.)
        native = q.device.type == "cpu"
        tables, window = group.block_tables, 0
        if group.window is not None:
            tables, window = group.whole_block_tables, group.window
        if group.window is None and q.device.type == "cuda" \
                and _gpu_kernels(group, q, k_cache, v_cache, out, scale):
            continue
        if native and group.single_query and native_decode_available(k_cache.dtype):
            out[group.valid_rows] = paged_decode_attention(
                q[group.valid_rows], k_cache, v_cache, tables, group.seq_lens, scale, window,
            ).to(q.dtype)
            continue
        if native and not group.single_query and native_prefill_available(q, k_cache):
            paged_prefill_attention(q, k_cache, v_cache, tables, group.seq_lens,
                                    group.q_lens, group.first_rows, out, scale, window)
            continue
        if group.fresh:  # prompts with nothing cached before them: no need to read the cache
            keys = k[group.query_index].transpose(1, 2)
            values = v[group.query_index].transpose(1, 2)
        else:
            index = group.block_tables.long()
            keys = k_cache[index].view(batch, -1, kv_heads, head_dim).transpose(1, 2)
            values = v_cache[index].view(batch, -1, kv_heads, head_dim).transpose(1, 2)
            # (a bfloat16 cache under float32 activations: SDPA wants one dtype)
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        if group.single_query:
            queries = q[group.valid_rows].unsqueeze(2)  # [B, H, 1, D]
        else:
            queries = q[group.query_index].transpose(1, 2)  # [B, H, max_q, D]
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=group.mask, scale=scale,
            enable_gqa=kv_heads != q.shape[1],
        )
        if group.single_query:
            out[group.valid_rows] = attended.squeeze(2)
        else:
            out[group.valid_rows] = attended.transpose(1, 2)[group.query_valid]
    return out
