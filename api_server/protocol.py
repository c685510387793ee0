"""OpenAI request bodies as msgspec Structs: decoding validates types, ranges are checked by
`check_*`; every failure becomes a 400 that names the offending parameter.

Unknown fields are ignored, as OpenAI's own server does, so clients that send newer fields
keep working.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
# Every number the worker turns into a tensor or a generator seed is bounded here, where it is
# parsed: one out-of-range value must be this request's 400, never a failed step for the batch.
# top_k: -1 or 0 turn it off (vLLM's meanings); above the vocabulary it is refused once the
# vocabulary is known (`check_top_k`). Seeds: a 64-bit integer, as vLLM takes them.
MAX_TOKEN_COUNT = (1 << 31) - 1  # token counts (max_tokens, min_tokens, top_k)
TopK = Annotated[int, Meta(ge=-1, le=MAX_TOKEN_COUNT)]
Seed = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
TokenCount = Annotated[int, Meta(ge=0, le=MAX_TOKEN_COUNT)]
# Finite, and far enough from 0 that dividing a logit by it stays finite in float32.
RepetitionPenalty = Annotated[float, Meta(ge=0.01, le=100.0)]

# Request-controlled sizes that no other check bounds (the body limit aside). Each is a 400
# naming the parameter; README's security section lists them.
MAX_STOP_STRINGS = 16  # OpenAI takes 4, TGI 4 by default; lm-eval sends up to ~10
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024  # OpenAI's own limit is 300
MAX_TOOLS = 128
MAX_MESSAGES = 4096  # of a chat conversation, as /v1/responses and /v1/messages cap theirs
MAX_CACHE_SALT_CHARS = 256
MAX_JSON_DEPTH = 64  # nesting of schemas, template variables, message parts

# vLLM's cache_salt: requests with different salts never share prefix-cache blocks.
CacheSalt = Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]
StopStrings = Annotated[list[Annotated[str, Meta(max_length=MAX_STOP_STRING_CHARS)]],
                        Meta(max_length=MAX_STOP_STRINGS)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaSpec(msgspec.Struct, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields common to completions and chat (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    max_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Meta(ge=1, le=128)] = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str, Meta(max_length=MAX_STOP_STRING_CHARS)] | StopStrings | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    user: str | None = None
    logit_bias: Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    # Extensions, as vLLM names them.
    top_k: TopK | None = None
    min_p: Probability | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: TokenCount = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[int], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    cache_salt: CacheSalt | None = None
    # Extension: false keeps this request out of speculative decoding.
    speculative_decoding: bool = True


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of lists of token ids.
    prompt: Union[str, list[Union[str, int, list[int]]]]
    echo: bool | None = False
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    suffix: str | None = None
    # vLLM's extension: logprobs name tokens "token_id:N" (for clients that need the ids).
    return_tokens_as_token_ids: bool | None = False


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_MESSAGES)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    return_tokens_as_token_ids: bool | None = False
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Reasoning models: a budget for the thought (an extension, as vLLM's), or OpenAI's effort.
    max_reasoning_tokens: TokenCount | None = None
    reasoning_effort: str | None = None


class RequestError(Exception):
    """A client error: becomes an OpenAI-shaped error response."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.type = type_ or _error_type(status)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def _error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error",
            404: "not_found_error", 413: "invalid_request_error",
            429: "rate_limit_error"}.get(status, "server_error" if status >= 500 else
                                         "invalid_request_error")


_PATH = re.compile(r"at `\$\.?(.*)`")


def decode_body(body: bytes, type_: type) -> Any:
    """Decode and type-check a JSON body; errors name the offending parameter."""
    if not body.strip():
        raise RequestError("the request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH.search(text)
        param = match.group(1) if match else None
        if text.startswith("Object missing required field"):
            field = text.split("`")[1]
            param = f"{param}.{field}" if param else field
        code = "limit_exceeded" if "length <=" in text else None
        raise RequestError(text, param=param or None, code=code) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"invalid JSON body: {exc}") from None
    except RecursionError:
        raise RequestError("the JSON body is nested too deeply") from None


def check_top_k(top_k: int | None, vocab_size: int) -> None:
    """top_k past the vocabulary means nothing (and once overflowed the worker's tensors):
    refused with the vocabulary's size, which the msgspec type cannot know."""
    if top_k is not None and top_k > vocab_size:
        raise RequestError(f"top_k must be at most the vocabulary size ({vocab_size}), or "
                           f"-1 or 0 to turn it off; got {top_k}", param="top_k")


def check_depth(value: Any, param: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON nested deeper than `max_depth`: schemas, template variables and tool
    arguments are walked recursively further on (json.dumps, Jinja, llguidance), and a
    RecursionError there would be a 500. Iterative, so the check itself can't overflow."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            raise RequestError(f"{param} is nested deeper than {max_depth} levels", param=param)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def prompts_of(request: CompletionRequest) -> list[str | list[int]]:
    """A completion request's prompt(s), one list entry per prompt."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [_check_ids(prompt, "prompt")]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [_check_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise RequestError("prompt must be a string, a list of strings, a list of token ids or a "
                       "list of lists of token ids, not a mix", param="prompt")


def _check_ids(ids: list[int], param: str) -> list[int]:
    if not ids:
        raise RequestError(f"{param} must not be empty", param=param)
    if min(ids) < 0:
        raise RequestError(f"{param} holds a negative token id", param=param)
    return ids
