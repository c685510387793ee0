"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A request becomes a chat job and runs through the same pipeline as chat completions; its
output is laid out as Responses items (reasoning, message, function_call), returned whole or
streamed as Responses events: `response.created`, `response.in_progress`, per item
`response.output_item.added` / content events / `response.output_item.done`, then
`response.completed` (or `response.incomplete` when max_output_tokens cut it short).
"""

from __future__ import annotations

import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from api_server.chat_turn import ChatJob, ChatRun, start_chat
from api_server.engine_client import EngineDeadError, GenerationFailed, RequestTimeoutError
from api_server.engine_stream_response import named_event
from api_server.off_loop import check_json_shape, is_large, off_loop_if, parse_body
from api_server.output_blocks import Block, BlockEvent, BlockTracker
from api_server.protocol import RequestError
from api_server.reasoning import effort_budget
from api_server.response_store import ResponseStore, StoredResponse
from api_server.responses_protocol import (
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    check_supported,
    describe_format,
    input_items_of,
    input_messages,
    list_page,
    output_messages,
    response_format,
    sampling_of,
)
from api_server.serving_context import ServingContext, error_response, json_response
from pipelines.config import SamplingParamsDefaults

_ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "call": "fc"}


class ResponsesRoute:
    def __init__(self, serving: ServingContext, store: ResponseStore | None = None) -> None:
        self.serving = serving
        self.store = store if store is not None else ResponseStore()

    async def create(self, request: Request) -> Response:
        serving = self.serving
        try:
            body = await request.body()
            req = await parse_body(body, ResponsesRequest)
            serving.check_model(req.model)
            serving.check_generates()
            check_supported(req)
            serving.check_available()
            serving.check_sequences(1, "input")
            history = self._stored_history(req)
            large = is_large(body) or is_large(history.messages_json if history else b"")
            conversation, job = await off_loop_if(large, self._job, req, history, large)
            run = await start_chat(serving, job)
        except RequestError as exc:
            return error_response(exc)
        store = serving.responses_store_default if req.store is None else req.store
        builder = _ResponseBuilder(serving.model_name_for(req.model), req, run, store,
                                   serving.sampling_defaults)
        if req.stream:
            return await serving.stream_events(self._events(run, builder, conversation),
                                              run.first)
        return await serving.collect(request, self._body(run, builder, conversation))

    def _job(self, req: ResponsesRequest, history: StoredResponse | None, large: bool,
             ) -> tuple[list[dict], ChatJob]:
        """The conversation and its chat job (walking all the request and the stored history
        hold: off the loop when they are large)."""
        conversation = []
        if history is not None:
            if is_large(history.messages_json):  # as the conversation sent whole would be
                check_json_shape(history.messages_json)
            conversation = history.messages
        conversation += input_messages(req)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        reasoning = req.reasoning
        return conversation, ChatJob(
            messages=system + conversation, sampling=sampling_of(req),
            max_tokens=req.max_output_tokens, max_tokens_param="max_output_tokens",
            messages_param="input", tools=chat_tools(req.tools),
            tool_choice=chat_tool_choice(req.tool_choice),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            response_format=response_format(req), response_format_param="text.format",
            reasoning_tokens=reasoning.max_tokens if reasoning else None,
            reasoning_share=effort_budget(reasoning.effort, "reasoning.effort")
            if reasoning else None,
            request_path="/v1/responses", large=large, model=req.model)

    def _stored_history(self, req: ResponsesRequest) -> StoredResponse | None:
        """The stored response `previous_response_id` names: the conversation through it."""
        if req.previous_response_id is None:
            return None
        stored = self.store.get(req.previous_response_id)
        if stored is None:
            raise RequestError(f"no stored response {req.previous_response_id!r} (responses "
                               f"are kept only when created with store: true, and in memory)",
                               param="previous_response_id", code="response_not_found")
        return stored

    async def get(self, request: Request) -> Response:
        stored = self.store.get(request.path_params["response_id"])
        if stored is None:
            return error_response(self._not_found(request))
        return Response(stored.body_json, media_type="application/json")  # as stored

    async def input_items(self, request: Request) -> Response:
        """GET /v1/responses/{id}/input_items: the stored request's input, paginated as
        OpenAI's lists are (`after` / `before` item ids, `limit`, `order`, newest first)."""
        stored = self.store.get(request.path_params["response_id"])
        if stored is None:
            return error_response(self._not_found(request))
        try:
            page = list_page(stored.input_items, request.query_params)
        except RequestError as exc:
            return error_response(exc)
        return json_response(page)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(response_id):
            return error_response(self._not_found(request))
        return json_response({"id": response_id, "object": "response", "deleted": True})

    @staticmethod
    def _not_found(request: Request) -> RequestError:
        return RequestError(f"no stored response {request.path_params['response_id']!r}",
                            param="response_id", status=404, code="response_not_found")

    def _keep(self, builder: _ResponseBuilder, conversation: list[dict], body: dict) -> None:
        if builder.store:
            self.store.put(body, conversation + output_messages(body["output"]),
                           input_items_of(builder.req, f"{builder.item_ids}in"))

    async def _body(self, run: ChatRun, builder: _ResponseBuilder,
                    conversation: list[dict]) -> dict:
        async for d in run.deltas():
            builder.add(d)
        body = builder.response(builder.status())
        self._keep(builder, conversation, body)
        return body

    async def _events(self, run: ChatRun, builder: _ResponseBuilder,
                      conversation: list[dict]) -> AsyncIterator[bytes]:
        seq = 0

        def event(name: str, /, **data) -> bytes:
            nonlocal seq
            seq += 1
            return named_event(name, {"type": name, "sequence_number": seq - 1, **data})

        yield event("response.created", response=builder.response("in_progress"))
        yield event("response.in_progress", response=builder.response("in_progress"))
        deltas = run.deltas()
        try:
            async for d in deltas:
                for e in builder.add(d):
                    for name, data in builder.item_events(e):
                        yield event(name, **data)
        except (GenerationFailed, EngineDeadError, RequestTimeoutError) as exc:
            code = "request_timeout" if isinstance(exc, RequestTimeoutError) else "server_error"
            yield event("error", code=code, message=str(exc), param=None)
            failed = builder.response("failed")
            failed["error"] = {"code": code, "message": str(exc)}
            yield event("response.failed", response=failed)
            return
        finally:
            await deltas.aclose()
        status = builder.status()
        body = builder.response(status)
        self._keep(builder, conversation, body)
        yield event("response.completed" if status == "completed" else "response.incomplete",
                    response=body)


class _ResponseBuilder:
    """The response object of one request, built up from the pipeline's deltas."""

    def __init__(self, model: str, req: ResponsesRequest, run: ChatRun,
                 store: bool = False,
                 defaults: SamplingParamsDefaults = SamplingParamsDefaults()) -> None:
        self.model = model
        self.defaults = defaults  # (what the response reports for values the request left out)
        self.req = req
        self.store = store
        self.id = f"resp_{run.request_id}"
        self.item_ids = f"{run.request_id[:24]}"
        self.created = int(time.time())
        self.tracker = BlockTracker()
        self.prompt_tokens = run.prompt_tokens
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self.finish: str | None = None

    def add(self, d) -> list[BlockEvent]:
        self.prompt_tokens = d.prompt_tokens or self.prompt_tokens
        self.completion_tokens = d.completion_tokens
        self.reasoning_tokens = d.reasoning_tokens
        if d.finish_reason:
            self.finish = d.finish_reason
        return self.tracker.feed(d)

    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def item_id(self, block: Block) -> str:
        return f"{_ITEM_PREFIX[block.kind]}_{self.item_ids}{block.index:03d}"

    def item(self, block: Block, status: str) -> dict:
        item_id = self.item_id(block)
        if block.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": block.text}] if status != \
                "in_progress" else []
            return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
                    "status": status}
        if block.kind == "text":
            content = [_output_text(block.text)] if status != "in_progress" else []
            return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                    "content": content}
        call = block.call
        return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
                "arguments": block.text if status != "in_progress" else "",
                "status": status}

    def item_events(self, e: BlockEvent) -> list[tuple[str, dict]]:
        block = e.block
        at = {"item_id": self.item_id(block), "output_index": block.index}
        if e.type == "open":
            out = [("response.output_item.added",
                    {"output_index": block.index, "item": self.item(block, "in_progress")})]
            if block.kind == "text":
                out.append(("response.content_part.added",
                            {**at, "content_index": 0, "part": _output_text("")}))
            elif block.kind == "reasoning":
                out.append(("response.content_part.added", {**at, "content_index": 0, "part": {
                    "type": "reasoning_text", "text": ""}}))
            return out
        if e.type == "delta":
            if block.kind == "text":
                return [("response.output_text.delta",
                         {**at, "content_index": 0, "delta": e.delta, "logprobs": []})]
            if block.kind == "reasoning":
                return [("response.reasoning_text.delta",
                         {**at, "content_index": 0, "delta": e.delta})]
            return [("response.function_call_arguments.delta", {**at, "delta": e.delta})]
        done = self.item(block, self._item_status(block))
        if block.kind == "text":
            return [("response.output_text.done",
                     {**at, "content_index": 0, "text": block.text, "logprobs": []}),
                    ("response.content_part.done",
                     {**at, "content_index": 0, "part": _output_text(block.text)}),
                    ("response.output_item.done", {"output_index": block.index, "item": done})]
        if block.kind == "reasoning":
            part = {"type": "reasoning_text", "text": block.text}
            return [("response.reasoning_text.done",
                     {**at, "content_index": 0, "text": block.text}),
                    ("response.content_part.done", {**at, "content_index": 0, "part": part}),
                    ("response.output_item.done", {"output_index": block.index, "item": done})]
        if block.dropped:  # not a call after all (or cut): its text is not an answer
            return [("response.output_item.done", {"output_index": block.index, "item": done})]
        return [("response.function_call_arguments.done",
                 {**at, "name": block.call.name, "arguments": block.text}),
                ("response.output_item.done", {"output_index": block.index, "item": done})]

    def _item_status(self, block: Block) -> str:
        # The last block is the one a length limit cut; calls are complete when parsed.
        if block.dropped:
            return "incomplete"
        answer = self.tracker.answer
        last = answer and answer[-1] is block
        return "incomplete" if (last and self.finish == "length" and block.kind != "call") \
            else "completed"

    def response(self, status: str) -> dict:
        req = self.req
        done = status not in ("in_progress",)
        output = [self.item(b, self._item_status(b)) for b in self.tracker.answer] if done else []
        usage = None
        if done:
            usage = {"input_tokens": self.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": self.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                     "total_tokens": self.prompt_tokens + self.completion_tokens}
        reasoning = req.reasoning
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": reasoning.effort if reasoning else None, "summary": None},
            "store": self.store,
            "temperature": self.defaults.temperature if req.temperature is None
            else req.temperature,
            "text": describe_format(req),
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": self.defaults.top_p if req.top_p is None else req.top_p,
            "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {},
        }


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
