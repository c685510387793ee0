"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

A request becomes a chat job and runs through the same pipeline as chat completions; the
output is laid out as content blocks (thinking, text, tool_use), returned whole or streamed
as Anthropic's events: `message_start`, per block `content_block_start` /
`content_block_delta` / `content_block_stop`, `message_delta` (stop_reason, usage),
`message_stop`. Errors take Anthropic's shape (`anthropic_errors`).
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from api_server.anthropic_errors import ANTHROPIC_ERROR_TYPES
from api_server.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    effort_share,
    response_format,
    sampling_of,
    thinking_budget,
)
from api_server.chat_turn import ChatDelta, ChatJob, ChatRun, prepare_chat, start_chat
from api_server.engine_client import EngineDeadError, GenerationFailed, RequestTimeoutError
from api_server.engine_stream_response import named_event
from api_server.off_loop import is_large, off_loop_if, parse_body
from api_server.output_blocks import Block, BlockEvent, BlockTracker
from api_server.protocol import RequestError, SamplingFields
from api_server.serving_context import ServingContext, error_response, json_response

# count_tokens renders, tokenizes and decodes images like a generation request but queues
# nothing: this many at once, a 429 beyond (each holds a worker thread and image memory).
COUNT_TOKENS_CONCURRENCY = 4


class AnthropicRoute:
    def __init__(self, serving: ServingContext) -> None:
        self.serving = serving
        self.counting = asyncio.Semaphore(COUNT_TOKENS_CONCURRENCY)

    def _job(self, req: CountTokensRequest, sampling: SamplingFields,
             max_tokens: int | None, large: bool = False) -> ChatJob:
        return ChatJob(messages=chat_messages(req), sampling=sampling, max_tokens=max_tokens,
                       tools=chat_tools(req.tools), tool_choice=chat_tool_choice(req.tool_choice),
                       parallel_tool_calls=not (req.tool_choice or {}).get(
                           "disable_parallel_tool_use", False),
                       response_format=response_format(req),
                       response_format_param="output_config.format",
                       reasoning_tokens=thinking_budget(req), reasoning_share=effort_share(req),
                       request_path="/v1/messages", large=large, model=req.model)

    async def count_tokens(self, request: Request) -> Response:
        """The prompt tokens /v1/messages would run: the same rendering, nothing generated."""
        serving = self.serving
        try:
            if self.counting.locked():
                raise RequestError("too many token counts in progress; retry later",
                                   status=429, code="too_many_requests")
            async with self.counting:
                body = await request.body()
                req = await parse_body(body, CountTokensRequest)
                serving.check_model(req.model)
                serving.check_generates()
                large = is_large(body)
                run = await prepare_chat(serving, await off_loop_if(
                    large, self._job, req, SamplingFields(), None, large))
                input_tokens = run.prompt_tokens
        except RequestError as exc:
            return error_response(exc)
        return json_response({"input_tokens": input_tokens})

    async def create(self, request: Request) -> Response:
        serving = self.serving
        try:
            body = await request.body()
            req = await parse_body(body, MessagesRequest)
            serving.check_model(req.model)
            serving.check_generates()
            serving.check_available()
            serving.check_sequences(1, "messages")
            large = is_large(body)
            run = await start_chat(serving, await off_loop_if(
                large, self._job, req, sampling_of(req), req.max_tokens, large))
        except RequestError as exc:
            return error_response(exc)
        message = _MessageBuilder(serving.model_name_for(req.model), run)
        if req.stream:
            return await serving.stream_events(self._events(run, message), run.first)
        return await serving.collect(request, self._body(run, message))

    async def _body(self, run: ChatRun, message: _MessageBuilder) -> dict:
        async for d in run.deltas():
            message.add(d)
        return message.body()

    async def _events(self, run: ChatRun, message: _MessageBuilder) -> AsyncIterator[bytes]:
        start = message.body()
        start.update(content=[], stop_reason=None, stop_sequence=None)
        start["usage"]["output_tokens"] = 0
        yield named_event("message_start", {"type": "message_start", "message": start})
        deltas = run.deltas()
        try:
            async for d in deltas:
                for e in message.add(d):
                    yield message.block_event(e)
        except (GenerationFailed, EngineDeadError, RequestTimeoutError) as exc:
            kind = ANTHROPIC_ERROR_TYPES[408 if isinstance(exc, RequestTimeoutError) else 500]
            yield named_event("error", {"type": "error", "error": {"type": kind,
                                                                 "message": str(exc)}})
            return
        finally:
            await deltas.aclose()
        body = message.body()
        yield named_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": body["stop_reason"],
                      "stop_sequence": body["stop_sequence"]},
            "usage": body["usage"]})
        yield named_event("message_stop", {"type": "message_stop"})


class _MessageBuilder:
    """The message object of one request, built up from the pipeline's deltas."""

    def __init__(self, model: str, run: ChatRun) -> None:
        self.model = model
        self.id = f"msg_{run.request_id}"
        self.tracker = BlockTracker()
        self.input_tokens = run.prompt_tokens
        self.output_tokens = 0
        self.last: ChatDelta | None = None

    def add(self, d: ChatDelta) -> list[BlockEvent]:
        self.output_tokens = d.completion_tokens
        if d.finish_reason:
            self.last = d
        return self.tracker.feed(d)

    def stop_reason(self) -> str | None:
        d = self.last
        if d is None:
            return None
        if d.finish_reason == "length":  # with any complete calls as tool_use blocks
            return "max_tokens"
        if d.made_calls:
            return "tool_use"
        return "stop_sequence" if d.stop_sequence is not None else "end_turn"

    def block(self, block: Block, done: bool = True) -> dict:
        if block.kind == "reasoning":
            return {"type": "thinking", "thinking": block.text if done else "", "signature": ""}
        if block.kind == "text":
            return {"type": "text", "text": block.text if done else ""}
        call = block.call
        return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
                "name": call.name, "input": json.loads(block.text) if done else {}}

    def block_event(self, e: BlockEvent) -> bytes:
        index = e.block.index
        if e.type == "open":
            return named_event("content_block_start", {
                "type": "content_block_start", "index": index,
                "content_block": self.block(e.block, done=False)})
        if e.type == "close":
            return named_event("content_block_stop", {"type": "content_block_stop",
                                                    "index": index})
        kind = e.block.kind
        delta = ({"type": "thinking_delta", "thinking": e.delta} if kind == "reasoning" else
                 {"type": "text_delta", "text": e.delta} if kind == "text" else
                 {"type": "input_json_delta", "partial_json": e.delta})
        return named_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                 "delta": delta})

    def body(self) -> dict:
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [self.block(b) for b in self.tracker.answer],
            "stop_reason": self.stop_reason(),
            "stop_sequence": self.last.stop_sequence if self.last else None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens},
        }
