"""The image embeddings a vision model keeps between the steps of a chunked prefill.

An image is encoded in the step that feeds its first token (the scheduler sends its pixels
then, `StepImage`; no chunk starts inside an image, so that step feeds all of it); its
embeddings are kept here, per request, until the step that feeds its last token has merged
them. Then they are dropped,
and a finished or aborted request's are dropped when the runner releases it: nothing outlives
its request. A preempted request's prompt is recomputed from the start: its images are sent
and encoded again, replacing what is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CachedImage:
    end_idx: int  # one past the image's last token
    positions: np.ndarray  # int64, sorted: the sequence positions that take a row, in order
    embeddings: torch.Tensor  # [len(positions), hidden]


class VisionEmbeddingCache:
    def __init__(self) -> None:
        self.images: dict[str, dict[int, CachedImage]] = {}  # request id -> image index -> ...

    def __len__(self) -> int:
        return sum(len(per_request) for per_request in self.images.values())

    def put(self, request_id: str, image_index: int, start_idx: int, token_mask: np.ndarray,
            embeddings: torch.Tensor) -> None:
        positions = start_idx + np.flatnonzero(token_mask)
        if len(positions) != embeddings.shape[0]:
            raise ValueError(f"request {request_id}: image {image_index} has "
                             f"{embeddings.shape[0]} embeddings for {len(positions)} tokens")
        end_idx = start_idx + len(token_mask)
        self.images.setdefault(request_id, {})[image_index] = CachedImage(
            end_idx, positions, embeddings)

    def gather(self, request_ids: list[str], query_lens: np.ndarray, seq_lens: np.ndarray,
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, embeddings): the rows of the step's flat token array that are image tokens
        this step feeds, and the embeddings that replace theirs. None when there are none
        (every decode step: one dict lookup)."""
        if not self.images:
            return None
        rows: list[np.ndarray] = []
        embeds: list[torch.Tensor] = []
        offset = 0
        for request_id, q, s in zip(request_ids, query_lens.tolist(), seq_lens.tolist()):
            first = s - q  # position of the step's first token of this sequence
            for img in self.images.get(request_id, {}).values():
                lo, hi = np.searchsorted(img.positions, (first, s))
                if lo < hi:
                    rows.append(offset + img.positions[lo:hi] - first)
                    embeds.append(img.embeddings[lo:hi])
            offset += q
        if not rows:
            return None
        return torch.from_numpy(np.concatenate(rows)), torch.cat(embeds)

    def drop_done(self, request_ids: list[str], seq_lens: np.ndarray) -> None:
        """After a step: drop the images whose every token has now been fed."""
        if not self.images:
            return
        for request_id, s in zip(request_ids, seq_lens.tolist()):
            per_request = self.images.get(request_id)
            if per_request is None:
                continue
            for index in [i for i, img in per_request.items() if img.end_idx <= s]:
                del per_request[index]
            if not per_request:
                del self.images[request_id]

    def release(self, request_id: str) -> None:
        self.images.pop(request_id, None)
