"""Ending a thought at its budget, from the API process.

When a reasoning model has thought for its budget (`max_reasoning_tokens`, Responses'
`reasoning`, Anthropic's `thinking.budget_tokens`), the API process stops that engine request
and submits its continuation: the same prompt and the tokens generated so far, with the
closing tag, `FORCED_CLOSE`, appended by `TextContext.jump_ahead` (tokens the model is fed and
that count as generated), after which the model writes its answer. The tokens the model continues
from are exactly those a worker forcing `</think>` in place would have, so greedy output is
the same; the cost is one scheduling round and the prefill of what the prefix cache does not
already hold (the generated tokens past the last full KV block, and the tag).

In-place forcing would need the worker's help: a way for the API to append tokens to a running
request (a "force these tokens next" message the scheduler applies like sampled tokens).
"""

from __future__ import annotations

import msgspec
import numpy as np

from api_server.reasoning import FORCED_CLOSE
from pipelines.context import TextContext
from pipelines.vision_context import TextAndVisionContext


def _close_ids(tokenizer) -> np.ndarray:
    return np.asarray(tokenizer.delegate.encode(FORCED_CLOSE, add_special_tokens=False),
                      dtype=np.int64)


def _with_tokens(ctx: TextContext, tokens: np.ndarray, max_length: int, request_id: str,
                 max_new_tokens: int | None, min_new_tokens: int) -> TextContext:
    params = msgspec.structs.replace(ctx.sampling_params, max_new_tokens=max_new_tokens,
                                     min_new_tokens=max(0, min_new_tokens))
    return type(ctx)(
        request_id=request_id, max_length=max_length, tokens=tokens,
        eos_token_ids=set(ctx.eos_token_ids), ignore_eos=ctx.ignore_eos,
        sampling_params=params, model_name=ctx.model_name,
        log_probabilities=ctx.log_probabilities, json_schema=ctx.json_schema,
        cache_salt=ctx.cache_salt, lora=ctx.lora, **_vision_fields(ctx))


def _vision_fields(ctx: TextContext) -> dict:
    """A vision prompt's images, which lie in the prompt the new tokens extend: the same
    objects (their pixel arrays then go to the scheduler by reference), and Qwen2-VL's
    rope positions (the tokens past them continue from the prompt's largest position)."""
    if not isinstance(ctx, TextAndVisionContext):
        return {}
    return {"vision_token_ids": ctx.vision_token_ids, "images": ctx.images,
            "extra_model_args": ctx.extra_model_args}


def close_thinking(tokenizer, ctx: TextContext, max_model_len: int) -> TextContext | None:
    """`ctx` with the thought closed in its prompt (a zero budget, or a grammar on the
    answer); None if the context has no room for the tag and an answer."""
    close = _close_ids(tokenizer)
    tokens = np.concatenate([ctx.prompt_tokens, close])
    max_new = ctx.sampling_params.max_new_tokens
    max_length = min(max_model_len, ctx.max_length + len(close))
    if max_length - len(tokens) < 1:
        return None
    if max_new is not None:
        max_new = max_length - len(tokens)
    return _with_tokens(ctx, tokens, max_length, ctx.request_id, max_new,
                        ctx.sampling_params.min_new_tokens)


def continue_after_thinking(tokenizer, ctx: TextContext, generated: list[int],
                            ) -> tuple[TextContext, int] | None:
    """The continuation of `ctx` after `generated` tokens of thought, with the tag forced in
    by `jump_ahead` (fed to the model, counted as generated, already shown to the user), and
    how many tokens the tag is; None if the output budget has no room left for an answer."""
    close = _close_ids(tokenizer)
    tokens = np.concatenate([ctx.prompt_tokens, np.asarray(generated, dtype=np.int64)])
    if ctx.max_length - len(tokens) - len(close) < 1:
        return None
    used = len(generated) + len(close)
    max_new = ctx.sampling_params.max_new_tokens
    after = _with_tokens(ctx, tokens, ctx.max_length, f"{ctx.request_id}-answer",
                         None if max_new is None else max_new - len(generated),
                         ctx.sampling_params.min_new_tokens - used)
    for token in close.tolist():
        after.jump_ahead(token)
    after.to_generation_output()  # (the caller shows the tag itself: delivered)
    return after, len(close)
