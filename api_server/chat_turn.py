"""One chat turn through the engine, shared by /v1/chat/completions, /v1/responses and
/v1/messages, so the three APIs render, sample, parse and count the same way: the same
conversation gives the same text whichever API asks for it.

A `ChatJob` is the conversation in chat-completions form (each API converts its own request
into one). `prepare_chat` renders and tokenizes it (tools in the template or taught in a
system message, a forced call as a grammar, the context check); `ChatRun.deltas` runs it and
yields `ChatDelta`s: each engine delta split into reasoning, content and completed tool calls.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

import msgspec

from api_server.generation import ChoiceDelta, merge_choices, stream_choice
from api_server.off_loop import OFF_LOOP, off_loop_if
from api_server.protocol import RequestError, SamplingFields, check_depth
from api_server.reasoning import CLOSE, NoReasoning, ThinkParser, opens_thinking
from api_server.reasoning_budget import close_thinking, continue_after_thinking
from api_server.structured import validate_grammar, validate_schema
from api_server.tool_calls import (
    CallDelta,
    ForcedCallCollector,
    ToolCall,
    check_tools,
    forced_call_schema,
)
from api_server.tool_parsers import (
    answer_or_calls_grammar,
    format_instructions,
    new_parser,
    render_calls,
)
from api_server.tool_validation import ToolCallChecker
from pipelines.context import TextContext
from pipelines.request import TokenGeneratorRequest

if TYPE_CHECKING:
    from api_server.serving_context import ServingContext


@dataclass
class ChatJob:
    messages: list[dict]  # chat-completions messages (plain dicts)
    sampling: SamplingFields  # temperature, top_p, top_k, stop, seed, ...
    max_tokens: int | None  # None: what is left of the context
    max_tokens_param: str = "max_tokens"  # how the API names it, for errors
    messages_param: str = "messages"
    tools: list[dict] | None = None  # chat-completions function tools
    tool_choice: Any = None
    parallel_tool_calls: bool = True  # False: a forced call is one call, not a list
    response_format: dict | None = None  # {"type": "json_schema", "json_schema": <text>}
    response_format_param: str = "response_format"  # how the API names it, for errors
    template_options: dict | None = None
    # A reasoning budget: tokens, or a share of the output budget (effort levels).
    reasoning_tokens: int | None = None
    reasoning_share: float | None = None
    n: int = 1
    logprobs: int = 0
    large: bool = False  # from a large body: its checks and conversions run off the loop
    request_path: str = "/v1/chat/completions"
    model: str | None = None  # the request's `model` (a LoRA adapter's name picks it)


@dataclass
class ChatDelta:
    index: int
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None  # the engine's: stop, length, abort
    made_calls: bool = False  # with finish_reason: this choice called tools
    stop_sequence: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    logprobs: list | None = None  # the engine delta's, for chat's logprobs
    speculative: tuple[int, int] | None = None  # the engine delta's
    # Pieces of the arguments of calls being written, for streaming: a call's first piece
    # comes before it is complete (in `calls`), and the pieces add up to its arguments.
    call_deltas: list[CallDelta] = field(default_factory=list)
    # Calls whose pieces were streamed but that turned out not to be calls (auto mode: the
    # text did not parse; it comes back as content): their streamed blocks end here.
    dropped_calls: list[ToolCall] = field(default_factory=list)


def tool_mode(tools: list[dict], tool_choice) -> str:
    if not tools or tool_choice == "none":
        return "none"
    if tool_choice in (None, "auto"):
        return "auto"
    return "forced"


@dataclass
class _ChatPrompt:
    """What a job renders: messages (tools taught in them or passed to the template)."""
    tools: list[dict]
    mode: str
    messages: list[dict]
    rendered_tools: list[dict] | None
    response_format: dict | None
    sampling: SamplingFields
    options: dict | None


async def prepare_chat(serving: ServingContext, job: ChatJob) -> ChatRun:
    """Render and tokenize a job into its contexts (not yet admitted); RequestError if the
    request is invalid or does not fit the context."""
    # Tools: their schemas compile to a grammar (llguidance), which can take a while.
    prompt = await off_loop_if(job.large or bool(job.tools), _chat_prompt, serving, job)
    tools, mode, messages = prompt.tools, prompt.mode, prompt.messages
    rendered_tools, response_format = prompt.rendered_tools, prompt.response_format
    sampling, options = prompt.sampling, prompt.options
    request_id = uuid.uuid4().hex
    try:
        # Rendered, tokenized and its images decoded once; the other choices copy it.
        contexts = await serving.contexts(lambda i: TokenGeneratorRequest(
            id=f"{request_id}-{i}", index=i, model_name=serving.model_name_for(job.model),
            messages=messages, tools=rendered_tools, request_path=job.request_path,
            timestamp_ns=time.time_ns(), chat_template_options=options,
            logprobs=job.logprobs, response_format=response_format,
            cache_salt=sampling.cache_salt, speculative_decoding=sampling.speculative_decoding,
            sampling_params=serving.sampling_params(sampling, job.max_tokens, i),
        ), job.n, job.n, admit=False)
    except RequestError as exc:
        raise _renamed(exc, job) from None
    run = ChatRun(serving, job, contexts, sampling, mode, tools)
    run.request_id = request_id
    run.thinking = serving.reasoning_parser is not None and opens_thinking(
        serving.tokenizer.delegate.decode(contexts[0].prompt_tokens[-8:].tolist(),
                                         skip_special_tokens=False))
    if run.thinking and (response_format is not None or run.budget(contexts[0]) == 0):
        # Without thinking: a grammar would constrain the thought too (constraining only the
        # answer needs the worker to start the grammar at </think>), and a zero budget is no
        # thought. Closing it in the prompt is what templates do when thinking is off.
        closed = [close_thinking(serving.tokenizer, ctx, serving.max_model_len) for ctx in contexts]
        if all(c is not None for c in closed):
            run.contexts, run.thinking = closed, False
    return run


def _chat_prompt(serving: ServingContext, job: ChatJob) -> _ChatPrompt:
    """The job's checks, its tools taught or passed, its grammar: all that walks what the
    request holds."""
    check_depth(job.tools, "tools")
    tools, forced_name = check_tools(job.tools, job.tool_choice)
    mode = tool_mode(tools, job.tool_choice)
    fmt = serving.tool_call_parser
    messages = job.messages
    rendered_tools = None
    if not serving.tokenizer.template_takes_tools:
        messages = [_calls_in_content(m, fmt) for m in messages]
    if mode != "none":
        if serving.tokenizer.template_takes_tools:
            rendered_tools = tools
        else:
            messages = [{"role": "system", "content": format_instructions(fmt, tools)},
                        *messages]
    response_format = job.response_format
    max_calls = serving.max_parallel_tool_calls if job.parallel_tool_calls else 1
    if mode == "forced":
        # As OpenAI: a forced call is the call's grammar; a response format governs text only.
        schema = validate_schema(forced_call_schema(tools, forced_name, max_calls), "tools")
        response_format = {"type": "json_schema", "json_schema": schema}
    elif mode == "auto" and response_format is not None:
        # Either a tool call or an answer in the format: the model chooses.
        grammar = answer_or_calls_grammar(fmt, tools, response_format["json_schema"], max_calls)
        response_format = {"type": "json_schema",
                           "json_schema": validate_grammar(grammar, job.response_format_param)}
    sampling = job.sampling
    if mode == "auto" and fmt == "mistral":  # its [TOOL_CALLS] is a special token
        sampling = msgspec.structs.replace(sampling, skip_special_tokens=False)
    options = job.template_options
    if serving.reasoning_parser is not None and 0 in (job.reasoning_tokens, job.reasoning_share):
        # No thought wanted: templates that can leave it out (Qwen3's switch) do so.
        options = {"enable_thinking": False, **(options or {})}
    return _ChatPrompt(tools, mode, messages, rendered_tools, response_format, sampling, options)


async def start_chat(serving: ServingContext, job: ChatJob) -> ChatRun:
    run = await prepare_chat(serving, job)
    serving.state.admit(run.contexts)
    return run


def _renamed(exc: RequestError, job: ChatJob) -> RequestError:
    """The tokenizer's errors name chat's parameters; name this API's instead."""
    if exc.param == "max_tokens" and job.max_tokens_param != "max_tokens":
        exc.message = exc.message.replace("max_tokens=", f"{job.max_tokens_param}=", 1)
        exc.param = job.max_tokens_param
    elif exc.param == "messages" and job.messages_param != "messages":
        exc.param = job.messages_param
    return exc


def _calls_in_content(message: dict, fmt: str) -> dict:
    """A template that does not render tool_calls would hide the model's own calls from it:
    write them into the content, the way the model writes them."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str) for c in calls):
        return message  # the tokenizer refuses these, naming the parameter
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        if not all(isinstance(t, str) for t in texts):
            return message
        content = "".join(texts)
    try:
        calls_text = render_calls(fmt, calls)
    except (RecursionError, TypeError, ValueError):
        return message  # arguments nested too deeply: refused by the tokenizer
    return {**message, "content": (content if isinstance(content, str) else "") + calls_text}


class ChatRun:
    """Prepared contexts, and how to run and parse them."""

    def __init__(self, serving: ServingContext, job: ChatJob, contexts: list[TextContext],
                 sampling: SamplingFields, mode: str, tools: list[dict]) -> None:
        self.serving = serving
        self.job = job
        self.contexts = contexts
        self.sampling = sampling
        self.mode = mode
        self.thinking = False  # the output starts inside a thought
        self.request_id = ""
        failures = getattr(serving.engine.metrics, "tool_call_schema_failures", None)
        self.checker = ToolCallChecker(tools, failures) if mode != "none" else None
        self.started = time.monotonic()

    @property
    def first(self) -> list[TextContext]:
        """The contexts submitted before a stream's headers (the first choice of each)."""
        return self.contexts[:: self.job.n]

    @property
    def prompt_tokens(self) -> int:
        return self.contexts[0].prompt_length

    def budget(self, ctx: TextContext) -> int | None:
        job = self.job
        if job.reasoning_tokens is not None:
            return job.reasoning_tokens
        if job.reasoning_share is not None:
            return int(job.reasoning_share * (ctx.max_length - ctx.prompt_length))
        return None

    def deltas(self) -> AsyncIterator[ChatDelta]:
        streams = self.serving.choice_streams(self.contexts, self.sampling, self.job.n)
        choices = [self._choice(i, ctx, s) for i, (ctx, s) in
                   enumerate(zip(self.contexts, streams))]
        # One choice is returned itself, so closing it (client gone) reaches the engine at once.
        return choices[0] if len(choices) == 1 else merge_choices(choices)

    def _parsers(self):
        thoughts = ThinkParser(self.thinking) if self.serving.reasoning_parser else NoReasoning()
        calls = None
        if self.mode == "auto":
            calls = new_parser(self.serving.tool_call_parser)
        elif self.mode == "forced":
            calls = ForcedCallCollector()
        return thoughts, calls

    async def _choice(self, index: int, ctx: TextContext,
                      stream: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChatDelta]:
        thoughts, calls = self._parsers()
        budget = self.budget(ctx)
        prompt_tokens = ctx.prompt_length
        offset = 0  # completion tokens of the engine requests before this one
        counts = {"reasoning": 0, "calls": 0}
        generated: list[int] = []
        over_budget = False
        try:
            async for d in stream:
                generated += d.token_ids
                out = await self._parse(d, thoughts, calls, counts)
                out.prompt_tokens, out.completion_tokens = prompt_tokens, d.completion_tokens
                out.speculative = d.speculative
                over_budget = (not d.finish_reason and budget is not None
                               and thoughts.in_reasoning and counts["reasoning"] >= budget)
                yield out
                if over_budget:  # for metrics: this request ends at a length, not aborted
                    self.serving.engine.end_early(ctx.request_id, "length")
                if d.finish_reason or over_budget:
                    break
        finally:
            await stream.aclose()
        if not over_budget:
            return
        # The thought reached its budget: end it the way the model would, then go on.
        offset = len(generated)
        following = continue_after_thinking(self.serving.tokenizer, ctx, generated)
        forced = await self._parse(ChoiceDelta(index, CLOSE, []), thoughts, calls, counts)
        if following is None:  # no room left for the answer
            end = await self._parse(ChoiceDelta(index, "", [], "length"), thoughts, calls, counts)
            forced.finish_reason, forced.made_calls = end.finish_reason, end.made_calls
        forced.prompt_tokens, forced.completion_tokens = prompt_tokens, offset
        yield forced
        if following is None:
            return
        after, forced_tokens = following
        offset += forced_tokens
        stream = stream_choice(self.serving.engine, after, self.serving.tokenizer.delegate, index,
                               self.sampling.skip_special_tokens,
                               self._time_left())
        try:
            async for d in stream:
                out = await self._parse(d, thoughts, calls, counts)
                out.prompt_tokens = prompt_tokens
                out.completion_tokens = offset + d.completion_tokens
                yield out
                if d.finish_reason:
                    return
        finally:
            await stream.aclose()

    async def _parse(self, d: ChoiceDelta, thoughts, calls, counts: dict) -> ChatDelta:
        if thoughts.in_reasoning:
            counts["reasoning"] += len(d.token_ids)
        reasoning, content = thoughts.push(d.text)
        found: list[ToolCall] = []
        if calls is not None:
            content, found = calls.push(content)
        if d.finish_reason:
            more_reasoning, more = thoughts.finish()
            reasoning += more_reasoning
            if calls is not None:
                text, more_calls = calls.push(more)
                rest, last = calls.finish()
                content, found = content + text + rest, found + more_calls + last
            else:
                content += more
        if found:
            await self._check(found)
        counts["calls"] += len(found)
        pieces = calls.progress() if calls is not None else []
        dropped = calls.dropped() if calls is not None else []
        return ChatDelta(d.index, reasoning, content, found, d.finish_reason,
                         bool(counts["calls"]), d.stop_sequence,
                         reasoning_tokens=counts["reasoning"], logprobs=d.logprobs,
                         call_deltas=pieces, dropped_calls=dropped)

    async def _check(self, calls: list[ToolCall]) -> None:
        """Check the calls against their schemas (for metrics), off the event loop: request
        schemas can make the check slow."""
        try:
            await OFF_LOOP.run(lambda: [self.checker.check(call) for call in calls])
        except RequestError:  # the queue is full: no verdict
            pass

    def _time_left(self) -> float | None:
        timeout = self.serving.request_timeout
        if timeout is None:
            return None
        return max(0.001, timeout - (time.monotonic() - self.started))
