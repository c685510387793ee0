"""TextGenerationPipeline: MAX's TokenGenerator interface, in one process.

`next_token(batch, num_steps)` runs the contexts of `batch` forward for `num_steps` steps and
returns, per step, a TextResponse per request id that got a token; `release(context)` frees its
KV blocks. It drives the server's own Scheduler (admission, chunked prefill, the prefix cache,
preemption) and model runner, without the processes: for scripts, notebooks and benchmarks.
"""

from __future__ import annotations

from pipelines.config import PipelineConfig
from pipelines.context import TextContext
from pipelines.response import TextResponse
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler
from worker.model_runner import ModelRunner


class TextGenerationPipeline:
    def __init__(self, pipeline_config: PipelineConfig) -> None:
        self.runner = ModelRunner(pipeline_config)
        self.blocks = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                   pipeline_config.kv_cache_config.enable_prefix_caching)
        # (A tree not resolved by `loom serve` gets the model's context length from the runner.)
        self.scheduler = Scheduler(pipeline_config.replace(max_length=self.runner.max_model_len),
                                   self.blocks)

    @property
    def eos_token_ids(self) -> list[int]:
        return self.runner.eos_token_ids

    def next_token(
        self, batch: dict[str, TextContext], num_steps: int = 1
    ) -> list[dict[str, TextResponse]]:
        self._admit(batch)
        responses: list[dict[str, TextResponse]] = []
        for _ in range(num_steps):
            step = self.scheduler.schedule() if self.scheduler.has_work else None
            if step is None:
                break
            outputs = self.scheduler.update(step, self.runner.next_token(step.batch))
            responses.append({
                o.request_id: TextResponse(next_token=o.tokens[-1],
                                           log_probabilities=(o.log_probabilities or [None])[-1])
                for o in outputs if o.tokens})
        return responses

    def release(self, context: TextContext) -> None:
        """Ends the context if it still runs, and frees its KV blocks."""
        self.scheduler.abort(context.request_id)
        self.blocks.free(context.request_id)
        self.runner.release(context.request_id)

    def _admit(self, batch: dict[str, TextContext]) -> None:
        """New contexts join the scheduler; one it still runs must be in every batch (as MAX's
        pipeline runs exactly the batch it is given) until it is done or released."""
        missing = set(self.scheduler.requests) - set(batch)
        if missing:
            raise ValueError(f"contexts {sorted(missing)} are still generating: pass them in "
                             f"every batch until they are done, or release them")
        for ctx in batch.values():
            if not ctx.is_done and ctx.request_id not in self.scheduler.requests:
                self.scheduler.add_request(ctx)
