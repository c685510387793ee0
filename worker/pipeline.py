"""TextGenerationPipeline: MAX's TokenGenerator interface, in one process.

`next_token(batch, num_steps)` runs every context of `batch` forward `num_steps` tokens and
returns, per step, a TextResponse per request id; `release(context)` frees its KV blocks. It is
the same model runner and step format the server uses, without the processes: for scripts,
notebooks and benchmarks.
"""

from __future__ import annotations

from pipelines.context import TextContext
from pipelines.response import TextResponse
from scheduler.block_manager import BlockManager
from scheduler.scheduler import new_request_for_worker
from scheduler.step_builder import build_step_batch
from worker.model_config import RunnerConfig
from worker.model_runner import ModelRunner


class TextGenerationPipeline:
    def __init__(self, config: RunnerConfig, enable_prefix_caching: bool = True) -> None:
        self.runner = ModelRunner(config)
        self.blocks = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                   enable_prefix_caching)
        self._known: set[str] = set()
        self._released: list[str] = []
        self._step_id = 0

    @property
    def eos_token_ids(self) -> list[int]:
        return self.runner.eos_token_ids

    def next_token(
        self, batch: dict[str, TextContext], num_steps: int = 1
    ) -> list[dict[str, TextResponse]]:
        responses: list[dict[str, TextResponse]] = []
        for _ in range(num_steps):
            contexts = [c for c in batch.values() if not c.is_done]
            if not contexts:
                break
            for ctx in contexts:
                self._reserve(ctx)
            new = [new_request_for_worker(c) for c in contexts if c.request_id not in self._known]
            self._known.update(c.request_id for c in contexts)
            step = build_step_batch(
                self._step_id, contexts, [c.end_idx - c.start_idx for c in contexts],
                [self.blocks.block_table(c.request_id) for c in contexts], new, self._released,
            )
            self._released = []
            self._step_id += 1
            sampled = self.runner.next_token(step).sampled_token_ids
            step_out = {}
            for i, ctx in enumerate(contexts):
                token = int(sampled[i])
                ctx.update(token)
                self.blocks.register_full_blocks(ctx.request_id, ctx.tokens, ctx.start_idx)
                step_out[ctx.request_id] = TextResponse(next_token=token)
            responses.append(step_out)
        return responses

    def release(self, context: TextContext) -> None:
        self.blocks.free(context.request_id)
        if context.request_id in self._known:
            self._known.discard(context.request_id)
            self._released.append(context.request_id)

    def _reserve(self, ctx: TextContext) -> None:
        if not self.blocks.block_table(ctx.request_id) and ctx.start_idx == 0:
            cached = self.blocks.find_cached_prefix(ctx.all_tokens)
            if self.blocks.allocate(ctx.request_id, ctx.end_idx, cached) and cached:
                ctx.set_token_indices(start_idx=len(cached) * self.blocks.block_size)
                return
        if not self.blocks.allocate(ctx.request_id, ctx.end_idx):
            raise MemoryError(
                f"the KV cache has no room for request {ctx.request_id}; release finished "
                f"contexts or give the pipeline more --kv-cache-memory")
