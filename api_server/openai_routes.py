"""/v1/completions, /v1/chat/completions and /v1/models, as OpenAI defines them."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api_server.chat_template import template_options
from api_server.chat_turn import ChatDelta, ChatJob, start_chat
from api_server.generation import ChoiceDelta, merge_choices
from api_server.logprobs_format import CompletionLogprobs, chat_logprob_entries, token_id_text
from api_server.off_loop import is_large, off_loop_if, parse_body
from api_server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    RequestError,
    check_depth,
    prompts_of,
)
from api_server.reasoning import effort_budget
from api_server.serving_context import ServingContext, error_response, json_response
from api_server.tool_calls import ToolCall
from pipelines.request import TokenGeneratorRequest

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIRoutes:
    def __init__(self, serving: ServingContext) -> None:
        self.serving = serving

    # ---- /v1/models -------------------------------------------------------------------------
    async def list_models(self, request: Request) -> Response:
        s = self.serving
        return json_response({"object": "list",
                              "data": [s.model_card(), *s.extra_model_cards(s.created),
                                       *(s.loras.model_cards(s.created) if s.loras else [])]})

    # ---- /v1/completions --------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        try:
            body = await request.body()
            req = await parse_body(body, CompletionRequest)
            self.serving.check_model(req.model)
            self.serving.check_generates()
            if req.suffix:
                raise RequestError("suffix is not supported", param="suffix")
            self.serving.check_available()
            prompts = await off_loop_if(is_large(body), prompts_of, req)
            self.serving.check_sequences(len(prompts) * req.n, "n" if req.n > 1 else "prompt")
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
            if max_tokens == 0 and not req.echo:
                raise RequestError("max_tokens=0 only makes sense with echo", param="max_tokens")
            request_id = uuid.uuid4().hex
            n = req.n
            wants_logprobs = req.logprobs is not None
            response_format = self.serving.response_format(req)
            contexts = await self.serving.contexts(lambda i: TokenGeneratorRequest(
                id=f"{request_id}-{i}", index=i,
                model_name=self.serving.model_name_for(req.model), prompt=prompts[i // n],
                request_path="/v1/completions",
                timestamp_ns=time.time_ns(),
                logprobs=max(1, req.logprobs) if wants_logprobs else 0,
                echo=bool(req.echo and wants_logprobs),
                response_format=response_format,
                sampling_params=self.serving.sampling_params(req, max_tokens, i),
                cache_salt=req.cache_salt, speculative_decoding=req.speculative_decoding,
            ), len(prompts) * n, n)
        except RequestError as exc:
            return error_response(exc)
        streams = self.serving.choice_streams(contexts, req, n)
        choices = [_CompletionChoice(self.serving, ctx, req) for ctx in contexts]
        response_id = f"cmpl-{request_id}"
        if req.stream:
            return await self.serving.sse(
                self._completion_chunks(response_id, streams, choices, req), contexts[::n])
        return await self.serving.collect(
            request, self._completion_body(response_id, streams, choices, req))

    async def _completion_chunks(self, response_id, streams, choices, req: CompletionRequest):
        created = int(time.time())
        usage = _Usage(req.n)

        def chunk(index: int, text: str, logprobs, finish) -> dict:
            return {"id": response_id, "object": "text_completion", "created": created,
                    "model": self.serving.model_name_for(req.model),
                    "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": finish}]}

        async for d in merge_choices(streams):
            usage.add(d)
            text, logprobs = choices[d.index].add(d)
            if text or d.finish_reason or (logprobs and logprobs["tokens"]):
                yield chunk(d.index, text, logprobs, d.finish_reason)
        if req.stream_options and req.stream_options.include_usage:
            yield {"id": response_id, "object": "text_completion", "created": created,
                   "model": self.serving.model_name_for(req.model), "choices": [], "usage": usage.body()}

    async def _completion_body(self, response_id: str, streams, choices,
                               req: CompletionRequest) -> dict:
        usage = _Usage(req.n)
        texts = [[] for _ in choices]
        finish: dict[int, str] = {}
        async for d in merge_choices(streams):
            usage.add(d)
            texts[d.index].append(choices[d.index].add(d)[0])
            if d.finish_reason:
                finish[d.index] = d.finish_reason
        body = [{"index": i, "text": "".join(texts[i]), "logprobs": choices[i].all_logprobs(),
                 "finish_reason": finish.get(i)} for i in range(len(choices))]
        return {"id": response_id, "object": "text_completion", "created": int(time.time()),
                "model": self.serving.model_name_for(req.model), "choices": body, "usage": usage.body()}

    # ---- /v1/chat/completions ---------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await request.body()
            req = await parse_body(body, ChatCompletionRequest)
            self.serving.check_model(req.model)
            self.serving.check_generates()
            if not req.messages:
                raise RequestError("messages must not be empty", param="messages")
            if req.top_logprobs and not req.logprobs:
                raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")
            self.serving.check_available()
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
                else req.max_tokens
            if max_tokens == 0:
                raise RequestError("max_tokens must be at least 1", param="max_tokens")
            self.serving.check_sequences(req.n, "n")
            large = is_large(body)
            run = await start_chat(self.serving, await off_loop_if(large, self._chat_job, req,
                                                            max_tokens, large))
        except RequestError as exc:
            return error_response(exc)
        response_id = f"chatcmpl-{run.request_id}"
        if req.stream:
            return await self.serving.sse(self._chat_chunks(response_id, run.deltas(), req),
                                          run.first)
        return await self.serving.collect(request, self._chat_body(response_id, run.deltas(), req))

    def _chat_job(self, req: ChatCompletionRequest, max_tokens: int | None,
                  large: bool) -> ChatJob:
        """The request as a chat job (walking all it holds: off the loop when it is large)."""
        options = template_options(req.chat_template_kwargs, req.add_generation_prompt,
                                   self.serving.trust_request_chat_template)
        return ChatJob(
            messages=chat_messages(req.messages), sampling=req, max_tokens=max_tokens,
            max_tokens_param="max_completion_tokens" if req.max_completion_tokens is not None
            else "max_tokens",
            tools=req.tools, tool_choice=req.tool_choice,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            response_format=self.serving.response_format(req), template_options=options,
            reasoning_tokens=req.max_reasoning_tokens,
            reasoning_share=effort_budget(req.reasoning_effort, "reasoning_effort"),
            n=req.n, logprobs=max(1, req.top_logprobs or 0) if req.logprobs else 0,
            large=large, model=req.model)

    def _chat_logprobs(self, d: ChatDelta, req: ChatCompletionRequest) -> list[dict] | None:
        if not req.logprobs or d.logprobs is None:
            return None
        text_of = token_id_text if req.return_tokens_as_token_ids else self.serving.token_text
        return chat_logprob_entries(text_of, d.logprobs, req.top_logprobs or 0)

    async def _chat_chunks(self, response_id: str, deltas: AsyncIterator[ChatDelta],
                           req: ChatCompletionRequest):
        created = int(time.time())
        usage = _Usage(req.n)
        num_calls = [0] * req.n

        def chunk(index: int, delta: dict, finish: str | None, logprobs=None) -> dict:
            return {"id": response_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.serving.model_name_for(req.model),
                    "choices": [{"index": index, "delta": delta,
                                 "logprobs": None if logprobs is None else {"content": logprobs},
                                 "finish_reason": finish}]}

        opened: dict[str, int] = {}  # call id -> its index in the choice's tool_calls

        def call_chunks(index: int, d: ChatDelta):
            # As OpenAI streams them: id, type and name first, then the arguments, in pieces
            # as they are written where the parser can tell, else whole. A dropped call's
            # pieces just stop (its text comes as content).
            streamed = {p.call.id for p in d.call_deltas} | opened.keys()
            pieces = [(p.call, p.arguments) for p in d.call_deltas] + \
                [(c, c.arguments) for c in d.calls if c.id not in streamed]
            for call, arguments in pieces:
                if call.id not in opened:
                    opened[call.id] = num_calls[index]
                    num_calls[index] += 1
                    yield chunk(index, {"tool_calls": [{
                        "index": opened[call.id], "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}}]}, None)
                yield chunk(index, {"tool_calls": [{"index": opened[call.id], "function": {
                    "arguments": arguments}}]}, None)

        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""}, None)
        async for d in deltas:
            usage.add(d)
            logprobs = self._chat_logprobs(d, req)
            if d.reasoning:  # vLLM's field for a reasoning model's thought
                yield chunk(d.index, {"reasoning_content": d.reasoning}, None)
            if d.content or logprobs:
                yield chunk(d.index, {"content": d.content}, None, logprobs)
            for c in call_chunks(d.index, d):
                yield c
            if d.finish_reason:
                finish = _finish(d.finish_reason, int(d.made_calls))
                yield chunk(d.index, {}, finish)
        if req.stream_options and req.stream_options.include_usage:
            yield {"id": response_id, "object": "chat.completion.chunk", "created": created,
                   "model": self.serving.model_name_for(req.model), "choices": [], "usage": usage.body()}

    async def _chat_body(self, response_id: str, deltas: AsyncIterator[ChatDelta],
                         req: ChatCompletionRequest) -> dict:
        texts: dict[int, list[str]] = {i: [] for i in range(req.n)}
        thoughts: dict[int, list[str]] = {i: [] for i in range(req.n)}
        calls: dict[int, list[ToolCall]] = {i: [] for i in range(req.n)}
        logprobs: dict[int, list[dict]] = {i: [] for i in range(req.n)}
        finish: dict[int, str] = {}
        usage = _Usage(req.n)
        async for d in deltas:
            usage.add(d)
            texts[d.index].append(d.content)
            thoughts[d.index].append(d.reasoning)
            calls[d.index] += d.calls
            logprobs[d.index].extend(self._chat_logprobs(d, req) or [])
            if d.finish_reason:
                finish[d.index] = _finish(d.finish_reason, len(calls[d.index]))
        choices = []
        for i in sorted(texts):
            message = {"role": "assistant", "content": "".join(texts[i])}
            if self.serving.reasoning_parser is not None:
                message["reasoning_content"] = "".join(thoughts[i]) or None
            if calls[i]:
                message["content"] = message["content"] or None
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": c.arguments}} for c in calls[i]]
            choices.append({"index": i, "message": message,
                            "logprobs": {"content": logprobs[i]} if req.logprobs else None,
                            "finish_reason": finish.get(i)})
        return {"id": response_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.serving.model_name_for(req.model), "choices": choices, "usage": usage.body()}


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template takes them: plain dicts, unset fields left out."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            check_depth(m.content, f"messages[{i}].content")
        message = msgspec.structs.asdict(m)
        out.append({k: v for k, v in message.items() if v is not None})
    return out


class _Usage:
    """Token counts; the n choices of one prompt share it, so it is counted once (as OpenAI)."""

    def __init__(self, n: int = 1) -> None:
        self.n = n
        self.prompt: dict[int, int] = {}
        self.completion: dict[int, int] = {}
        self.speculative: dict[int, tuple[int, int]] = {}

    def add(self, d: ChoiceDelta) -> None:
        self.prompt[d.index // self.n] = d.prompt_tokens
        self.completion[d.index] = d.completion_tokens
        if getattr(d, "speculative", None):
            self.speculative[d.index] = d.speculative

    def body(self) -> dict:
        prompt = sum(self.prompt.values())
        completion = sum(self.completion.values())
        body = {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}
        if self.speculative:  # (extension: speculative decoding's proposals, and accepted)
            body["speculative_decoding"] = {
                "num_draft_tokens": sum(p for p, _ in self.speculative.values()),
                "num_accepted_tokens": sum(a for _, a in self.speculative.values())}
        return body


class _CompletionChoice:
    """Per-choice state of a completion: the echoed prompt, and the logprobs so far."""

    def __init__(self, serving: ServingContext, ctx, req: CompletionRequest) -> None:
        self.prompt = ctx.prompt_tokens.tolist()
        self.echo = bool(req.echo)
        self.echoed = False
        self.prompt_text = ""
        if self.echo:
            self.prompt_text = serving.tokenizer.delegate.decode(
                self.prompt, skip_special_tokens=req.skip_special_tokens)
        self.logprobs = None
        self.all: dict | None = None
        self.prompt_done = 1  # prompt position 0 has no log probability
        if req.logprobs is not None:
            text_of = token_id_text if req.return_tokens_as_token_ids else serving.token_text
            self.logprobs = CompletionLogprobs(text_of, req.logprobs)
            self.all = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, d: ChoiceDelta) -> tuple[str, dict | None]:
        text = d.text
        if self.echo and not self.echoed:
            self.echoed = True
            text = self.prompt_text + text
            if self.logprobs is not None:
                self.logprobs.add_first_prompt_token(self.prompt[0])
        if self.logprobs is None:
            return text, None
        for token_id, lp in zip(self.prompt[self.prompt_done:], d.prompt_logprobs or ()):
            self.logprobs.add(token_id, lp)
            self.prompt_done += 1
        for token_id, lp in d.logprobs or ():
            self.logprobs.add(token_id, lp)
        part = self.logprobs.take()
        for key, values in part.items():
            self.all[key].extend(values)
        return text, part

    def all_logprobs(self) -> dict | None:
        return self.all


def _finish(engine_reason: str, num_calls: int) -> str:
    """A choice that called tools finishes with tool_calls, unless the length limit cut it:
    then its complete calls come back and `length` says the last one may be missing."""
    return "tool_calls" if num_calls and engine_reason != "length" else engine_reason
