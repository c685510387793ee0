"""The bodies of Anthropic's POST /v1/messages and /v1/messages/count_tokens, and their
conversion into the chat form the shared pipeline takes.

Content blocks map onto chat messages: `text` blocks are the message's text, a user's `image`
blocks chat's image parts (`ImagePart`, named `messages[i].content[j]`), an assistant's
`tool_use` blocks its tool calls, a user's `tool_result` blocks tool messages (in block order).
Thinking blocks sent back are not shown to the model again, as chat templates drop past
thoughts.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from api_server.image_inputs import ImagePart
from api_server.protocol import (
    MAX_TOKEN_COUNT,
    MAX_TOOLS,
    CacheSalt,
    RequestError,
    SamplingFields,
    StopStrings,
    TokenCount,
    TopP,
    check_depth,
)
from api_server.reasoning import effort_budget
from api_server.structured import validate_schema

MAX_MESSAGES = 4096
MAX_BLOCKS = 1024  # content blocks of one message


class AnthropicMessage(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Any], Meta(max_length=MAX_BLOCKS)]


class ThinkingConfig(msgspec.Struct, kw_only=True):
    type: str  # "enabled", "disabled"; others ("adaptive", ...) leave it to the model
    budget_tokens: TokenCount | None = None


class OutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = msgspec.field(name="schema")


class OutputConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None
    format: OutputFormat | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: Annotated[list[AnthropicMessage], Meta(max_length=MAX_MESSAGES)]
    system: str | Annotated[list[Any], Meta(max_length=MAX_BLOCKS)] | None = None
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKEN_COUNT)]
    stop_sequences: StopStrings | None = None
    stream: bool | None = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=0, le=MAX_TOKEN_COUNT)] | None = None  # (and the vocabulary)
    metadata: dict[str, Any] | None = None
    # Extension (vLLM's field): keeps this tenant's prefix cache apart.
    cache_salt: CacheSalt | None = None


def sampling_of(req: MessagesRequest) -> SamplingFields:
    return SamplingFields(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                          stop=req.stop_sequences, cache_salt=req.cache_salt)


def thinking_budget(req: CountTokensRequest) -> int | None:
    """The thought's budget: `budget_tokens` when enabled, none when disabled."""
    thinking = req.thinking
    if thinking is None or thinking.type not in ("enabled", "disabled"):
        return None
    if thinking.type == "disabled":
        return 0
    if thinking.budget_tokens is None:
        raise RequestError("thinking.budget_tokens is required when thinking is enabled",
                           param="thinking.budget_tokens")
    max_tokens = getattr(req, "max_tokens", None)
    if max_tokens is not None and thinking.budget_tokens >= max_tokens:
        raise RequestError("thinking.budget_tokens must be less than max_tokens",
                           param="thinking.budget_tokens")
    return thinking.budget_tokens


def effort_share(req: CountTokensRequest) -> float | None:
    """`output_config.effort` as a share of the output budget for the thought."""
    effort = req.output_config.effort if req.output_config is not None else None
    return effort_budget(None if effort == "max" else effort, "output_config.effort")


def response_format(req: CountTokensRequest) -> dict | None:
    """`output_config.format` (structured outputs) as the pipeline's grammar."""
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is None:
        return None
    check_depth(fmt.schema_, "output_config.format.schema")
    return {"type": "json_schema",
            "json_schema": validate_schema(fmt.schema_, "output_config.format.schema")}


def chat_messages(req: CountTokensRequest) -> list[dict]:
    if not req.messages:
        raise RequestError("messages must not be empty", param="messages")
    out: list[dict] = []
    if req.system is not None:
        system = _texts(req.system, "system")
        if system:
            out.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        param = f"messages[{i}].content"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            out.append(_assistant(message.content, param))
        else:
            out += _user(message.content, param)
    return out


def _block_type(block: Any, param: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise RequestError("each content block must be an object with a type", param=param)
    return block["type"]


def _text_of(block: dict, param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise RequestError("a text block needs its text", param=f"{param}.text")
    return text


def _texts(content: Any, param: str) -> str:
    """A string, or text blocks joined (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError("expected a string or a list of text blocks", param=param)
    parts = []
    for j, block in enumerate(content):
        kind = _block_type(block, f"{param}[{j}]")
        if kind != "text":
            raise RequestError(f"unsupported block of type {kind!r} here; this model takes "
                               f"text", param=f"{param}[{j}].type")
        parts.append(_text_of(block, f"{param}[{j}]"))
    return "".join(parts)


def _assistant(blocks: list, param: str) -> dict:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        at = f"{param}[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_use":
            name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise RequestError("a tool_use block needs an id and a name", param=at)
            if not isinstance(args, dict):
                raise RequestError("a tool_use block's input must be an object",
                                   param=f"{at}.input")
            check_depth(args, f"{at}.input")
            calls.append({"id": call_id, "type": "function", "function": {
                "name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise RequestError(f"unsupported content block type {kind!r} in an assistant "
                               f"message", param=f"{at}.type")
    message = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list, param: str) -> list[dict]:
    out: list[dict] = []
    parts: list[dict | ImagePart] = []  # of the user message being gathered

    def flush():
        if any(isinstance(p, ImagePart) for p in parts):
            out.append({"role": "user", "content": list(parts)})
        elif parts:  # text only: one string, as chat sends it
            out.append({"role": "user", "content": "".join(p["text"] for p in parts)})
        parts.clear()

    for j, block in enumerate(blocks):
        at = f"{param}[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            parts.append({"type": "text", "text": _text_of(block, at)})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise RequestError("a tool_result block needs its tool_use_id",
                                   param=f"{at}.tool_use_id")
            flush()
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _texts(block.get("content", ""), f"{at}.content")})
        else:
            raise RequestError(f"unsupported content block type {kind!r}; this model takes "
                               f"text, images and tool results", param=f"{at}.type")
    flush()
    if not out:
        out.append({"role": "user", "content": ""})
    return out


def _image(block: dict, param: str) -> ImagePart:
    """An `image` block as chat's image part: a base64 source as a data: URL, a url source
    as itself (data: or an allowed file:// URL; the tokenizer checks and loads it with
    chat's rules, so the limits and errors are the same)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not media_type.startswith("image/"):
            raise RequestError("a base64 image source needs an image/* media_type",
                               param=f"{param}.source.media_type")
        if not isinstance(data, str) or not data:
            raise RequestError("a base64 image source needs its data",
                               param=f"{param}.source.data")
        return ImagePart(param, f"data:{media_type};base64,{data}")
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise RequestError("a url image source needs its url", param=f"{param}.source.url")
        return ImagePart(param, url)
    raise RequestError("an image block's source must be {\"type\": \"base64\", "
                       "\"media_type\", \"data\"} or {\"type\": \"url\", \"url\"}",
                       param=f"{param}.source")


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom":
            raise RequestError(f"unsupported tool type {tool.get('type')!r}; this server runs "
                               f"client tools (name, description, input_schema)",
                               param=f"tools[{i}].type")
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise RequestError("input_schema must be a JSON schema object",
                               param=f"tools[{i}].input_schema")
        fn = {"name": tool.get("name")}  # chat's key order: the same tools, the same prompt
        if "description" in tool:
            fn["description"] = tool["description"]
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict | None):
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise RequestError("tool_choice.type must be auto, any, tool or none",
                       param="tool_choice.type")
