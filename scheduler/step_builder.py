"""Turning the contexts chosen for a step into the compact StepBatch the worker runs."""

from __future__ import annotations

import numpy as np

from pipelines.context import TextContext
from pipelines.vision_context import TextAndVisionContext
from serialization.messages import NewRequest, StepBatch, StepImage


def build_step_batch(
    step_id: int,
    contexts: list[TextContext],
    num_new_tokens: list[int],
    block_tables: list[list[int]],
    new_requests: list[NewRequest],
    finished_request_ids: list[str],
) -> StepBatch:
    """Each context feeds its next `num_new_tokens[i]` tokens; its active window is set to
    them (max.pipelines' `next_tokens`), and it samples only if that reaches its last token."""
    count = len(contexts)
    query_lens = np.empty(count, dtype=np.int32)
    seq_lens = np.empty(count, dtype=np.int32)
    sample = np.empty(count, dtype=bool)
    chunks = []
    images: list[StepImage] = []
    for i, (ctx, n) in enumerate(zip(contexts, num_new_tokens)):
        if isinstance(ctx, TextAndVisionContext):
            images += images_to_encode(ctx, ctx.start_idx, ctx.start_idx + n)
        ctx.set_token_indices(active_idx=ctx.start_idx + n)
        chunks.append(ctx.next_tokens)
        query_lens[i] = n
        seq_lens[i] = ctx.active_idx
        # Sample once the whole sequence is fed, unless there is no room left to generate
        # (max_tokens=0: the request only scores its prompt).
        sample[i] = ctx.active_idx == ctx.end_idx and ctx.end_idx < ctx.max_length
    width = max((len(t) for t in block_tables), default=0)
    tables = np.full((count, width), -1, dtype=np.int32)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    input_ids = np.concatenate(chunks).astype(np.int32) if chunks else np.zeros(0, np.int32)
    return StepBatch(
        step_id=step_id,
        request_ids=[c.request_id for c in contexts],
        input_ids=input_ids,
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=tables,
        sample=sample,
        new_requests=new_requests,
        finished_request_ids=finished_request_ids,
        images=images,
    )


def images_to_encode(ctx: TextAndVisionContext, start: int, end: int) -> list[StepImage]:
    """The images the worker must encode in this step, which feeds [start, end): those whose
    first token is fed. The scheduler cuts chunks so that none starts inside an image
    (`image_aligned_chunk`), so each image is fed whole by the step that encodes it."""
    found = ctx.images_starting_in(start, end)
    grids = ctx.extra_model_args.get("image_grid_thw")
    return [StepImage(ctx.request_id, i, img.start_idx, img.end_idx,
                      ctx.vision_token_mask(img), img.pixel_values,
                      None if grids is None else grids[i])
            for i, img in found]
