"""Tool calls as each model family writes them, parsed out of the streamed output.

- hermes (Qwen2.5/3, Hermes, and the format Loom teaches templates without tool support):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the text.
- llama3_json (Llama 3.1+): the whole output is `{"name": ..., "parameters": {...}}`, possibly
  after `<|python_tag|>`, several separated by `;`.
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` (optionally `[CALL_ID]id` before `[ARGS]`). `[TOOL_CALLS]` is a
  special token, so these outputs are detokenized with special tokens kept.

Every parser streams: content goes out as soon as it can't be part of a call, and each call as
soon as its text is complete; a call's arguments stream as they are written (`progress()`)
from when its name is complete and its arguments object has begun. Text that looks like a
call but does not parse comes back as content, exactly as written: a model's output is never
dropped. The edge: a call whose arguments had begun to stream and that then does not parse
(invalid JSON, or cut by the length limit) is reported by `dropped()`; its streamed start
stays with the client, marked dropped where the API can say so.
"""

from __future__ import annotations

import json
from typing import Any

from api_server.reasoning import partial_suffix
from api_server.tool_calls import CLOSE as HERMES_CLOSE
from api_server.tool_calls import OPEN as HERMES_OPEN
from api_server.tool_calls import (
    CallDelta,
    CallStreams,
    ToolCall,
    ToolCallParser,
    forced_call_schema,
    one_call_schema,
    tools_system_prompt,
)
from pipelines.grammar import JSON_GRAMMAR_OPTIONS

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_decoder = json.JSONDecoder()


def resolve_tool_call_parser(flag: str, chat_template) -> str:
    """The parser of `--tool-call-parser`; `auto` reads the chat template's own format."""
    if flag not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {flag!r}; choose from {TOOL_CALL_PARSERS}")
    if flag != "auto":
        return flag
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    text = "".join(t for t in templates if isinstance(t, str))
    if MISTRAL_CALLS in text:
        return "mistral"
    if HERMES_OPEN in text:
        return "hermes"
    if PYTHON_TAG in text or "ipython" in text:
        return "llama3_json"
    return "hermes"  # what tools_system_prompt teaches templates that take no tools


def call_from_value(value: Any) -> ToolCall | None:
    """A parsed JSON value as a call: a name and an arguments object (or None)."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def calls_from_text(text: str) -> list[ToolCall] | None:
    """One call object or a list of them, as JSON text; None unless all are calls."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = [call_from_value(item) for item in items]
    return calls if calls and all(calls) else None


class HermesParser(ToolCallParser):
    """`<tool_call>` blocks, anywhere in the text (the tag scanning of ToolCallParser)."""

    def _parse(self, body: str) -> list[ToolCall]:
        calls = calls_from_text(body.strip()) or []
        self.calls += calls
        return calls


class Llama3JsonParser:
    """Llama 3's JSON calls: an output that starts with `{` (or `<|python_tag|>`) is held back
    until its objects are complete; if each is a call, they are the answer."""

    def __init__(self) -> None:
        self.buffer = ""
        self.written = ""  # all the output: the text the calls stream from
        self.state = "start"  # "start": undecided; "calls": reading calls; "text": content
        self.streaming = CallStreams()

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        self.written += delta
        if self.state == "start":
            head = self.buffer.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return "", []
            body = head[len(PYTHON_TAG):].lstrip() if head.startswith(PYTHON_TAG) else head
            if not body:
                return "", []
            self.state = "calls" if body[0] in "{[" else "text"
            if self.state == "calls":
                self.streaming.begin()
        if self.state == "text":
            out, self.buffer = self.buffer, ""
            return out, []
        self.streaming.read(self.written)
        if "}" not in delta and "]" not in delta:
            return "", []
        return self._take_calls(final=False)

    def _take_calls(self, final: bool) -> tuple[str, list[ToolCall]]:
        """Calls complete at the front of the buffer; the rest waits (or, at the end, is
        content). A complete JSON value that is not a call turns the rest into content."""
        calls: list[ToolCall] = []
        while True:
            text = self.buffer.lstrip().removeprefix(PYTHON_TAG).lstrip().lstrip(";").lstrip()
            if not text:
                self.buffer = ""
                return "", calls
            try:
                value, end = _decoder.raw_decode(text)
            except (ValueError, RecursionError):
                if final:
                    self.state = "text"
                    self.streaming.end()
                    out, self.buffer = self.buffer, ""
                    return out, calls
                return "", calls
            found = [call_from_value(v) for v in (value if isinstance(value, list) else [value])]
            if not found or not all(found):
                self.state = "text"
                self.streaming.end()
                out, self.buffer = self.buffer, ""
                return out, calls
            calls += self.streaming.settle(found)
            self.buffer = text[end:]

    def progress(self) -> list[CallDelta]:
        return self.streaming.progress()

    def dropped(self) -> list[ToolCall]:
        return self.streaming.take_dropped()

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self.state == "calls":
            out, calls = self._take_calls(final=True)
            self.streaming.end()
            return out, calls
        out, self.buffer = self.buffer, ""
        return out, []


class MistralParser:
    """Content up to `[TOOL_CALLS]`, then calls in either of Mistral's layouts."""

    def __init__(self) -> None:
        self.buffer = ""
        self.inside = False
        self.streaming = CallStreams()  # the JSON list layout's calls stream

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self.inside:
                at = self.buffer.find(MISTRAL_CALLS)
                if at < 0:
                    keep = partial_suffix(self.buffer, MISTRAL_CALLS)
                    content.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:at])
                self.buffer = self.buffer[at:]
                self.inside = True
                self.streaming.begin()
            if self.buffer[len(MISTRAL_CALLS):].lstrip().startswith("["):
                self.streaming.read(self.buffer)
            parsed = self._one(final=False)
            if parsed is None:  # incomplete: wait for more
                break
            found, rest = parsed
            if found is None:  # not calls after all: show it as written
                self.streaming.end()
                content.append(self.buffer)
                self.buffer, self.inside = "", False
                break
            calls += self._settled(found)
            self.buffer, self.inside = rest, False
        return "".join(content), calls

    def _settled(self, found: list[ToolCall]) -> list[ToolCall]:
        calls = self.streaming.settle(found)
        self.streaming.end()
        return calls

    def _one(self, final: bool):
        """The calls after the `[TOOL_CALLS]` at the buffer's start: (calls, rest), (None, _)
        when they do not parse, None when they may still be incomplete."""
        body = self.buffer[len(MISTRAL_CALLS):].lstrip()
        if not body:
            return (None, "") if final else None
        if body[0] == "[":
            try:
                value, end = _decoder.raw_decode(body)
            except (ValueError, RecursionError):
                return (None, "") if final else None
            found = [call_from_value(v) for v in (value if isinstance(value, list) else [value])]
            return (found, body[end:]) if found and all(found) else (None, "")
        at = body.find(MISTRAL_ARGS)
        if at < 0:
            return (None, "") if final or len(body) > 256 else None
        name = body[:at].split(MISTRAL_CALL_ID)[0].strip()
        args_text = body[at + len(MISTRAL_ARGS):].lstrip()
        try:
            args, end = _decoder.raw_decode(args_text)
        except (ValueError, RecursionError):
            if final or (args_text and args_text[0] != "{"):
                return None, ""
            return None  # the arguments may still be coming
        call = call_from_value({"name": name, "arguments": args})
        return ([call], args_text[end:]) if call else (None, "")

    def progress(self) -> list[CallDelta]:
        return self.streaming.progress()

    def dropped(self) -> list[ToolCall]:
        return self.streaming.take_dropped()

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        while self.inside:
            found, rest = self._one(final=True)
            if found is None:
                self.streaming.end()
                content.append(self.buffer)
                self.buffer, self.inside = "", False
                break
            calls += self._settled(found)
            self.buffer, self.inside = rest, False
            more, more_calls = self.push("")
            content.append(more)
            calls += more_calls
        content.append(self.buffer)
        self.buffer = ""
        return "".join(content), calls


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


def new_parser(name: str):
    return PARSERS[name]()


def format_instructions(name: str, tools: list[dict]) -> str:
    """The system message that teaches a template without tool support the parser's format."""
    if name == "hermes":
        return tools_system_prompt(tools)
    listing = "\n".join(json.dumps(t["function"]) for t in tools)
    shape = ('{"name": <function name>, "parameters": <arguments object>}'
             if name == "llama3_json" else
             MISTRAL_CALLS + '[{"name": <function name>, "arguments": <arguments object>}]')
    return ("You can call functions. The available functions are:\n" + listing +
            f"\nTo call one, reply with {shape} and nothing else.")


def render_calls(name: str, calls: list[dict]) -> str:
    """Past calls (OpenAI's tool_calls of an assistant message) written the way the model
    writes them, for templates that do not render tool_calls themselves."""
    items = []
    for call in calls:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                pass
        items.append((fn.get("name"), args))
    if name == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                         for n, a in items)
    if name == "mistral":
        return MISTRAL_CALLS + json.dumps([{"name": n, "arguments": a} for n, a in items],
                                          ensure_ascii=False)
    return "".join(HERMES_OPEN + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) +
                   HERMES_CLOSE for n, a in items)


def _lark_json(schema: dict) -> str:
    """A Lark `%json` rule body: the schema, compact JSON output as in a response format."""
    return "%json " + json.dumps({"x-guidance": JSON_GRAMMAR_OPTIONS, **schema})


def answer_or_calls_grammar(name: str, tools: list[dict], answer_schema: str,
                            max_calls: int) -> str:
    """tool_choice auto beside a response format, as OpenAI has it: the output is either an
    answer in the format or tool calls written the model's way (one to `max_calls`), a Lark
    grammar whose alternatives are the two."""
    answer = _lark_json(json.loads(answer_schema))

    def repeated(separator: str) -> str:  # one to max_calls calls (Lark has no {0,0})
        if max_calls == 1:
            return "call"
        if not separator:
            return f"call{{1,{max_calls}}}"
        return f"call ({json.dumps(separator)} call){{0,{max_calls - 1}}}"

    if name == "llama3_json":
        calls = f'{repeated("; ")}\ncall: {_lark_json(one_call_schema(tools, "parameters"))}'
    elif name == "mistral":
        calls = f"{json.dumps(MISTRAL_CALLS)} " + _lark_json(
            forced_call_schema(tools, None, max_calls))
    else:
        # Nothing between the calls: whatever is there would be content beside them.
        calls = (f'{repeated("")}\n'
                 f'call: {json.dumps(HERMES_OPEN)} "\\n"? {_lark_json(one_call_schema(tools))} '
                 f'"\\n"? {json.dumps(HERMES_CLOSE)}')
    return f"start: answer | calls\nanswer: {answer}\ncalls: {calls}\n"
