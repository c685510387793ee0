"""What every generating route shares (chat, completions, Responses, Messages, embeddings): the
served model, its tokenizer and engine, the checks a request passes before it is tokenized, its
contexts and sampling parameters, and how a generation is streamed or collected."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any, AsyncIterator, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api_server.engine_client import (
    EngineClient,
    EngineDeadError,
    GenerationFailed,
    RequestTimeoutError,
)
from api_server.engine_stream_response import EngineStreamResponse
from api_server.generation import ChoiceDelta, after_first_output, once_started, stream_choice
from api_server.logprobs_format import TokenText
from api_server.lora_adapters import LoRAAdapters
from api_server.protocol import RequestError, SamplingFields, check_depth, check_top_k
from api_server.reasoning import resolve_reasoning_parser
from api_server.server_state import ServerState
from api_server.structured import schema_for_response_format
from api_server.tokenizer import TextTokenizer
from api_server.tool_parsers import resolve_tool_call_parser
from pipelines.config import SamplingParamsDefaults, ServerConfig
from pipelines.context import TextContext
from pipelines.request import TokenGeneratorRequest
from pipelines.sampling_params import SamplingParams, SamplingParamsError
from pipelines.status import PipelineTask

_json = msgspec.json.Encoder()


def json_response(body: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json",
                    headers=headers)


def error_response(exc: RequestError) -> Response:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return json_response(exc.body(), status=exc.status, headers=headers)


class ServingContext:
    def __init__(self, engine: EngineClient, tokenizer: TextTokenizer, model_name: str,
                 model_aliases: set[str], max_model_len: int, state: ServerState,
                 server: ServerConfig = ServerConfig(),
                 task: PipelineTask = PipelineTask.TEXT_GENERATION,
                 embedding_dim: int | None = None,
                 extra_model_cards: Callable[[int], list[dict]] = lambda created: [],
                 sampling_defaults: SamplingParamsDefaults = SamplingParamsDefaults(),
                 loras: LoRAAdapters | None = None) -> None:
        self.engine = engine
        self.loras = loras  # --enable-lora: the adapters requests may name as their model
        self.sampling_defaults = sampling_defaults  # of what a request leaves out
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

    def model_card(self) -> dict:
        # input_modalities: what the model reads (the name transformers' models and
        # OpenRouter's model list use), so clients can tell a vision model from a text one.
        takes_images = getattr(self.tokenizer, "takes_images", False)
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "loom", "root": self.model_name, "parent": None,
                "max_model_len": self.max_model_len,
                "input_modalities": ["text", "image"] if takes_images else ["text"]}

    # ---- checks before anything is tokenized ------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_aliases and \
                not (self.loras is not None and model in self.loras):
            raise RequestError(f"the model `{model}` does not exist", param="model", status=404,
                               code="model_not_found")

    def model_name_for(self, model: str | None) -> str:
        """The name a request for `model` runs under: a LoRA adapter's, or the model's."""
        return model if self.loras is not None and model in self.loras else self.model_name

    def check_generates(self) -> None:
        if self.task is PipelineTask.PIXEL_GENERATION:
            raise RequestError(f"the model `{self.model_name}` generates images; use "
                               f"/v1/images/generations", param="model")
        if self.task is not PipelineTask.TEXT_GENERATION:
            raise RequestError(f"the model `{self.model_name}` serves embeddings; use "
                               f"/v1/embeddings", param="model")

    def check_available(self) -> None:
        """Refuse early (before tokenizing) when the server takes no work at all."""
        self.state.check_available()

    def check_sequences(self, count: int, param: str) -> None:
        """The request's sequences (prompts x n) are within the per-request cap and fit the
        queue."""
        if count > self.max_sequences_per_request:
            raise RequestError(
                f"this request asks for {count} sequences (prompts x n); the server's limit is "
                f"{self.max_sequences_per_request} (--max-sequences-per-request)", param=param,
                code="too_many_sequences")
        self.state.check_queue_room(count)

    # ---- the request's generation -----------------------------------------------------------
    def sampling_params(self, req: SamplingFields, max_tokens: int | None, index: int,
                        ) -> SamplingParams:
        d = self.sampling_defaults
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        check_top_k(req.top_k, self.tokenizer.vocab_size)
        top_k = d.top_k if req.top_k is None else req.top_k
        try:
            return SamplingParams(
                # (A default past the vocabulary: the whole vocabulary.)
                top_k=0 if top_k < 0 else min(top_k, self.tokenizer.vocab_size),
                top_p=_given(req.top_p, d.top_p),
                min_p=_given(req.min_p, d.min_p),
                temperature=_given(req.temperature, d.temperature),
                frequency_penalty=_given(req.frequency_penalty, d.frequency_penalty),
                presence_penalty=_given(req.presence_penalty, d.presence_penalty),
                repetition_penalty=_given(req.repetition_penalty, d.repetition_penalty),
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

    def response_format(self, req: SamplingFields) -> dict | None:
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

    async def contexts(self, make_request: Callable[[int], TokenGeneratorRequest], count: int,
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
        if self.loras is not None:
            for ctx in contexts:
                ctx.lora = self.loras.request_for(ctx.model_name)
        if admit:
            self.state.admit(contexts)
        return contexts

    def choice_streams(self, contexts, req: SamplingFields, n: int,
                       ) -> list[AsyncIterator[ChoiceDelta]]:
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

    # ---- transport --------------------------------------------------------------------------
    async def sse(self, chunks: AsyncIterator[dict], first: list[TextContext]) -> Response:
        """Stream `chunks` as server-sent events ending in [DONE] (OpenAI's framing). The
        `first` choice of each prompt (the ones that start at once) is submitted to the engine
        before the headers are written."""

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

    async def collect(self, request: Request, body_coro) -> Response:
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


def _given(value, default):
    """A request's value, or the server's default where it leaves the value out."""
    return default if value is None else value
