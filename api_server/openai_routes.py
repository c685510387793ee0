"""/v1/completions, /v1/chat/completions and /v1/models, as OpenAI defines them."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api_server.chat_pipeline import ChatDelta, ChatJob, start_chat
from api_server.chat_template import template_options
from api_server.engine_client import (
    EngineClient,
    EngineDeadError,
    GenerationFailed,
    RequestTimeoutError,
)
from api_server.engine_stream_response import EngineStreamResponse
from api_server.generation import (
    ChoiceDelta,
    after_first_output,
    merge_choices,
    once_started,
    stream_choice,
)
from api_server.logprobs_format import (
    CompletionLogprobs,
    TokenText,
    chat_logprob_entries,
    token_id_text,
)
from api_server.off_loop import is_large, off_loop_if, parse_body
from api_server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    RequestError,
    SamplingFields,
    check_depth,
    check_top_k,
    prompts_of,
)
from api_server.reasoning import effort_budget, resolve_reasoning_parser
from api_server.server_state import ServerState
from api_server.structured import schema_for_response_format
from api_server.tokenizer import TextTokenizer
from api_server.tool_calls import ToolCall
from api_server.tool_parsers import resolve_tool_call_parser
from pipelines.config import ServedModelConfig, ServerConfig
from pipelines.context import TextContext
from pipelines.request import TokenGeneratorRequest
from pipelines.sampling_params import SamplingParams, SamplingParamsError
from pipelines.status import PipelineTask

logger = logging.getLogger("loom.api")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_json = msgspec.json.Encoder()


def json_response(body: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json",
                    headers=headers)


def error_response(exc: RequestError) -> Response:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return json_response(exc.body(), status=exc.status, headers=headers)


class OpenAIRoutes:
    def __init__(self, engine: EngineClient, tokenizer: TextTokenizer, model_name: str,
                 model_aliases: set[str], max_model_len: int, state: ServerState,
                 server: ServerConfig = ServerConfig(),
                 task: PipelineTask = ServedModelConfig.task,
                 embedding_dim: int | None = None,
                 extra_model_cards: Callable[[int], list[dict]] = lambda created: []) -> None:
        self.engine = engine
        self.extra_model_cards = extra_model_cards  # other models served beside (the voices)
        self.task = task
        self.embedding_dim = embedding_dim
        self.state = state
        self.request_timeout = server.request_timeout
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_aliases = model_aliases | {model_name}
        self.max_model_len = max_model_len
        self.max_sequences_per_request = server.max_sequences_per_request
        self.trust_request_chat_template = server.trust_request_chat_template
        self.created = int(time.time())
        self.token_text = TokenText(tokenizer.delegate)
        template = getattr(tokenizer.delegate, "chat_template", None)
        self.tool_call_parser = resolve_tool_call_parser(server.tool_call_parser, template)
        self.reasoning_parser = resolve_reasoning_parser(server.reasoning_parser, template)
        if engine.metrics is not None:
            engine.metrics.watch_images(tokenizer.image_budget)
        self.max_parallel_tool_calls = server.max_parallel_tool_calls
        self.responses_store_default = server.responses_store_default

    # ---- /v1/models -------------------------------------------------------------------------
    def model_card(self) -> dict:
        # input_modalities: what the model reads (the name transformers' models and
        # OpenRouter's model list use), so clients can tell a vision model from a text one.
        takes_images = getattr(self.tokenizer, "takes_images", False)
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "loom", "root": self.model_name, "parent": None,
                "max_model_len": self.max_model_len,
                "input_modalities": ["text", "image"] if takes_images else ["text"]}


    async def list_models(self, request: Request) -> Response:
        cards = [self.model_card(), *self.extra_model_cards(self.created)]
        return json_response({"object": "list", "data": cards})

    # ---- shared -----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_aliases:
            raise RequestError(f"the model `{model}` does not exist", param="model", status=404,
                               code="model_not_found")

    def _check_generates(self) -> None:
        if self.task is not PipelineTask.TEXT_GENERATION:
            raise RequestError(f"the model `{self.model_name}` serves embeddings; use "
                               f"/v1/embeddings", param="model")

    def _check_engine(self) -> None:
        """Refuse early (before tokenizing) when the server takes no work at all."""
        self.state.check_available()

    def _sampling_params(self, req: SamplingFields, max_tokens: int | None, index: int,
                         ) -> SamplingParams:
        temperature = 1.0 if req.temperature is None else req.temperature
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        check_top_k(req.top_k, self.tokenizer.vocab_size)
        try:
            return SamplingParams(
                top_k=0 if req.top_k is None or req.top_k < 0 else req.top_k,
                top_p=1.0 if req.top_p is None else req.top_p,
                min_p=req.min_p or 0.0,
                temperature=temperature,
                frequency_penalty=req.frequency_penalty or 0.0,
                presence_penalty=req.presence_penalty or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0,
                max_new_tokens=max_tokens,
                min_new_tokens=req.min_tokens,
                ignore_eos=req.ignore_eos,
                # Stop strings stay in this process (the detokenizer applies them): the
                # engine client leaves them out of what it sends.
                stop=[req.stop] if isinstance(req.stop, str) else (list(req.stop or []) or None),
                stop_token_ids=self._check_token_ids(req.stop_token_ids, "stop_token_ids"),
                seed=(seed + index) % (1 << 63),  # each choice its own stream
                logit_bias=self._logit_bias(req.logit_bias),
            )
        except SamplingParamsError as exc:
            raise RequestError(str(exc), param=exc.param) from None

    def _response_format(self, req: SamplingFields) -> dict | None:
        if req.response_format is not None and req.response_format.json_schema is not None:
            check_depth(req.response_format.json_schema.schema_,
                        "response_format.json_schema.schema")
        schema = schema_for_response_format(req.response_format)
        return None if schema is None else {"type": "json_schema", "json_schema": schema}

    def _check_token_ids(self, ids: list[int] | None, param: str) -> list[int] | None:
        if ids and not all(0 <= t < self.tokenizer.vocab_size for t in ids):
            raise RequestError(f"{param} holds token ids outside the vocabulary", param=param)
        return ids

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        parsed = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise RequestError(f"logit_bias key {key!r} is not a token id",
                                   param="logit_bias") from None
            if not 0 <= token < self.tokenizer.vocab_size:
                raise RequestError(f"logit_bias token {token} is outside the vocabulary",
                                   param="logit_bias")
            if not -100 <= value <= 100:
                raise RequestError("logit_bias values must be in [-100, 100]", param="logit_bias")
            parsed[token] = float(value)
        return parsed

    def _streams(self, contexts, req: SamplingFields, n: int) -> list[AsyncIterator[ChoiceDelta]]:
        """One stream per choice. Of the n choices of a prompt, the first runs at once and the
        others start once it has prefilled, reusing its prompt blocks from the prefix cache."""
        streams = []
        started: asyncio.Event | None = None
        for i, ctx in enumerate(contexts):
            stream = stream_choice(self.engine, ctx, self.tokenizer.delegate, i,
                                   req.skip_special_tokens, self.request_timeout)
            if n > 1 and i % n == 0:
                started = asyncio.Event()
                stream = after_first_output(stream, started)
            elif n > 1:
                stream = once_started(stream, started)
            streams.append(stream)
        return streams

    def _check_sequences(self, count: int, param: str) -> None:
        """Before anything is tokenized: the request's sequences (prompts x n) are within the
        per-request cap and fit the queue."""
        if count > self.max_sequences_per_request:
            raise RequestError(
                f"this request asks for {count} sequences (prompts x n); the server's limit is "
                f"{self.max_sequences_per_request} (--max-sequences-per-request)", param=param,
                code="too_many_sequences")
        self.state.check_queue_room(count)

    async def _contexts(self, make_request: Callable[[int], TokenGeneratorRequest], count: int,
                        n: int = 1, admit: bool = True) -> list[TextContext]:
        """The request's contexts, `n` choices per prompt, admitted as one unit. Each prompt
        is rendered, tokenized and its images decoded once; its n choices are counted against
        the queue before they are copied from the first (which shares its pixel arrays)."""
        contexts: list[TextContext] = []
        tokens = 0
        for i in range(count):
            if i % n:
                contexts.append(self.tokenizer.choice_context(contexts[-1], make_request(i)))
                continue
            first = await self.tokenizer.new_context(make_request(i))
            tokens += n * first.prompt_length
            self.state.check_queue_room(count, tokens)
            contexts.append(first)
        if admit:
            self.state.admit(contexts)
        return contexts

    # ---- /v1/completions --------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        try:
            body = await request.body()
            req = await parse_body(body, CompletionRequest)
            self.check_model(req.model)
            self._check_generates()
            if req.suffix:
                raise RequestError("suffix is not supported", param="suffix")
            self._check_engine()
            prompts = await off_loop_if(is_large(body), prompts_of, req)
            self._check_sequences(len(prompts) * req.n, "n" if req.n > 1 else "prompt")
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
            if max_tokens == 0 and not req.echo:
                raise RequestError("max_tokens=0 only makes sense with echo", param="max_tokens")
            request_id = uuid.uuid4().hex
            n = req.n
            wants_logprobs = req.logprobs is not None
            response_format = self._response_format(req)
            contexts = await self._contexts(lambda i: TokenGeneratorRequest(
                id=f"{request_id}-{i}", index=i, model_name=self.model_name,
                prompt=prompts[i // n], request_path="/v1/completions",
                timestamp_ns=time.time_ns(),
                logprobs=max(1, req.logprobs) if wants_logprobs else 0,
                echo=bool(req.echo and wants_logprobs),
                response_format=response_format,
                sampling_params=self._sampling_params(req, max_tokens, i),
                cache_salt=req.cache_salt,
            ), len(prompts) * n, n)
        except RequestError as exc:
            return error_response(exc)
        streams = self._streams(contexts, req, n)
        choices = [_CompletionChoice(self, ctx, req) for ctx in contexts]
        response_id = f"cmpl-{request_id}"
        if req.stream:
            return await self._sse(self._completion_chunks(response_id, streams, choices, req),
                                   contexts[::n])
        return await self._collect(request, self._completion_body(response_id, streams, choices, n))

    async def _completion_chunks(self, response_id, streams, choices, req: CompletionRequest):
        created = int(time.time())
        usage = _Usage(req.n)

        def chunk(index: int, text: str, logprobs, finish) -> dict:
            return {"id": response_id, "object": "text_completion", "created": created,
                    "model": self.model_name,
                    "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": finish}]}

        async for d in merge_choices(streams):
            usage.add(d)
            text, logprobs = choices[d.index].add(d)
            if text or d.finish_reason or (logprobs and logprobs["tokens"]):
                yield chunk(d.index, text, logprobs, d.finish_reason)
        if req.stream_options and req.stream_options.include_usage:
            yield {"id": response_id, "object": "text_completion", "created": created,
                   "model": self.model_name, "choices": [], "usage": usage.body()}

    async def _completion_body(self, response_id: str, streams, choices, n: int) -> dict:
        usage = _Usage(n)
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
                "model": self.model_name, "choices": body, "usage": usage.body()}

    # ---- /v1/chat/completions ---------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await request.body()
            req = await parse_body(body, ChatCompletionRequest)
            self.check_model(req.model)
            self._check_generates()
            if not req.messages:
                raise RequestError("messages must not be empty", param="messages")
            if req.top_logprobs and not req.logprobs:
                raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")
            self._check_engine()
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
                else req.max_tokens
            if max_tokens == 0:
                raise RequestError("max_tokens must be at least 1", param="max_tokens")
            self._check_sequences(req.n, "n")
            large = is_large(body)
            run = await start_chat(self, await off_loop_if(large, self._chat_job, req,
                                                            max_tokens, large))
        except RequestError as exc:
            return error_response(exc)
        response_id = f"chatcmpl-{run.request_id}"
        if req.stream:
            return await self._sse(self._chat_chunks(response_id, run.deltas(), req), run.first)
        return await self._collect(request, self._chat_body(response_id, run.deltas(), req))

    def _chat_job(self, req: ChatCompletionRequest, max_tokens: int | None,
                  large: bool) -> ChatJob:
        """The request as a chat job (walking all it holds: off the loop when it is large)."""
        options = template_options(req.chat_template_kwargs, req.add_generation_prompt,
                                   self.trust_request_chat_template)
        return ChatJob(
            messages=chat_messages(req.messages), sampling=req, max_tokens=max_tokens,
            max_tokens_param="max_completion_tokens" if req.max_completion_tokens is not None
            else "max_tokens",
            tools=req.tools, tool_choice=req.tool_choice,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            response_format=self._response_format(req), template_options=options,
            reasoning_tokens=req.max_reasoning_tokens,
            reasoning_share=effort_budget(req.reasoning_effort, "reasoning_effort"),
            n=req.n, logprobs=max(1, req.top_logprobs or 0) if req.logprobs else 0,
            large=large)

    def _chat_logprobs(self, d: ChatDelta, req: ChatCompletionRequest) -> list[dict] | None:
        if not req.logprobs or d.logprobs is None:
            return None
        text_of = token_id_text if req.return_tokens_as_token_ids else self.token_text
        return chat_logprob_entries(text_of, d.logprobs, req.top_logprobs or 0)

    async def _chat_chunks(self, response_id: str, deltas: AsyncIterator[ChatDelta],
                           req: ChatCompletionRequest):
        created = int(time.time())
        usage = _Usage(req.n)
        num_calls = [0] * req.n

        def chunk(index: int, delta: dict, finish: str | None, logprobs=None) -> dict:
            return {"id": response_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name,
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
                   "model": self.model_name, "choices": [], "usage": usage.body()}

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
            if self.reasoning_parser is not None:
                message["reasoning_content"] = "".join(thoughts[i]) or None
            if calls[i]:
                message["content"] = message["content"] or None
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": c.arguments}} for c in calls[i]]
            choices.append({"index": i, "message": message,
                            "logprobs": {"content": logprobs[i]} if req.logprobs else None,
                            "finish_reason": finish.get(i)})
        return {"id": response_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage.body()}

    # ---- transport --------------------------------------------------------------------------
    async def _sse(self, chunks: AsyncIterator[dict], first: list[TextContext]) -> Response:
        """Stream `chunks` as server-sent events. The `first` choice of each prompt (the ones
        that start at once) is submitted to the engine before the headers are written."""

        async def events():
            try:
                async for chunk in chunks:
                    yield b"data: " + _json.encode(chunk) + b"\n\n"
            except (GenerationFailed, EngineDeadError) as exc:
                yield b"data: " + _json.encode(_server_error(str(exc))) + b"\n\n"
            except RequestTimeoutError as exc:
                yield b"data: " + _json.encode(_timeout_error(str(exc))) + b"\n\n"
            finally:
                await chunks.aclose()
            yield b"data: [DONE]\n\n"

        return await self.stream_events(events(), first)

    async def stream_events(self, body: AsyncIterator[bytes], first: list[TextContext],
                            ) -> Response:
        """Submit the `first` contexts, then stream `body` (server-sent events)."""
        submitted = []
        try:
            for ctx in first:
                await self.engine.submit(ctx, self.request_timeout)
                submitted.append(ctx.request_id)
        except BaseException as exc:
            self.engine.withdraw(submitted)
            if isinstance(exc, EngineDeadError):
                return json_response(_server_error(str(exc)), status=503)
            raise
        return EngineStreamResponse(body, self.engine, submitted)

    async def _collect(self, request: Request, body_coro) -> Response:
        """Run a non-streamed generation, abandoning it if the client goes away."""
        work = asyncio.ensure_future(body_coro)
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()  # cancels the engine streams, which frees the KV blocks
            await asyncio.gather(work, return_exceptions=True)
            return Response(status_code=499)
        try:
            return json_response(work.result())
        except EngineDeadError as exc:
            return json_response(_server_error(str(exc)), status=503)
        except GenerationFailed as exc:
            return json_response(_server_error(str(exc)), status=500)
        except RequestTimeoutError as exc:
            return json_response(_timeout_error(str(exc)), status=408)


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template takes them: plain dicts, unset fields left out."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            check_depth(m.content, f"messages[{i}].content")
        message = msgspec.structs.asdict(m)
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def _timeout_error(message: str) -> dict:
    return {"error": {"message": message, "type": "timeout_error", "param": None,
                      "code": "request_timeout"}}


def _server_error(message: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None,
                      "code": "generation_failed"}}


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Usage:
    """Token counts; the n choices of one prompt share it, so it is counted once (as OpenAI)."""

    def __init__(self, n: int = 1) -> None:
        self.n = n
        self.prompt: dict[int, int] = {}
        self.completion: dict[int, int] = {}

    def add(self, d: ChoiceDelta) -> None:
        self.prompt[d.index // self.n] = d.prompt_tokens
        self.completion[d.index] = d.completion_tokens

    def body(self) -> dict:
        prompt = sum(self.prompt.values())
        completion = sum(self.completion.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}


class _CompletionChoice:
    """Per-choice state of a completion: the echoed prompt, and the logprobs so far."""

    def __init__(self, routes: OpenAIRoutes, ctx, req: CompletionRequest) -> None:
        self.prompt = ctx.prompt_tokens.tolist()
        self.echo = bool(req.echo)
        self.echoed = False
        self.prompt_text = ""
        if self.echo:
            self.prompt_text = routes.tokenizer.delegate.decode(
                self.prompt, skip_special_tokens=req.skip_special_tokens)
        self.logprobs = None
        self.all: dict | None = None
        self.prompt_done = 1  # prompt position 0 has no log probability
        if req.logprobs is not None:
            text_of = token_id_text if req.return_tokens_as_token_ids else routes.token_text
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
