"""Tool calls on chat completions.

- `tool_choice` "required" or a named function: decoding is constrained to a JSON value that
  is a valid call (its arguments validate against the tool's parameter schema).
- "auto": the model calls tools in the Hermes format its chat template teaches it,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; `ToolCallParser` cuts those
  blocks out of the text stream (never leaking a partial tag) and turns them into tool calls.
  Templates that take no `tools` get the tool list and the format in a system message.

Either way a call's arguments stream as the model writes them (`CallReader`, as OpenAI
streams argument deltas): under auto from when its name is complete and its arguments object
has begun, since only then is it likely a call; one that still fails to parse is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from api_server.protocol import RequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"


def check_tools(tools: list[dict] | None, tool_choice: Any) -> tuple[list[dict], str | None]:
    """Validated tools and the forced function name (None unless one is named)."""
    tools = tools or []
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError("each tool needs type 'function' and a function name",
                               param=f"tools[{i}]")
        if not isinstance(fn.get("parameters", {}), dict):
            raise RequestError("function parameters must be a JSON schema object",
                               param=f"tools[{i}].function.parameters")
        names.append(fn["name"])
    if tool_choice in (None, "none", "auto"):
        return tools, None
    if tool_choice == "required":
        if not tools:
            raise RequestError("tool_choice 'required' needs tools", param="tool_choice")
        return tools, None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in names:
            raise RequestError(f"tool_choice names an unknown function {name!r}",
                               param="tool_choice")
        return tools, name
    raise RequestError("tool_choice must be 'none', 'auto', 'required' or a named function",
                       param="tool_choice")


def _closed(schema: dict) -> dict:
    """Objects without an explicit additionalProperties get `false` (OpenAI's strict mode):
    a call then holds exactly the declared arguments, which still validates against the
    original schema."""
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_values(v) if k in ("properties", "$defs", "definitions") else
           ([_closed(x) for x in v] if k in ("anyOf", "oneOf", "allOf") and isinstance(v, list)
            else _closed(v) if k == "items" else v)
           for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _closed_values(mapping):
    return {k: _closed(v) for k, v in mapping.items()} if isinstance(mapping, dict) else mapping


# Keys whose values are data, not schemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = ("const", "enum", "default", "examples", "example")


def _rebased(schema, base: str):
    """`schema` moved to the JSON pointer `base` of a larger schema: every local `$ref` ("#",
    "#/$defs/X", "#/definitions/X", "#/properties/...") points where its target now is, so
    nested models and recursive schemas keep resolving."""
    if isinstance(schema, list):
        return [_rebased(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = "#" + base + v[1:]
        elif k in _DATA_KEYWORDS:
            out[k] = v
        else:
            out[k] = _rebased(v, base)
    return out


def _tool_key(i: int) -> str:
    return f"tool_{i}"


def _call_schema(tool: dict, key: str, args_key: str = "arguments") -> dict:
    """One call of `tool`: its arguments are a reference to its parameters, which the
    combined schema holds under `$defs/key` (see `_tool_defs`)."""
    return {"type": "object",
            "properties": {"name": {"const": tool["function"]["name"]},
                           args_key: {"$ref": f"#/$defs/{key}"}},
            "required": ["name", args_key], "additionalProperties": False}


def _tool_defs(tools: list[tuple[str, dict]]) -> dict:
    """Each tool's parameter schema (closed, as OpenAI's strict mode) at the root's `$defs`,
    with its own `$defs` / `definitions` and every `$ref` rebased: a schema is only valid at
    the root it was written for, and a call nests it inside another object."""
    return {key: _rebased(_closed(tool["function"].get("parameters") or {"type": "object"}),
                          f"/$defs/{key}") for key, tool in tools}


def forced_call_schema(tools: list[dict], name: str | None, max_calls: int | None = None,
                       args_key: str = "arguments") -> dict:
    """The JSON every output must match: one call of `name`, or one to `max_calls` calls
    of any tool (a list that the model ends by closing it)."""
    if name is not None:
        keyed = [(_tool_key(i), t) for i, t in enumerate(tools)
                 if t["function"]["name"] == name][:1]
        return {**_call_schema(keyed[0][1], keyed[0][0], args_key), "$defs": _tool_defs(keyed)}
    keyed = [(_tool_key(i), t) for i, t in enumerate(tools)]
    schema = {"type": "array", "minItems": 1,
              "items": {"anyOf": [_call_schema(t, key, args_key) for key, t in keyed]},
              "$defs": _tool_defs(keyed)}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def one_call_schema(tools: list[dict], args_key: str = "arguments") -> dict:
    """One call of any of `tools` (a single object, not a list)."""
    keyed = [(_tool_key(i), t) for i, t in enumerate(tools)]
    return {"anyOf": [_call_schema(t, key, args_key) for key, t in keyed],
            "$defs": _tool_defs(keyed)}


def calls_from_json(text: str) -> list[ToolCall]:
    value = json.loads(text)
    items = value if isinstance(value, list) else [value]
    return [ToolCall(item["name"], json.dumps(item.get("arguments", {}))) for item in items]


def tools_system_prompt(tools: list[dict]) -> str:
    listing = "\n".join(json.dumps(t["function"]) for t in tools)
    return ("You can call functions. The available functions are:\n" + listing +
            f"\nTo call one, reply with {OPEN}{{\"name\": <function name>, \"arguments\": "
            f"<arguments object>}}{CLOSE} and nothing else.")


class ToolCallParser:
    """Splits streamed text into plain content and Hermes-style tool calls. A call's arguments
    stream (`progress()`) once its name is complete and its arguments object has begun; a
    call that then does not parse (the model wrote something else, or the length limit cut
    it) is shown as the text it was, and its streamed start is reported by `dropped()`."""

    def __init__(self) -> None:
        self.buffer = ""
        self.inside = False
        self.calls: list[ToolCall] = []
        self.streaming = CallStreams()

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Returns (content safe to show now, tool calls completed by this delta)."""
        self.buffer += delta
        content, done = [], []
        while True:
            if not self.inside:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self.buffer, OPEN)
                    content.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:at])
                self.buffer = self.buffer[at + len(OPEN):]
                self.inside = True
                self.streaming.begin()
            else:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    self.streaming.read(
                        self.buffer[: len(self.buffer) - _partial_suffix(self.buffer, CLOSE)])
                    break
                body = self.buffer[:end]
                self.streaming.read(body)
                calls = self.streaming.settle(self._parse(body))
                self.streaming.end()
                if calls:
                    done += calls
                else:  # not a call after all: show it as it was written
                    content.append(OPEN + body + CLOSE)
                self.buffer = self.buffer[end + len(CLOSE):]
                self.inside = False
        return "".join(content), done

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output: an unclosed call is parsed if it is complete JSON, else shown."""
        rest, self.buffer = self.buffer, ""
        if self.inside:
            self.inside = False
            self.streaming.read(rest)
            calls = self.streaming.settle(self._parse(rest))
            self.streaming.end()
            return ("" if calls else OPEN + rest), calls
        return rest, []

    def progress(self) -> list[CallDelta]:
        return self.streaming.progress()

    def dropped(self) -> list[ToolCall]:
        return self.streaming.take_dropped()

    def _parse(self, body: str) -> list[ToolCall]:
        try:
            calls = calls_from_json(body.strip())
        except (ValueError, KeyError, TypeError, AttributeError):
            return []
        self.calls += calls
        return calls


class CallStreams:
    """Streams the calls of an auto-mode parser's call text (a `CallReader` from `begin()` to
    `end()`) before the parser knows they are calls, and settles them as it parses them: the
    calls it parsed keep the ids and arguments text they streamed with. The edge: a call
    whose start was streamed but that then does not parse is `dropped` (its pieces stop; the
    parser shows the text as content)."""

    def __init__(self) -> None:
        self.reader: CallReader | None = None
        self.settled = 0  # how many of the reader's calls the parser has confirmed
        self.pending: list[CallDelta] = []  # pieces not yet given out
        self.sent: set[str] = set()  # ids of the calls whose pieces were given out
        self.dropped: list[ToolCall] = []

    def begin(self) -> None:
        self.reader, self.settled = CallReader(), 0

    def read(self, text: str) -> None:
        """`text`: all the call text so far (it only grows)."""
        if self.reader is not None:
            self.reader.read(text)
            self.pending += self.reader.progress()

    def settle(self, parsed: list[ToolCall]) -> list[ToolCall]:
        """The calls the parser parsed next, as streamed where they were; a mismatch (the
        reader read something else) ends streaming until the next `begin()`."""
        reader = self.reader
        if reader is None or not parsed:
            return parsed
        streamed = reader.done[self.settled:self.settled + len(parsed)]
        if [c.name for c in streamed] == [c.name for c in parsed]:
            self.settled += len(parsed)
            return streamed  # each call's arguments the text that streamed
        self.end()
        return parsed

    def end(self) -> None:
        """No more calls in this text: any started beyond those settled are dropped."""
        reader, self.reader = self.reader, None
        if reader is None:
            return
        started = reader.done[self.settled:] + ([reader.call] if reader.call else [])
        ids = {c.id for c in started}
        self.pending = [p for p in self.pending if p.call.id not in ids]
        self.dropped += [c for c in started if c.id in self.sent]

    def progress(self) -> list[CallDelta]:
        pieces, self.pending = self.pending, []
        self.sent |= {p.call.id for p in pieces}
        return pieces

    def take_dropped(self) -> list[ToolCall]:
        dropped, self.dropped = self.dropped, []
        return dropped


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class CallDelta:
    """A piece of the arguments of a call still being written (streamed as it comes)."""
    call: ToolCall  # its id and name; its arguments are set when it is complete
    arguments: str


# A call as the forced grammar writes it, and as chat templates teach models to: the name
# first, then the arguments (Llama 3 names them "parameters").
_CALL_START = re.compile(r'\{\s*"name"\s*:\s*(?=")')
_ARGS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_decoder = json.JSONDecoder()


class CallReader:
    """Reads calls `{"name": ..., "arguments": {...}}` (or a list of them) as they are written:
    a call starts once its name is complete and its arguments object has begun, and its
    arguments stream from then on (`progress()`), the model's own text, until the object
    closes. The concatenation of a call's pieces is its arguments exactly. A call written
    otherwise (arguments first, or as a JSON string) is not read: its parser returns it whole."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # how far the text has been read
        self.state = "name"  # looking for a call's name / reading its arguments / "off"
        self.call: ToolCall | None = None
        self.start = 0  # where the arguments of the call being read start
        self.shown = 0  # how far they have been given out by progress()
        self.depth, self.in_string, self.escaped = 0, False, False
        self.pieces: list[CallDelta] = []
        self.done: list[ToolCall] = []

    def read(self, text: str) -> list[ToolCall]:
        """`text`: all written so far (it only grows). Returns the calls it completes."""
        self.text = text
        done = []
        while True:
            if self.state == "off":
                return done
            if self.state == "name":
                if not self._start_call():
                    return done
            elif self._read_arguments():
                self._show()
                self.call.arguments = self.text[self.start:self.pos]
                done.append(self.call)
                self.done.append(self.call)
                self.call, self.state = None, "name"
            else:
                self._show()
                return done

    def _start_call(self) -> bool:
        text = self.text
        found = _CALL_START.search(text, self.pos)
        if found is None:
            return False
        try:  # the name as JSON reads it (escapes and all), once it is complete
            name, end = _decoder.raw_decode(text, found.end())
        except ValueError:
            return False
        key = _ARGS_KEY.match(text, end)
        if key is None or key.end() >= len(text):
            return False  # not yet written (or other keys between: never read)
        if text[key.end()] != "{":
            self.state = "off"
            return False
        self.call = ToolCall(name, "")
        self.pos = self.start = self.shown = key.end()
        self.state, self.depth = "arguments", 0
        return True

    def _show(self) -> None:
        if self.pos > self.shown:
            self.pieces.append(CallDelta(self.call, self.text[self.shown:self.pos]))
            self.shown = self.pos

    def _read_arguments(self) -> bool:
        """Reads on; True when the arguments value has closed (at self.pos)."""
        text = self.text
        while self.pos < len(text):
            c = text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return True
        return False

    def progress(self) -> list[CallDelta]:
        """The pieces of arguments written since it was last asked."""
        pieces, self.pieces = self.pieces, []
        return pieces


class ForcedCallCollector:
    """tool_choice 'required' or named: the whole output is the (grammar-checked) call JSON,
    `{"name": ..., "arguments": ...}` or a list of them, written compactly in this key order.
    Each call is returned as soon as its arguments close, with the model's own text as its
    arguments; `progress()` gives the arguments as they are written, for streaming. A call the
    length limit cut is never returned, and the JSON is never shown as text."""

    def __init__(self) -> None:
        self.reader = CallReader()

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        return "", self.reader.read(self.reader.text + delta)

    def progress(self) -> list[CallDelta]:
        return self.reader.progress()

    def dropped(self) -> list[ToolCall]:
        return []  # a cut call's block is closed by whoever streamed it

    def finish(self) -> tuple[str, list[ToolCall]]:
        return "", []  # a call the length limit cut is not returned, nor shown
