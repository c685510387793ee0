"""The body of POST /v1/responses, and its conversion into the chat form the shared pipeline
takes (`api_server.chat_turn.ChatJob`).

Input items map onto chat messages as OpenAI defines them: a message item is a message, a
`function_call` is an assistant tool call, a `function_call_output` a tool message. Reasoning
items are not sent back to the model (chat templates drop past thoughts as well). A message's
`input_image` parts become chat's image parts (`ImagePart`, named `input[i].content[j]`).
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
    Seed,
    Temperature,
    TokenCount,
    TopK,
    TopP,
    check_depth,
)
from api_server.structured import ANY_JSON_OBJECT, validate_schema

MAX_INPUT_ITEMS = 4096  # messages and tool outputs of one conversation
MAX_CONTENT_PARTS = 1024  # parts of one message
MAX_METADATA_PAIRS = 16  # OpenAI's own limit


class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningOptions(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None
    # An extension (OpenRouter's name): the thought's budget in tokens.
    max_tokens: TokenCount | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | Annotated[list[Any], Meta(max_length=MAX_INPUT_ITEMS)]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKEN_COUNT)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    stream: bool | None = False
    store: bool | None = None  # None: the server's default (--responses-store-default)
    previous_response_id: str | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=MAX_METADATA_PAIRS)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    user: str | None = None
    # Extension (vLLM's, as on chat completions): keeps this tenant's prefix cache apart.
    cache_salt: CacheSalt | None = None
    # Extensions, as on chat completions.
    seed: Seed | None = None
    top_k: TopK | None = None  # (and at most the vocabulary: checked with it)


def sampling_of(req: ResponsesRequest) -> SamplingFields:
    return SamplingFields(temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                          top_k=req.top_k, cache_salt=req.cache_salt)


def check_supported(req: ResponsesRequest) -> None:
    if req.background:
        raise RequestError("background responses are not supported", param="background")
    if req.truncation == "auto":
        raise RequestError("truncation 'auto' is not supported: a conversation longer than the "
                           "context is refused, never cut", param="truncation")


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The conversation of `input` (without `instructions`) as chat messages."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    if not req.input:
        raise RequestError("input must not be empty", param="input")
    messages: list[dict] = []
    for i, item in enumerate(req.input):
        _add_item(messages, item, f"input[{i}]")
    if not messages:
        raise RequestError("input holds no message", param="input")
    return messages


_INPUT_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def input_items_of(req: ResponsesRequest, prefix: str) -> list[dict]:
    """`input` as GET /v1/responses/{id}/input_items lists it: items with ids, a message's
    string content as a text part (input_text, or output_text for the assistant)."""
    raw = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    items = []
    for i, item in enumerate(raw):
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        item.setdefault("id", f"{_INPUT_ITEM_PREFIX.get(kind, 'item')}_{prefix}{i:03d}")
        items.append(item)
    return items


def list_page(items: list[dict], query) -> dict:
    """One page of `items` as OpenAI's list endpoints give it, from the query parameters
    `order` (asc or desc, default desc), `after` / `before` (an item id: the page starts after
    it / ends before it, in that order) and `limit` (1 to 100, default 20)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise RequestError("order must be 'asc' or 'desc'", param="order")
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise RequestError("limit must be an integer from 1 to 100", param="limit")
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start, end = 0, len(ordered)
    for param in ("after", "before"):
        cursor = query.get(param)
        if cursor is None:
            continue
        if cursor not in ids:
            raise RequestError(f"no input item {cursor!r}", param=param)
        if param == "after":
            start = ids.index(cursor) + 1
        else:
            end = ids.index(cursor)
    window = ordered[start:end]
    # Before a cursor the page is the items nearest to it; after one, the nearest too.
    data = window[-limit:] if query.get("before") is not None and query.get("after") is None \
        else window[:limit]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(data) < len(window)}


def _add_item(messages: list[dict], item: Any, param: str) -> None:
    if not isinstance(item, dict):
        raise RequestError("each input item must be an object", param=param)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise RequestError("a message's role must be user, system, developer or assistant",
                               param=f"{param}.role")
        messages.append({"role": role, "content": _content(item.get("content"),
                                                           f"{param}.content", role)})
    elif kind == "function_call":
        name, call_id = item.get("name"), item.get("call_id")
        arguments = item.get("arguments", "{}")
        for key, value in (("name", name), ("call_id", call_id), ("arguments", arguments)):
            if not isinstance(value, str) or (key != "arguments" and not value):
                raise RequestError(f"a function_call needs a string {key}",
                                   param=f"{param}.{key}")
        try:  # the template walks the arguments: bound their nesting
            check_depth(json.loads(arguments), f"{param}.arguments")
        except (ValueError, RecursionError):
            pass  # not JSON: the template gets the text
        call = {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            raise RequestError("a function_call_output needs its call_id",
                               param=f"{param}.call_id")
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": _text(item.get("output"), f"{param}.output")})
    elif kind == "reasoning":
        return
    else:
        raise RequestError(f"unsupported input item type {kind!r}; this server takes "
                           f"message, function_call, function_call_output and reasoning items",
                           param=f"{param}.type")


def _content(content: Any, param: str, role: str) -> str | list:
    """A message's content: text parts joined, or, when it holds images, chat's content
    parts (text parts and ImageParts, which the tokenizer takes as chat's image_url parts)."""
    if not isinstance(content, list) or role == "assistant":
        return _text(content, param)
    if not any(isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        return _text(content, param)
    _check_parts(content, param)
    return [_image(part, f"{param}[{j}]") if part.get("type") == "input_image" else
            {"type": "text", "text": _text([part], param, j)} for j, part in enumerate(content)]


def _image(part: dict, param: str) -> ImagePart:
    """An `input_image` part: its `image_url` a data: URL or a file:// URL, checked (and
    the image loaded) with chat's rules by the tokenizer. `detail` is accepted and ignored:
    the model's processor decides the resolution."""
    url = part.get("image_url")
    if part.get("file_id") is not None and url is None:
        raise RequestError("input_image by file_id is not supported (this server has no "
                           "Files API); send image_url as a data: URL", param=param)
    if not isinstance(url, str) or not url:
        raise RequestError("an input_image part needs its image_url", param=param)
    return ImagePart(param, url)


def _text(content: Any, param: str, first: int = 0) -> str:
    """A message's content: a string, or text parts joined (`first`: the index of
    content[0] in the message, for errors)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError("content must be a string or a list of text parts", param=param)
    _check_parts(content, param)
    texts = []
    for j, part in enumerate(content, first):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":  # (the other roles' images are ImageParts by now)
            raise RequestError("an assistant message can't hold images", param=f"{param}[{j}]")
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise RequestError(f"unsupported content part of type {kind!r}; this model takes "
                               f"text", param=f"{param}[{j}]")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise RequestError("a text part needs its text", param=f"{param}[{j}]")
        texts.append(text)
    return "".join(texts)


def _check_parts(content: list, param: str) -> None:
    if len(content) > MAX_CONTENT_PARTS:
        raise RequestError(f"at most {MAX_CONTENT_PARTS} content parts", param=param,
                           code="limit_exceeded")


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools in chat's nested form."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function":
            raise RequestError(f"unsupported tool type {tool.get('type')!r}; this server runs "
                               f"function tools", param=f"tools[{i}].type")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise RequestError("tool_choice must be 'none', 'auto', 'required' or "
                       "{\"type\": \"function\", \"name\": ...}", param="tool_choice")


def response_format(req: ResponsesRequest) -> dict | None:
    """`text.format` as the pipeline's grammar (validated)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        schema = validate_schema(ANY_JSON_OBJECT, "text.format")
    else:
        if fmt.schema_ is None:
            raise RequestError("text.format of type json_schema needs its schema",
                               param="text.format.schema")
        check_depth(fmt.schema_, "text.format.schema")
        schema = validate_schema(fmt.schema_, "text.format.schema")
    return {"type": "json_schema", "json_schema": schema}


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as chat messages (kept for previous_response_id)."""
    messages: list[dict] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(p.get("text", "") for p in item["content"])
            messages.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            _add_item(messages, {k: item[k] for k in ("type", "name", "call_id", "arguments")},
                      "output")
    return messages


def describe_format(req: ResponsesRequest) -> dict:
    """`text` as the response echoes it."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"format": {"type": "text"}}
    return {"format": json.loads(msgspec.json.encode(fmt))}
