"""Multimodal rotary positions (M-RoPE, Qwen2-VL): each token has three positions (temporal,
height, width), and the rotary's frequency pairs are split in three sections, each turned by
one of them (transformers' `apply_multimodal_rotary_pos_emb`).

A request's prompt positions arrive once, with its `NewRequest` (computed in the API process
from the images' grids: api_server/qwen2_vl_processor.py); tokens past them, generated ones
included, continue from the prompt's largest position + 1: index + `delta`, as transformers'
generate() does with its `rope_deltas`. Text tokens' three positions are equal, so a step of
text only (every decode step) is an ordinary rotary step at shifted positions, and keeps the
fused paths; a step feeding image tokens gets per-token cos/sin tables.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from worker.models.llama import RotaryEmbedding


class MRopePositions:
    """The M-RoPE prompt positions of the requests that have them (image prompts)."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[np.ndarray, int]] = {}  # id -> (positions, delta)

    def add(self, request_id: str, positions: np.ndarray, prompt_len: int) -> None:
        positions = np.asarray(positions, dtype=np.int64)
        if positions.ndim != 2 or positions.shape[0] != 3 or not (
                0 < positions.shape[1] <= prompt_len):
            raise ValueError(f"request {request_id}: rope positions of shape "
                             f"{positions.shape}; expected [3, n <= {prompt_len}]")
        delta = int(positions.max()) + 1 - positions.shape[1]
        self.requests[request_id] = (positions, delta)

    def release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def step(self, request_ids: list[str], query_lens: np.ndarray,
             seq_lens: np.ndarray) -> np.ndarray | None:
        """int64 [3, T]: the positions of the step's tokens; None when no sequence of the step
        has M-RoPE positions (its tokens' indices are their positions)."""
        if not self.requests or not any(r in self.requests for r in request_ids):
            return None
        chunks = []
        for request_id, q, s in zip(request_ids, query_lens.tolist(), seq_lens.tolist()):
            idx = np.arange(s - q, s, dtype=np.int64)
            entry = self.requests.get(request_id)
            if entry is None:
                chunks.append(np.broadcast_to(idx, (3, q)))
                continue
            positions, delta = entry
            known = idx < positions.shape[1]
            chunks.append(np.where(known, positions[:, np.minimum(idx, positions.shape[1] - 1)],
                                   idx + delta))
        return np.concatenate(chunks, axis=1)


def uniform(positions: np.ndarray) -> bool:
    """Every token's three positions are equal (text only)."""
    return bool((positions[0] == positions[1]).all() and (positions[0] == positions[2]).all())


class TokenRotary(RotaryEmbedding):
    """Rotary tables with one row per token of the step: the layers look them up (and the
    fused rotary + KV store reads them) by row, with the step's positions set to 0..T-1."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        nn.Module.__init__(self)
        self.cos, self.sin = cos, sin


def mrope_tables(positions: np.ndarray, inv_freq: torch.Tensor,
                 section: list[int]) -> TokenRotary:
    """cos/sin float32 [T, head_dim] of `positions` [3, T]: frequency pair j turned by the
    position of its section (temporal, height, width), in the same float32 arithmetic as
    transformers (position * inv_freq, then cos and sin)."""
    of_pair = np.repeat(np.arange(3), section)  # the section of each frequency pair
    pos = torch.from_numpy(np.ascontiguousarray(positions[of_pair].T)).float()  # [T, D/2]
    freqs = pos * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return TokenRotary(emb.cos().contiguous(), emb.sin().contiguous())
