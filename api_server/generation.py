"""From one engine stream to text: detokenize, apply stop strings, decide finish_reason.

Shared by the completions and chat routes. A request with several choices (n > 1, or several
prompts) runs one engine request per choice; `merge_choices` interleaves their deltas.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from api_server.detokenizer import IncrementalDetokenizer, StopStringMatcher
from api_server.engine_client import EngineClient, GenerationFailed
from pipelines.context import TextContext
from pipelines.response import LogProbabilities
from pipelines.status import GenerationStatus


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last delta of a choice
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # (token id, its log probabilities) for the visible tokens of this delta, when asked for.
    logprobs: list[tuple[int, LogProbabilities]] | None = None
    # Echo: log probabilities of prompt tokens 1.. (position 0 has none), when asked for.
    prompt_logprobs: list[LogProbabilities] | None = None
    stop_sequence: str | None = None  # the stop string that ended the choice, if one did
    # Speculative decoding, on the last delta: (tokens proposed, tokens accepted).
    speculative: tuple[int, int] | None = None


async def stream_choice(
    engine: EngineClient, ctx: TextContext, tokenizer, index: int,
    skip_special_tokens: bool, timeout: float | None = None,
) -> AsyncIterator[ChoiceDelta]:
    prompt_ids = ctx.prompt_tokens.tolist()
    # (From every token before the output: a continuation's forced tokens too, jump_ahead's.)
    detok = IncrementalDetokenizer(tokenizer, ctx.all_tokens.tolist(), skip_special_tokens)
    stops = StopStringMatcher(ctx.sampling_params.stop or [])
    stop_ids = set(ctx.sampling_params.stop_token_ids or ())
    eos_ids = set() if ctx.ignore_eos else set(ctx.eos_token_ids)
    completion_tokens = 0
    outputs = engine.generate(ctx, timeout)
    try:
        async for output in outputs:
            if output.final_status is GenerationStatus.ERROR:
                raise GenerationFailed(output.error or "generation failed")
            tokens = output.tokens
            finish = _finish_reason(output.final_status)
            # The token that ended generation (EOS, a stop id) is counted but not shown.
            visible = tokens
            if finish == "stop" and tokens and tokens[-1] in (stop_ids | eos_ids):
                visible = tokens[:-1]
            if len(visible) > 1 and stops.stops:
                # Several tokens at once (speculative decoding): a stop string ends the output
                # at the token that completes it, as it would one token at a time.
                text, visible = _push_until_stopped(visible, detok, stops)
                tokens = tokens[:len(visible)] if stops.stopped else tokens
            else:
                text = stops.push(detok.push(visible)) if visible else ""
            completion_tokens += len(tokens)
            logprobs = None
            if output.log_probabilities is not None:
                logprobs = list(zip(visible, output.log_probabilities))
            prompt_lp = output.prompt_log_probabilities
            if finish is not None and not stops.stopped:
                text += stops.push(detok.flush())
                text += stops.flush()
            if stops.stopped:
                # A stop string ended it: leaving the loop cancels the request in the scheduler.
                engine.end_early(ctx.request_id, "stop")
                yield ChoiceDelta(index, text, visible, "stop", len(prompt_ids), completion_tokens,
                                  logprobs, prompt_lp, stops.matched)
                return
            speculative = (output.num_draft_tokens, output.num_accepted_tokens) \
                if output.num_draft_tokens else None
            yield ChoiceDelta(index, text, visible, finish, len(prompt_ids), completion_tokens,
                              logprobs, prompt_lp, speculative=speculative)
            if finish is not None:
                return
    finally:
        # Closed here, not whenever the generator is collected: a request ended by a stop
        # string is cancelled in the scheduler, and forgotten in the engine client, at once.
        await outputs.aclose()
    raise GenerationFailed("the engine stream ended without a final status")


def _push_until_stopped(tokens: list[int], detok: IncrementalDetokenizer,
                        stops: StopStringMatcher) -> tuple[str, list[int]]:
    """The text of `tokens` up to a stop string, and the tokens up to the one completing it."""
    text = ""
    for n, token in enumerate(tokens, 1):
        text += stops.push(detok.push([token]))
        if stops.stopped:
            return text, tokens[:n]
    return text, tokens


def _finish_reason(status: GenerationStatus) -> str | None:
    if status is GenerationStatus.END_OF_SEQUENCE:
        return "stop"
    if status is GenerationStatus.MAXIMUM_LENGTH:
        return "length"
    if status is GenerationStatus.CANCELLED:
        return "abort"
    return None


def after_first_output(stream: AsyncIterator[ChoiceDelta], started: asyncio.Event,
                       ) -> AsyncIterator[ChoiceDelta]:
    """The first choice of a prompt: signals `started` once its prompt has been prefilled."""

    async def run():
        try:
            async for delta in stream:
                started.set()
                yield delta
        finally:
            started.set()
            await stream.aclose()

    return run()


def once_started(stream: AsyncIterator[ChoiceDelta], started: asyncio.Event,
                 ) -> AsyncIterator[ChoiceDelta]:
    """A later choice of the same prompt: starts after the first one was prefilled, so its
    prompt blocks come from the prefix cache and the prompt is prefilled once for all n."""

    async def run():
        await started.wait()
        async for delta in stream:
            yield delta

    return run()


async def merge_choices(streams: list[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    """Yield deltas from several choice streams as they arrive."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[ChoiceDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put(delta)
        except BaseException as exc:  # surfaced to the consumer below
            await queue.put(exc)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
